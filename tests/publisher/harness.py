"""Helpers for the agent's tests: a simulator on a real socket, an agent in-process, and a
consumer group that records everything the agent publishes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from publisher import Agent, AgentSettings
from publisher._settings import ENV_PREFIX
from publisher.simulator import Simulator, SimulatorConfig, SimulatorServer, serve
from schemas import (
    Approval,
    LifecycleMessage,
    MessageType,
    ReplyAddress,
    ScheduledEventsDocument,
    TransitionMessage,
    VmIdentity,
    decode,
    diff,
    new_approval,
    sign,
)
from schemas.channels import ChannelNames
from schemas.transport import Transport, open_transport

GROUP = "audit"


@dataclass
class Recorder:
    """Reads the consumer group's copy of the stream into ``messages`` (acking each)."""

    transport: Transport
    messages: list[LifecycleMessage] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    received_at: list[float] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        async with self.transport.subscribe(GROUP) as subscription:
            async for delivery in subscription:
                self.messages.append(decode(delivery.body))
                self.bodies.append(delivery.body)
                self.received_at.append(asyncio.get_running_loop().time())
                await delivery.ack()
                self._changed.set()

    def of(self, *kinds: MessageType) -> list[LifecycleMessage]:
        return [m for m in self.messages if m.kind in kinds]

    def transitions(self) -> list[LifecycleMessage]:
        return [m for m in self.messages if m.kind.is_transition]

    async def wait_for(
        self, predicate: Callable[[list[LifecycleMessage]], bool], within: float = 10.0
    ) -> list[LifecycleMessage]:
        async with asyncio.timeout(within):
            while not predicate(self.messages):
                self._changed.clear()
                await self._changed.wait()
        return self.messages

    async def wait_kind(self, kind: MessageType, count: int = 1, within: float = 10.0) -> None:
        await self.wait_for(lambda ms: sum(m.kind == kind for m in ms) >= count, within)


@contextlib.asynccontextmanager
async def simulator_server(
    *vms: str, speed: float = 1.0, rate_limit: int = 5
) -> AsyncIterator[SimulatorServer]:
    sim = Simulator(SimulatorConfig(speed=speed, rate_limit=rate_limit, seed=None), vms=vms)
    async with serve(sim) as server:
        yield server


@contextlib.asynccontextmanager
async def recorder(broker: str, channels: ChannelNames) -> AsyncIterator[Recorder]:
    transport = open_transport(broker, channels)
    async with transport:
        await transport.declare_group(GROUP)
        rec = Recorder(transport)
        task = asyncio.create_task(rec.run())
        try:
            yield rec
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def settings_for(
    server: SimulatorServer,
    vm: str,
    broker: str,
    channels: ChannelNames,
    state_dir: Path | None,
    **overrides: Any,
) -> AgentSettings:
    values: dict[str, Any] = {
        "imds_url": server.vm_url(vm),
        "broker": broker,
        "state_dir": state_dir,
        "channels": channels,
        "imds_first_timeout": 10.0,
        "drain_timeout": 5.0,
    }
    values.update(overrides)
    return AgentSettings(**values)


@contextlib.asynccontextmanager
async def running(settings: AgentSettings, *, ready_timeout: float = 15.0) -> AsyncIterator[Agent]:
    """An agent running in a task, stopped (and awaited) when the block exits."""
    agent = Agent(settings)
    task = asyncio.create_task(agent.run())
    try:
        ready = asyncio.ensure_future(agent.started())
        done, _ = await asyncio.wait(
            {ready, task}, timeout=ready_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if task in done:
            task.result()
            raise AssertionError("the agent stopped before it was ready")
        if ready not in done:
            ready.cancel()
            raise AssertionError("the agent was not ready in time")
        yield agent
    finally:
        agent.stop("test over")
        async with asyncio.timeout(20):
            await task


async def spawn_agent(args: Sequence[str], log: Path) -> asyncio.subprocess.Process:
    """``python -m publisher`` with ``args``, its stderr appended to ``log``, without the
    caller's ``SCHEDULED_EVENTS_*`` settings (the agent's environment variables: a developer's
    own would change what the test runs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    with log.open("ab") as stderr:  # the child keeps its own copy of the descriptor
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "publisher", *args,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=stderr,
            env=env,
        )  # fmt: skip


async def eventually(predicate: Callable[[], bool], within: float = 10.0) -> None:
    """Wait until ``predicate()`` holds, checking every 50 ms; TimeoutError after ``within``."""
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 (state of another component, no event to wait on)
            await asyncio.sleep(0.05)


def version_of(simulator: Simulator, event_id: str) -> str:
    """The event version of ``event_id`` as the simulator's IMDS shows it now (what an approver
    that judged it now would bind its approval to); a made-up version for an unknown event."""
    from schemas import ScheduledEvent, event_version

    for vm in simulator.vm_names():
        for raw in simulator.scheduled_events_document(vm)["Events"]:
            if raw["EventId"].casefold() == event_id.casefold():
                return event_version(ScheduledEvent.from_imds(raw))
    return "0" * 32


def signed_approval(
    simulator: Simulator, event_id: str, vm: str, key: Any, *, decided_by: str = "test"
) -> Approval:
    """An approval of ``event_id`` for ``vm``, bound to the version the simulator shows now,
    signed with ``key``."""
    approval = new_approval(
        event_id, vm, decided_by=decided_by, event_version=version_of(simulator, event_id)
    )
    return sign(approval, key)


def scheduled_freezes(event_ids: Sequence[str], vm: str = "web-7") -> list[TransitionMessage]:
    """The ``scheduled`` transitions of Freezes ``event_ids`` on ``vm``, as its agent builds
    them (from one document that lists them all), in the order of ``event_ids``."""
    document = ScheduledEventsDocument.from_imds(
        {
            "DocumentIncarnation": 1,
            "Events": [
                {
                    "EventId": event_id,
                    "EventStatus": "Scheduled",
                    "EventType": "Freeze",
                    "Resources": [vm],
                    "NotBefore": "",
                }
                for event_id in event_ids
            ],
        }
    )
    built = {
        t.event.event_id: TransitionMessage.build(
            t,
            vm=VmIdentity(name=vm),
            reply_to=ReplyAddress(channel="approvals", key=vm),
            observed_at=datetime.now(UTC),
        )
        for t in diff(None, document)
    }
    return [built[event_id] for event_id in event_ids]
