"""Nothing is lost: the agent as a subprocess killed with SIGKILL at random points of a scenario,
and the broker link cut and restored by a TCP proxy. Real RabbitMQ, simulator over HTTP."""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
from collections import defaultdict
from pathlib import Path

import pytest

from publisher._agent import _cancel_all
from publisher.simulator import EventSpec, EventStatus, EventType
from schemas import MessageType
from tests.transport.proxy import TcpProxy

from .harness import (
    Recorder,
    eventually,
    recorder,
    running,
    settings_for,
    simulator_server,
    spawn_agent,
)

pytestmark = [pytest.mark.rabbitmq]


def _check_stream(rec: Recorder, expected: dict[str, list[str]]) -> None:
    """Deduplicated by id, each event has exactly the expected transitions in order, and every
    repeat of a message carries the same bytes."""
    bodies: dict[str, bytes] = {}
    per_event: dict[str, list[str]] = defaultdict(list)
    for message, body in zip(rec.messages, rec.bodies, strict=True):
        if message.id in bodies:
            assert bodies[message.id] == body, f"message {message.id} repeated with other bytes"
            continue
        bodies[message.id] = body
        if message.kind.is_transition:
            per_event[message.subject or ""].append(message.kind.value)
    assert dict(per_event) == expected


@pytest.mark.slow
async def test_sigkill_at_random_points_loses_nothing(
    amqp_url: str, unique: str, tmp_path: Path
) -> None:
    pytest.importorskip("schemas.transport.rabbitmq")
    from schemas.channels import ChannelNames

    from .conftest import delete_rabbitmq_entities

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    channels = ChannelNames().suffixed(unique)
    kills = sorted(rng.uniform(0.3, 9.5) for _ in range(4))
    # One log a process (the first, and one after each kill): the test must know when the
    # last one is ready, not just any.
    logs = [tmp_path / f"agent-{n}.log" for n in range(len(kills) + 1)]

    def tails() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in logs if p.exists())

    try:
        async with (
            simulator_server("web-7") as server,
            recorder(amqp_url, channels) as rec,
        ):
            sim = server.simulator
            args = [
                "--imds-url", server.vm_url("web-7"),
                "--broker", amqp_url,
                "--channel-suffix", unique,
                "--state-dir", str(tmp_path / "state"),
                "--imds-first-timeout", "5",
                "--drain-timeout", "5",
                "--log-level", "DEBUG",
            ]  # fmt: skip
            process = await spawn_agent(args, logs[0])

            async def killer() -> int:
                nonlocal process
                began = time.monotonic()
                for n, at in enumerate(kills, start=1):
                    await asyncio.sleep(max(0.0, at - (time.monotonic() - began)))
                    process.kill()
                    await process.wait()
                    process = await spawn_agent(args, logs[n])
                return len(kills)

            kill_task = asyncio.create_task(killer())
            # Each state lasts longer than a restart takes, so every one is observable.
            a = sim.add_event(
                EventSpec(event_type=EventType.FREEZE, not_before_seconds=900, run_seconds=900)
            )
            b = sim.add_event(
                EventSpec(
                    event_type=EventType.REBOOT, event_status=EventStatus.STARTED, run_seconds=900
                )
            )
            await asyncio.sleep(2.5)
            sim.start_event(a.event_id)
            c = sim.add_event(EventSpec(event_type=EventType.REDEPLOY, not_before_seconds=900))
            await asyncio.sleep(2.5)
            sim.cancel_event(c.event_id)
            sim.complete_event(b.event_id)
            await asyncio.sleep(2.5)
            sim.complete_event(a.event_id)
            await asyncio.sleep(2.5)
            assert await kill_task == 4
            await rec.wait_for(
                lambda ms: (
                    {m.subject for m in ms if m.kind is MessageType.COMPLETED}
                    >= {a.event_id, b.event_id}
                ),
                within=20,
            )
            await rec.wait_kind(MessageType.CANCELED, within=10)
            # The stream may be whole before the last process has started (its predecessors
            # published everything): a SIGTERM while it still asks IMDS who it is stops it
            # before it has said agent.online, and then it says no agent.offline either.
            await eventually(lambda: "agent ready" in logs[-1].read_text(), within=20)
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 20) == 0
            await rec.wait_kind(MessageType.AGENT_OFFLINE, within=10)
            await asyncio.sleep(0.3)
        expected = {
            a.event_id: ["scheduled", "started", "completed"],
            b.event_id: ["started", "completed"],
            c.event_id: ["scheduled", "canceled"],
        }
        _check_stream(rec, expected)
        # One state dir, one sequence: first deliveries arrive in sequence order, no number
        # is given twice, whatever the kills.
        first: dict[str, int] = {}
        for message in rec.messages:
            first.setdefault(message.id, message.sequence)
        sequences = list(first.values())
        assert sequences == sorted(sequences)
        assert len(set(sequences)) == len(sequences)
        assert rec.of(MessageType.AGENT_ONLINE)
    except BaseException:
        print(f"seed {seed}, kills at {kills}\n{tails()}")
        raise
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await delete_rabbitmq_entities(amqp_url, channels, ["web-7"])


async def test_a_cut_broker_link_loses_nothing_and_publishing_resumes_quickly(
    amqp_url: str, unique: str, tmp_path: Path
) -> None:
    pytest.importorskip("schemas.transport.rabbitmq")
    from urllib.parse import urlsplit

    from schemas.channels import ChannelNames

    from .conftest import delete_rabbitmq_entities

    channels = ChannelNames().suffixed(unique)
    split = urlsplit(amqp_url)
    try:
        async with (
            TcpProxy(split.hostname or "127.0.0.1", split.port or 5672) as proxy,
            simulator_server("web-7") as server,
            recorder(amqp_url, channels) as rec,
        ):
            proxied = f"amqp://guest:guest@127.0.0.1:{proxy.port}/"
            settings = settings_for(server, "web-7", proxied, channels, tmp_path)
            sim = server.simulator
            async with running(settings) as agent:
                a = sim.add_event(
                    EventSpec(event_type=EventType.FREEZE, not_before_seconds=900, run_seconds=900)
                )
                await rec.wait_kind(MessageType.SCHEDULED)
                await proxy.cut()
                b = sim.add_event(EventSpec(event_type=EventType.REBOOT, not_before_seconds=900))
                sim.start_event(a.event_id)
                await asyncio.sleep(2.0)  # the agent sees both, cannot publish them
                depth = agent.health()[1]["outbox_depth"]
                assert isinstance(depth, int)
                assert depth >= 2
                count = len(rec.messages)
                await proxy.restore()
                restored = time.monotonic()
                await rec.wait_for(lambda ms: len(ms) > count, within=10)
                resumed = time.monotonic() - restored
                await rec.wait_kind(MessageType.STARTED)
                await rec.wait_for(lambda ms: any(m.subject == b.event_id for m in ms))
            await rec.wait_kind(MessageType.AGENT_OFFLINE)
        _check_stream(rec, {a.event_id: ["scheduled", "started"], b.event_id: ["scheduled"]})
        assert resumed < 1.0, f"publishing resumed {resumed:.2f} s after the link came back"
    finally:
        await delete_rabbitmq_entities(amqp_url, channels, ["web-7"])


async def test_a_stop_names_a_task_that_ignores_its_cancel_and_not_one_still_finishing(caplog):
    """At a stop each task is cancelled, then cancelled again each second until it ends. One
    finishing an exchange with the broker (a channel's close, bounded by its own timeout) is
    still stopping: said at INFO. Only one still there after ``patience`` is a warning: a fleet
    of agents stopping at once on a busy broker logged a false "did not stop" for each."""

    async def finishing(cancels_taken: int) -> None:
        taken = 0
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                taken += 1
                if taken > cancels_taken:
                    raise

    caplog.set_level(logging.INFO, logger="publisher._agent")
    quick = asyncio.create_task(finishing(1), name="agent-quick")
    await asyncio.sleep(0)  # under way
    await _cancel_all([quick])
    assert quick.cancelled()
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [
        (
            logging.INFO,
            "agent-quick still stopping 1 s after its cancel (finishing an exchange with the "
            "broker?): cancelling it again",
        )
    ]

    caplog.clear()
    stuck = asyncio.create_task(finishing(2), name="agent-stuck")
    await asyncio.sleep(0)
    await _cancel_all([stuck], patience=1.5)
    assert stuck.cancelled()
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == [logging.INFO, logging.WARNING]
    assert said[1][1] == "agent-stuck did not stop 2 s after its cancel: cancelling it again"
