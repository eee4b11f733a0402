"""Approver failover loses nothing: two approver processes in one group share one database; the
active one is killed with SIGKILL; the standby takes over with the same knowledge — live events
and their phases, approvals sent, hook results, agent identities, who is unavailable.

On the real RabbitMQ and on the Service Bus double (the real SDK), with the simulator over HTTP
and real agents; the approvers are the command-line service, as an operator runs them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from consumers._audit import open_ledger
from publisher import Agent, HookSpec
from publisher.simulator import (
    EventSource,
    EventSpec,
    EventState,
    EventType,
    Simulator,
    SimulatorConfig,
    serve,
)
from schemas import ChannelNames, load_signing_key
from schemas.approvals import write_key_pair
from schemas.transitions import TransitionKind

from ._agents import agent_settings

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).parents[2]
VMS = ("web_0", "web_1")  # one scale set, "web"


@dataclass
class Broker:
    url: str
    suffix: str
    channels: ChannelNames


@contextlib.contextmanager
def _servicebus(suffix: str) -> Iterator[Broker]:
    from tests.servicebus_double import EntityOptions, ServiceBusDouble

    channels = ChannelNames().suffixed(suffix)
    double = ServiceBusDouble(
        session_queues=[channels.approvals_queue],
        session_topics={channels.events_topic: ["approver"]},
        options=EntityOptions(lock_duration=5.0),
    )
    with double:
        yield Broker(double.connection_string, suffix, channels)


@contextlib.asynccontextmanager
async def _broker(kind: str, request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    suffix = uuid.uuid4().hex[:10]
    if kind == "servicebus":
        with _servicebus(suffix) as broker:
            yield broker
        return
    url: str = request.getfixturevalue("amqp_url")
    channels = ChannelNames().suffixed(suffix)
    try:
        yield Broker(url, suffix, channels)
    finally:
        from schemas.transport.rabbitmq import RabbitMQTransport

        async with RabbitMQTransport(url, channels) as cleaner:
            await cleaner.delete_topology(groups=["approver"], vms=VMS, exchanges=True)


BROKERS = [
    pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
    pytest.param("servicebus", marks=pytest.mark.servicebus),
]


def _approver(
    broker: Broker, key: Path, policy: Path, db: str, log: Path
) -> subprocess.Popen[bytes]:
    with log.open("ab") as stderr:
        return subprocess.Popen(
            [
                sys.executable, "-m", "consumers", "approver",
                "--broker", broker.url, "--channel-suffix", broker.suffix,
                "--signing-key", str(key), "--policy", str(policy), "--db", db,
                # the agents of the test all connect as guest: no per-VM users to check
                "--origin", "any",
            ],
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )  # fmt: skip


async def _text(path: Path, text: str, within: float = 30) -> None:
    async with asyncio.timeout(within):
        while text not in path.read_text():  # noqa: ASYNC110, ASYNC240 - another process writes
            await asyncio.sleep(0.05)


async def _state(sim: Simulator, event_id: str, state: EventState, within: float = 30) -> None:
    await sim.wait_for_state(event_id, state, within=within)


def _stop(*processes: subprocess.Popen[bytes] | None) -> None:
    for process in processes:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(15)
            if process.poll() is None:
                process.kill()


@contextlib.asynccontextmanager
async def _fleet(
    broker: Broker, sim: Simulator, url_of: Any, public: Path, hooks: dict[str, str] | None = None
) -> AsyncIterator[list[Agent]]:
    agents = [
        Agent(
            agent_settings(
                url_of(name),
                broker.url,
                broker.channels,
                public,
                None,
                heartbeat_interval=2.0,
                hooks=(
                    (HookSpec(frozenset({TransitionKind.SCHEDULED}), hooks[name]),)
                    if hooks and name in hooks
                    else ()
                ),
            )
        )
        for name in VMS
    ]
    runs = [asyncio.create_task(agent.run()) for agent in agents]
    try:
        async with asyncio.timeout(30):
            for agent in agents:
                await agent.started()
        yield agents
    finally:
        for agent in agents:
            agent.stop("test over")
        async with asyncio.timeout(20):
            await asyncio.gather(*runs, return_exceptions=True)


async def _decisions(db: str, event_id: str) -> list[tuple[str, str]]:
    async with open_ledger(db, create=False) as ledger:
        entries = await ledger.history(event_id=event_id)
    return [(e.kind, str(e.body.get("reason", ""))) for e in entries if e.record == "decision"]


@pytest.mark.parametrize("kind", BROKERS)
async def test_the_standby_knows_who_is_down_after_the_active_approver_is_killed(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A user Reboot of web_0 is approved and Started; the active approver is killed; a user
    Reboot of web_1 appears: the standby must wait (web_0 is down; one VM of the scale set at a
    time) and approve web_1 only once web_0's event completed."""
    _, public = write_key_pair(tmp_path)
    key = tmp_path / "approver.key"
    load_signing_key(key)
    policy = tmp_path / "policy.toml"
    policy.write_text(
        '[approve.user_initiated]\n[[max_unavailable]]\ngroup_by = "scale_set"\ncount = 1\n'
    )
    db = f"sqlite:///{tmp_path / 'central.db'}"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    sim = Simulator(SimulatorConfig(rate_limit=0), vms=list(VMS))
    first = second = None
    async with _broker(kind, request) as broker, serve(sim) as server:
        try:
            first = _approver(broker, key, policy, db, logs[0])
            await _text(logs[0], "reading group")
            await asyncio.sleep(1.0)  # the first one is the active one
            second = _approver(broker, key, policy, db, logs[1])
            await _text(logs[1], "reading group")
            async with _fleet(broker, sim, server.vm_url, public):
                web_0 = sim.add_event(
                    EventSpec(
                        event_type=EventType.REBOOT,
                        event_source=EventSource.USER,
                        resources=("web_0",),
                        not_before_seconds=900,
                        run_seconds=3600,
                    )
                )
                await _state(sim, web_0.event_id, EventState.STARTED)
                await asyncio.sleep(1.0)  # the agents report it Started; the active one acks it
                first.send_signal(signal.SIGKILL)
                first.wait(10)
                web_1 = sim.add_event(
                    EventSpec(
                        event_type=EventType.REBOOT,
                        event_source=EventSource.USER,
                        resources=("web_1",),
                        not_before_seconds=900,
                        run_seconds=5,
                    )
                )
                await _text(logs[1], f"decision on {web_1.event_id}", within=40)
                await asyncio.sleep(2.0)
                assert sim.get_event(web_1.event_id).state is EventState.SCHEDULED, (
                    "the standby approved web_1 while web_0 was down"
                )
                sim.complete_event(web_0.event_id)
                await _state(sim, web_1.event_id, EventState.STARTED, within=30)
        finally:
            _stop(first, second)
            for path in logs:
                print(path.name, path.read_text() if path.exists() else "(none)")
    assert first is not None
    assert first.returncode == -signal.SIGKILL
    assert [a.vm for a in sim.get_event(web_1.event_id).approvals] == ["web_1"]
    decided = await _decisions(db, web_1.event_id)
    kinds = [k for k, _ in decided]
    assert kinds[0] == "decision.wait", decided
    assert "would be unavailable" in decided[0][1]
    assert kinds[-1] == "decision.approve"
    assert f"decision on {web_1.event_id}" in logs[1].read_text()


@pytest.mark.parametrize("kind", BROKERS)
async def test_hooks_reported_on_both_sides_of_a_failover_lead_to_one_approval(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A hooks_done event: web_0's hook reports to the approver that is then killed, web_1's
    to the standby; the standby approves once the last hook reports, knowing web_0's."""
    _, public = write_key_pair(tmp_path)
    key = tmp_path / "approver.key"
    policy = tmp_path / "policy.toml"
    policy.write_text('[approve.hooks_done]\nevent_types = ["Reboot"]\n')
    db = f"sqlite:///{tmp_path / 'central.db'}"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    gate = tmp_path / "web_1-may-drain"
    waiter = tmp_path / "wait.py"
    waiter.write_text(
        f"import pathlib, time\nwhile not pathlib.Path({str(gate)!r}).exists():\n"
        "    time.sleep(0.05)\n"
    )
    hooks = {"web_0": "true", "web_1": f"{sys.executable} {waiter}"}
    sim = Simulator(SimulatorConfig(rate_limit=0), vms=list(VMS))
    first = second = None
    async with _broker(kind, request) as broker, serve(sim) as server:
        try:
            first = _approver(broker, key, policy, db, logs[0])
            await _text(logs[0], "reading group")
            await asyncio.sleep(1.0)
            second = _approver(broker, key, policy, db, logs[1])
            await _text(logs[1], "reading group")
            async with _fleet(broker, sim, server.vm_url, public, hooks):
                reboot = sim.add_event(
                    EventSpec(
                        event_type=EventType.REBOOT,
                        resources=VMS,
                        not_before_seconds=900,
                        run_seconds=5,
                    )
                )
                await _text(logs[0], "waiting for hooks on web_1", within=40)
                first.send_signal(signal.SIGKILL)
                first.wait(10)
                gate.write_text("go")
                await _state(sim, reboot.event_id, EventState.STARTED, within=40)
        finally:
            _stop(first, second)
            for path in logs:
                print(path.name, path.read_text() if path.exists() else "(none)")
    approvals = sim.get_event(reboot.event_id).approvals
    assert len(approvals) == 1  # one approval starts it for both
    assert "every VM in Resources reported its hooks done" in logs[1].read_text()
    decided = await _decisions(db, reboot.event_id)
    assert [k for k, _ in decided].count("decision.approve") == 1, decided
