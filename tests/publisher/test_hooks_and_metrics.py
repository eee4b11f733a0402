"""Local hooks run on chosen transitions and their result is published; /metrics and /healthz
answer on the local port; the outbox bound drops heartbeats and never transitions."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from publisher import HookSpec
from publisher._state import StateStore
from publisher.simulator import EventSpec, EventType
from schemas import (
    AgentData,
    AgentMessage,
    HookResultMessage,
    MessageType,
    ReplyAddress,
    ScheduledEventsDocument,
    TransitionMessage,
    VmIdentity,
    diff,
)
from schemas.channels import ChannelNames
from schemas.transitions import TransitionKind

from .harness import recorder, running, settings_for, simulator_server

HOOK = """
import json, os, sys
event = json.load(sys.stdin)
print("hook saw", os.environ["EVENT_ID"], os.environ["EVENT_TYPE"], os.environ["EVENT_STATUS"],
      os.environ["TRANSITION"], repr(os.environ["NOT_BEFORE"]), event["data"]["event"]["EventId"])
sys.exit(3 if os.environ["EVENT_TYPE"] == "Reboot" else 0)
"""


async def test_a_hook_runs_on_its_transitions_and_its_result_is_published(tmp_path: Path) -> None:
    script = tmp_path / "hook.py"
    script.write_text(HOOK)
    slow = tmp_path / "slow.py"
    slow.write_text("import time; time.sleep(30)")
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:8])
    broker = f"memory://hooks-{uuid.uuid4().hex[:6]}"
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        sim = server.simulator
        settings = settings_for(
            server,
            "web-7",
            broker,
            channels,
            None,
            hooks=(
                HookSpec(frozenset({TransitionKind.SCHEDULED}), f"{sys.executable} {script}"),
                HookSpec(frozenset({TransitionKind.CANCELED}), f"{sys.executable} {slow}"),
            ),
            hook_timeout=1.0,
        )
        async with running(settings):
            freeze = sim.add_event(EventSpec(event_type=EventType.FREEZE, not_before_seconds=900))
            reboot = sim.add_event(EventSpec(event_type=EventType.REBOOT, not_before_seconds=900))
            await rec.wait_kind(MessageType.HOOK_COMPLETED, 2)
            sim.cancel_event(freeze.event_id)
            await rec.wait_kind(MessageType.HOOK_COMPLETED, 3)
    results = [m for m in rec.messages if isinstance(m, HookResultMessage)]
    by_event = {(m.data.event.event_id, m.data.transition): m.data for m in results}
    ok = by_event[(freeze.event_id, "scheduled")]
    assert ok.exit_code == 0
    assert ok.succeeded
    assert f"hook saw {freeze.event_id} Freeze Scheduled scheduled" in ok.output_tail
    assert "GMT" in ok.output_tail  # NOT_BEFORE in RFC 1123
    assert ok.output_tail.strip().endswith(freeze.event_id)  # the JSON on stdin
    failed = by_event[(reboot.event_id, "scheduled")]
    assert failed.exit_code == 3
    assert not failed.succeeded
    late = by_event[(freeze.event_id, "canceled")]
    assert late.timed_out
    assert not late.succeeded
    assert 1.0 <= late.duration_seconds < 10


async def test_metrics_and_healthz_on_the_local_port(tmp_path: Path) -> None:
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:8])
    broker = f"memory://metrics-{uuid.uuid4().hex[:6]}"
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        settings = settings_for(server, "web-7", broker, channels, None, metrics_port=0)
        async with running(settings) as agent:
            server.simulator.add_event(
                EventSpec(event_type=EventType.FREEZE, not_before_seconds=900)
            )
            await rec.wait_kind(MessageType.SCHEDULED)
            await asyncio.sleep(0.2)
            base = f"http://127.0.0.1:{agent.metrics_port}"
            async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
                health = await client.get(f"{base}/healthz")
                metrics = (await client.get(f"{base}/metrics")).text
                missing = await client.get(f"{base}/nothing")
    assert health.status_code == 200
    assert health.json()["healthy"] is True
    assert health.json()["vm"] == "web-7"
    assert 'agent_transitions_total{kind="scheduled"} 1.0' in metrics
    assert "agent_imds_polls_total" in metrics
    assert "agent_outbox_depth 0.0" in metrics
    assert "agent_publish_latency_seconds_count" in metrics
    assert missing.status_code == 404


def _vm() -> VmIdentity:
    return VmIdentity(name="web-7")


async def test_the_outbox_bound_drops_heartbeats_first_and_never_transitions(
    tmp_path: Path,
) -> None:
    store = await StateStore.open(tmp_path, limit=3)
    try:
        reply = ReplyAddress(channel="approvals", key="web-7")
        from datetime import UTC, datetime, timedelta

        now = datetime.now(UTC)

        def heartbeat(i: int) -> AgentMessage:
            data = AgentData(vm=_vm(), agent_version="t", reply_to=reply)
            return AgentMessage.build(
                MessageType.AGENT_HEARTBEAT,
                data,
                observed_at=now + timedelta(seconds=i),
                instance="i",
            )

        await store.commit([heartbeat(1), heartbeat(2)])
        document = ScheduledEventsDocument.from_imds(
            {
                "DocumentIncarnation": 1,
                "Events": [
                    {
                        "EventId": f"E{i}",
                        "EventStatus": "Scheduled",
                        "EventType": "Freeze",
                        "Resources": ["web-7"],
                        "NotBefore": "",
                    }
                    for i in range(4)
                ],
            }
        )
        transitions = [
            TransitionMessage.build(t, vm=_vm(), reply_to=reply, observed_at=now)
            for t in diff(None, document)
        ]
        result = await store.commit(transitions, document=document)
        assert result.dropped == 2
        assert len(result.rows) == 4
        rows = await store.pending()
        assert [r.kind for r in rows] == ["scheduled"] * 4  # over the bound, all kept
        assert [r.sequence for r in rows] == [3, 4, 5, 6]
        await store.commit([heartbeat(3)])  # full of transitions: the new heartbeat goes
        assert await store.depth() == 4
    finally:
        await store.close()
    # Reopened: the document, the sequence and the outbox survived.
    store = await StateStore.open(tmp_path, limit=3)
    try:
        state = await store.load()
        assert state.document == document
        assert state.next_sequence == 8
        assert [json.loads(r.body)["sequence"] for r in await store.pending()] == [3, 4, 5, 6]
    finally:
        await store.close()


async def test_a_full_disk_is_what_a_failed_commit_of_the_state_says(tmp_path: Path) -> None:
    """A full disk (here SQLite's own page limit) ends the transaction inside SQLite. The
    error the agent logs is that one ("database or disk is full"): before, the ROLLBACK that
    followed failed as well ("no transaction is active") and its error hid the cause. Once
    there is room, the next commit goes through."""
    import sqlite3
    from datetime import UTC, datetime, timedelta

    store = await StateStore.open(tmp_path, limit=10_000)
    try:
        reply = ReplyAddress(channel="approvals", key="web-7")
        now = datetime.now(UTC)
        data = AgentData(vm=_vm(), agent_version="t", reply_to=reply)
        beats = [
            AgentMessage.build(
                MessageType.AGENT_HEARTBEAT,
                data,
                observed_at=now + timedelta(seconds=i),
                instance="i",
            )
            for i in range(300)
        ]
        pages = (await store._run(lambda db: db.execute("PRAGMA page_count").fetchone()))[0]
        await store._run(lambda db: db.execute(f"PRAGMA max_page_count = {pages + 2}"))
        with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):
            await store.commit(beats)
        assert await store.depth() == 0
        await store._run(lambda db: db.execute("PRAGMA max_page_count = 1000000"))
        await store.commit(beats)
        assert await store.depth() == 300
    finally:
        await store.close()
