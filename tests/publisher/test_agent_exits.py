"""A part of the agent that fails ends the agent: ``Agent.run`` returns (with the error) so that
a supervisor (systemd) starts it again, instead of hanging with no polling and no publishing.

On Python 3.11 ``asyncio.wait_for`` returns its result and drops a cancel that arrives as the
awaited work completes; a library may also turn a cancel into an error of its own. A task
group cancels each task once when one fails, and then waits for all of them: one cancel lost
held the group, and ``Agent.run``, for ever."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from publisher import Agent
from publisher._hooks import HookRunner
from publisher._observability import Metrics
from publisher._outbox import OutboxPublisher
from publisher._state import StateStore
from schemas import (
    AgentData,
    AgentMessage,
    MessageType,
    ReplyAddress,
    TransportError,
    VmIdentity,
)
from schemas.channels import ChannelNames
from schemas.transport import MemoryTransport, OutgoingMessage

from .harness import settings_for, simulator_server


def _heartbeat() -> AgentMessage:
    data = AgentData(
        vm=VmIdentity(name="web-7"),
        agent_version="t",
        reply_to=ReplyAddress(channel="approvals", key="web-7"),
    )
    return AgentMessage.build(
        MessageType.AGENT_HEARTBEAT, data, observed_at=datetime.now(UTC), instance="i"
    )


async def test_a_cancel_that_comes_as_a_publish_completes_stops_the_publisher() -> None:
    """The cancel reaches the publisher in the same turn of the loop as its publish's confirm:
    the publisher stops (before, wait_for returned the confirm, the cancel was lost and the
    publisher went back to waiting for work)."""
    unique = uuid.uuid4().hex[:8]
    runner: list[asyncio.Task[None]] = []

    class CancelledAsItConfirms(MemoryTransport):
        async def publish(self, message: OutgoingMessage) -> None:
            await super().publish(message)
            runner[0].cancel()  # the confirm is in: the cancel arrives with it

    store = await StateStore.open(None)
    transport = CancelledAsItConfirms(unique, ChannelNames().suffixed(unique))
    try:
        await transport.connect()
        await store.commit([_heartbeat()])
        outbox = OutboxPublisher(store, transport, Metrics())
        runner.append(asyncio.create_task(outbox.run()))
        done, _ = await asyncio.wait(runner, timeout=5)
        assert done, "the publisher went on after its cancel"
        assert runner[0].cancelled()
    finally:
        for task in runner:
            task.cancel()
        await transport.close()
        await store.close()


async def test_a_failed_part_ends_the_agent_even_when_another_disguises_its_cancel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One part of the agent (here the hook runner) fails while another (here the broker
    library under the outbox) turns its cancel into a link error, which the outbox takes for a
    failed publish and retries: the agent cancels what is left until it ends, as it does at a
    stop, and ``run()`` raises the failure."""
    unique = uuid.uuid4().hex[:8]
    publishing = asyncio.Event()

    class DisguisesItsCancel(MemoryTransport):
        disguised = False

        async def publish(self, message: OutgoingMessage) -> None:
            publishing.set()
            try:
                await asyncio.Event().wait()  # a confirm that does not come
            except asyncio.CancelledError as exc:
                if self.disguised:
                    raise
                self.disguised = True  # the first cancel only
                raise TransportError("channel closed: CHANNEL_ERROR") from exc

    async def fails(self: HookRunner) -> None:
        await publishing.wait()
        raise RuntimeError("a part of the agent failed")

    monkeypatch.setattr(HookRunner, "run", fails)
    channels = ChannelNames().suffixed(unique)
    transport = DisguisesItsCancel(unique, channels)
    async with simulator_server("web-7") as server:
        settings = settings_for(
            server, "web-7", f"memory://{unique}", channels, tmp_path, publish_timeout=60.0
        )
        task = asyncio.create_task(Agent(settings, transport=transport).run())
        done, _ = await asyncio.wait({task}, timeout=10)
        for _ in range(5):  # the test's own clean-up when the agent hangs
            if task.done():
                break
            for left in asyncio.all_tasks():
                if left.get_name().startswith("agent-") or left is task:
                    left.cancel()
            await asyncio.wait({task}, timeout=1)
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: the assertions below say what it is
        assert done, "Agent.run neither works nor returns after one of its parts failed"
        with pytest.raises(ExceptionGroup) as caught:
            task.result()
        assert caught.group_contains(RuntimeError, match="a part of the agent failed")
