"""What the agent stored is never thrown away or misreported: an approval POSTed just before a
kill is reported as applied, a hook cut off by a kill is reported (or run again), a replayed
approval after the state was wiped is reported as a repeat, a row that cannot be sent is set
aside (and /healthz says so) while the rest flow, and the approval attempt cap counts itself.

The agent runs as a subprocess killed with SIGKILL where a crash matters; the simulator over
HTTP; RabbitMQ where the broker's redelivery is the point."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from publisher.simulator import EventSpec, EventState, EventType, FaultSpec
from schemas import (
    ApprovalOutcomeMessage,
    HookResultMessage,
    LifecycleMessage,
    MessageType,
    load_signing_key,
    new_approval,
    sign,
)
from schemas.approvals import write_key_pair
from schemas.channels import ChannelNames
from schemas.transport import open_transport
from schemas.wire import approval_message

from .harness import (
    Recorder,
    eventually,
    recorder,
    running,
    settings_for,
    signed_approval,
    simulator_server,
    spawn_agent,
    version_of,
)


async def _outcomes(
    rec: Recorder, approval_id: str, count: int = 1
) -> list[ApprovalOutcomeMessage]:
    def found(messages) -> bool:
        return (
            sum(
                isinstance(m, ApprovalOutcomeMessage) and m.data.approval_id == approval_id
                for m in messages
            )
            >= count
        )

    messages = await rec.wait_for(found, within=20)
    return [
        m
        for m in messages
        if isinstance(m, ApprovalOutcomeMessage) and m.data.approval_id == approval_id
    ]


def _args(server, vm: str, broker: str, suffix: str, state: Path, *extra: str) -> list[str]:
    return [
        "--imds-url", server.vm_url(vm), "--broker", broker, "--channel-suffix", suffix,
        "--state-dir", str(state), "--imds-first-timeout", "5", "--drain-timeout", "3",
        "--poll-interval", "0.3", "--log-level", "DEBUG", *extra,
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.rabbitmq
async def test_a_hook_cut_off_by_a_kill_is_reported_interrupted_or_run_again(
    amqp_url: str, tmp_path: Path
) -> None:
    """A hooks_done policy must never wait for a hook that will never report."""
    unique = uuid.uuid4().hex[:8]
    broker = amqp_url
    channels = ChannelNames().suffixed(unique)
    marker = tmp_path / "ran-once"
    script = tmp_path / "drain.py"
    # First run: hangs (killed with the agent); later runs: succeed at once.
    script.write_text(
        "import pathlib, sys, time\n"
        f"marker = pathlib.Path({str(marker)!r})\n"
        "if not marker.exists():\n"
        "    marker.write_text('x')\n"
        "    time.sleep(60)\n"
        "sys.exit(0)\n"
    )
    log = tmp_path / "agent.log"
    spawned: list[asyncio.subprocess.Process] = []

    async def spawn(args: list[str]) -> asyncio.subprocess.Process:
        process = await spawn_agent(args, log)
        spawned.append(process)
        return process

    try:
        async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
            sim = server.simulator
            for rerun, state in ((False, tmp_path / "a"), (True, tmp_path / "b")):
                marker.unlink(missing_ok=True)
                extra = ["--hook", f"scheduled={sys.executable} {script}"]
                if rerun:
                    extra.append("--hook-rerun-interrupted")
                args = _args(server, "web-7", broker, unique, state, *extra)
                process = await spawn(args)
                event = sim.add_event(
                    EventSpec(event_type=EventType.FREEZE, not_before_seconds=900)
                )
                async with asyncio.timeout(60):
                    while not marker.exists():  # noqa: ASYNC110 - the hook writes it
                        await asyncio.sleep(0.05)
                process.kill()  # while the hook runs
                await process.wait()
                process = await spawn(args)
                await rec.wait_for(_hook_reported(event.event_id), within=60)
                process.terminate()
                await process.wait()
                (result,) = [
                    m
                    for m in rec.messages
                    if isinstance(m, HookResultMessage) and m.data.event.event_id == event.event_id
                ]
                if rerun:
                    assert result.data.outcome == "ok"
                    assert result.data.attempt == 2
                    assert result.data.succeeded
                else:
                    assert result.data.outcome == "interrupted"
                    assert not result.data.succeeded
                sim.cancel_event(event.event_id)
    finally:
        from .conftest import delete_rabbitmq_entities

        for process in spawned:
            if process.returncode is None:
                process.kill()
                await process.wait()
        # The hook the kill cut off is an orphan now (systemd's KillMode=control-group would
        # end it with the agent); it sleeps for a minute: end it here.
        killer = await asyncio.create_subprocess_exec("pkill", "-f", str(script))
        await killer.wait()
        await delete_rabbitmq_entities(broker, channels, ["web-7"])


async def test_a_replayed_approval_after_the_state_was_wiped_is_reported_as_a_repeat(
    tmp_path: Path,
) -> None:
    unique = uuid.uuid4().hex[:8]
    broker, channels = f"memory://wipe-{unique}", ChannelNames().suffixed(unique)
    private, public = write_key_pair(tmp_path / "keys")
    key = load_signing_key(private)
    state = tmp_path / "state"
    async with simulator_server("web-7", "web-8") as server, recorder(broker, channels) as rec:
        sim = server.simulator
        # It waits for every VM's approval: after this VM's it is still Scheduled.
        event = sim.add_event(
            EventSpec(
                event_type=EventType.FREEZE,
                not_before_seconds=900,
                resources=("web-7", "web-8"),
                require_all_approvals=True,
            )
        )
        settings = settings_for(server, "web-7", broker, channels, state, trust_keys=(public,))
        async with running(settings):
            approval = signed_approval(sim, event.event_id, "web-7", key, decided_by="t")
            await _send(broker, channels, approval)
            (first,) = await _outcomes(rec, approval.approval_id)
        assert first.data.applied
        assert not first.data.repeat
        for path in state.iterdir():  # the state dir is wiped
            path.unlink()
        async with running(settings):  # the same approval, replayed by whoever kept a copy
            await _send(broker, channels, approval)
            outcomes = await _outcomes(rec, approval.approval_id, 2)
    second = outcomes[1]
    assert second.id != first.id  # a new happening, not a duplicate to drop
    assert second.data.applied
    assert second.data.repeat
    assert "before this agent's state was created" in second.data.detail


def _hook_reported(event_id: str) -> Callable[[list[LifecycleMessage]], bool]:
    def reported(messages: list[LifecycleMessage]) -> bool:
        return any(
            isinstance(m, HookResultMessage) and m.data.event.event_id == event_id for m in messages
        )

    return reported


async def _send(broker: str, channels: ChannelNames, approval) -> None:
    async with open_transport(broker, channels) as transport:
        await transport.send_approval(transport.reply_address("web-7"), approval_message(approval))


async def test_an_unreadable_outbox_row_is_set_aside_and_reported_and_the_rest_flow(
    tmp_path: Path,
) -> None:
    unique = uuid.uuid4().hex[:8]
    broker, channels = f"memory://aside-{unique}", ChannelNames().suffixed(unique)
    state = tmp_path / "state"
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        sim = server.simulator
        settings = settings_for(server, "web-7", broker, channels, state, metrics_port=0)
        async with running(settings):
            await rec.wait_kind(MessageType.AGENT_ONLINE)
        # Corrupt one stored row, as a broken disk or a downgrade could.
        db = sqlite3.connect(state / "agent-state.sqlite3")
        db.execute(
            "INSERT INTO outbox (sequence, message_id, kind, droppable, body, created) "
            "VALUES (9999, 'broken', 'scheduled', 0, x'00ff', 0)"
        )
        db.commit()
        db.close()
        async with running(settings) as agent:
            event = sim.add_event(EventSpec(event_type=EventType.FREEZE, not_before_seconds=900))
            await rec.wait_for(lambda ms: any(m.subject == event.event_id for m in ms), within=10)
            async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
                health = (await client.get(f"http://127.0.0.1:{agent.metrics_port}/healthz")).json()
                metrics = (await client.get(f"http://127.0.0.1:{agent.metrics_port}/metrics")).text
    assert health["outbox_set_aside"] == 1
    assert any("set aside" in reason for reason in health["reasons"])
    assert health["healthy"]  # the agent works; the row is kept for a person to look at
    assert "agent_outbox_set_aside 1.0" in metrics
    db = sqlite3.connect(state / "agent-state.sqlite3")
    kept = db.execute("SELECT message_id, why FROM outbox_set_aside").fetchall()
    db.close()
    assert kept == [("broken", "unreadable")]


@pytest.mark.rabbitmq
async def test_the_attempt_cap_counts_itself_on_a_classic_queue(
    amqp_url: str, tmp_path: Path
) -> None:
    """RabbitMQ's classic queue only says "redelivered": the agent counts attempts in its state
    store, so an approval IMDS cannot be asked about is refused after the cap, not retried
    forever."""
    unique = uuid.uuid4().hex[:8]
    channels = ChannelNames().suffixed(unique)
    private, public = write_key_pair(tmp_path / "keys")
    try:
        async with simulator_server("web-7") as server, recorder(amqp_url, channels) as rec:
            sim = server.simulator
            event = sim.add_event(EventSpec(event_type=EventType.FREEZE, not_before_seconds=900))
            settings = settings_for(
                server,
                "web-7",
                amqp_url,
                channels,
                tmp_path / "state",
                trust_keys=(public,),
                poll_interval=0.2,
            )
            async with running(settings):
                approval = sign(
                    new_approval(
                        event.event_id,
                        "web-7",
                        decided_by="t",
                        event_version=version_of(sim, event.event_id),
                    ),
                    load_signing_key(private),
                )
                sim.add_fault(
                    FaultSpec(vm="web-7", endpoint="scheduledevents", status=500, times=10_000)
                )
                await _send(amqp_url, channels, approval)
                (outcome,) = await _outcomes(rec, approval.approval_id)
                sim.clear_faults()
        assert not outcome.data.applied
        assert outcome.data.reason == "imds-refused"
        assert "5 attempts" in outcome.data.detail
        assert sim.get_event(event.event_id).state is EventState.SCHEDULED
    finally:
        from .conftest import delete_rabbitmq_entities

        await delete_rabbitmq_entities(amqp_url, channels, ["web-7"])


@pytest.mark.rabbitmq
@pytest.mark.slow
async def test_an_agent_killed_between_its_post_and_the_outcome_reports_it_applied(
    amqp_url: str, tmp_path: Path
) -> None:
    """The intent is durable before the POST: after kill -9 the agent reports the approval as
    applied (the event started because of it), not as event-not-scheduled."""
    unique = uuid.uuid4().hex[:8]
    channels = ChannelNames().suffixed(unique)
    private, public = write_key_pair(tmp_path / "keys")
    state = tmp_path / "state"
    log = tmp_path / "agent.log"
    try:
        async with simulator_server("web-7") as server, recorder(amqp_url, channels) as rec:
            sim = server.simulator
            event = sim.add_event(EventSpec(event_type=EventType.FREEZE, not_before_seconds=900))
            args = _args(server, "web-7", amqp_url, unique, state, "--trust-key", str(public))
            process = await spawn_agent(args, log)
            await eventually(lambda: "agent ready" in log.read_text(), 20)
            # IMDS takes 5 s to answer the POST: the agent is killed while it waits.
            sim.add_fault(
                FaultSpec(vm="web-7", endpoint="scheduledevents", method="POST", delay_seconds=5)
            )
            approval = sign(
                new_approval(
                    event.event_id,
                    "web-7",
                    decided_by="t",
                    event_version=version_of(sim, event.event_id),
                ),
                load_signing_key(private),
            )
            await _send(amqp_url, channels, approval)
            database = state / "agent-state.sqlite3"

            def intent_recorded() -> bool:
                db = sqlite3.connect(database)
                try:
                    return bool(db.execute("SELECT count(*) FROM approval_intents").fetchone()[0])
                finally:
                    db.close()

            async with asyncio.timeout(15):
                while not intent_recorded():  # noqa: ASYNC110 - another process writes it
                    await asyncio.sleep(0.02)
            # The POST leaves within a second (the agent's IMDS budget), IMDS answers 5 s later.
            await asyncio.sleep(2.0)
            process.kill()
            await process.wait()
            await sim.wait_for_state(event.event_id, EventState.STARTED, within=10)
            process = await spawn_agent(args, log)
            try:
                (outcome,) = await _outcomes(rec, approval.approval_id)
                await asyncio.sleep(1.0)  # the redelivered approval: acked, not reported again
            finally:
                process.terminate()
                await process.wait()
        outcomes = await _outcomes(rec, approval.approval_id)
    finally:
        from .conftest import delete_rabbitmq_entities

        await delete_rabbitmq_entities(amqp_url, channels, ["web-7"])
    assert outcome.data.applied, outcome.data.detail
    assert "before the agent restarted" in outcome.data.detail
    assert len(outcomes) == 1
    assert [a.vm for a in sim.get_event(event.event_id).approvals] == ["web-7"]
