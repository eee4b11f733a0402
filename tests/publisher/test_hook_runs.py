"""A hook is the operator's command, and what it does is a local input the agent must survive: a
command that cannot start is that run's ``not-started`` result, its output (however large, with
whatever bytes) costs the agent no more than the tail it keeps, and its result is always
published. The simulator over HTTP, the in-memory broker."""

from __future__ import annotations

import asyncio
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from publisher import HookSpec
from publisher._state import StateStore
from publisher.simulator import EventSpec, EventType
from schemas import (
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

from .harness import Recorder, recorder, running, settings_for, simulator_server


def _broker(name: str) -> tuple[str, ChannelNames]:
    unique = uuid.uuid4().hex[:8]
    return f"memory://{name}-{unique}", ChannelNames().suffixed(unique)


def _results(rec: Recorder) -> list[HookResultMessage]:
    return [m for m in rec.messages if isinstance(m, HookResultMessage)]


#: Commands an older agent (or settings built in code) accepted, which cannot start.
UNSTARTABLE = {
    "unbalanced-quote": '/bin/echo "unterminated',  # shlex.split raises ValueError
    "nothing-to-run": "   ",  # no program at all
    "missing": "/nonexistent/drain --now",  # OSError
}


@pytest.mark.parametrize("command", list(UNSTARTABLE.values()), ids=list(UNSTARTABLE))
async def test_a_hook_that_cannot_start_is_reported_not_started_and_the_agent_goes_on(
    command: str,
) -> None:
    broker, channels = _broker("hook-start")
    hook = HookSpec(frozenset({TransitionKind.SCHEDULED}), command)
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        settings = settings_for(
            server, "web-7", broker, channels, None, hooks=(hook,), poll_interval=0.2
        )
        async with running(settings):
            hooks = next(t for t in asyncio.all_tasks() if t.get_name() == "agent-hooks")
            server.simulator.add_event(
                EventSpec(event_type=EventType.FREEZE, not_before_seconds=900)
            )
            await rec.wait_kind(MessageType.HOOK_COMPLETED, within=10)
            assert not hooks.done(), f"the hook runner ended: {hooks.exception()!r}"
    (result,) = _results(rec)
    assert result.data.outcome == "not-started"
    assert result.data.exit_code is None
    assert result.data.output_tail.startswith("could not start:")


async def test_a_stored_run_of_a_hook_that_cannot_start_does_not_stop_a_restart(
    tmp_path: Path,
) -> None:
    """A run an older agent queued (its flag accepted then) is reported at the next start, even
    with no hook configured any more: before, it raised again at each start."""
    broker, channels = _broker("hook-stored")
    state = tmp_path / "state"
    bad = HookSpec(frozenset({TransitionKind.SCHEDULED}), '/bin/echo "unterminated')
    document = ScheduledEventsDocument.from_imds(
        {
            "DocumentIncarnation": 1,
            "Events": [
                {
                    "EventId": "E1",
                    "EventStatus": "Scheduled",
                    "EventType": "Freeze",
                    "Resources": ["web-7"],
                    "NotBefore": "",
                }
            ],
        }
    )
    (transition,) = [
        TransitionMessage.build(
            t,
            vm=VmIdentity(name="web-7"),
            reply_to=ReplyAddress(channel="approvals", key="web-7"),
            observed_at=datetime.now(UTC),
        )
        for t in diff(None, document)
    ]
    store = await StateStore.open(state)
    try:
        await store.commit([transition], document=document, hooks=[(0, str(bad))])
    finally:
        await store.close()
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        settings = settings_for(server, "web-7", broker, channels, state, poll_interval=0.2)
        async with running(settings):
            await rec.wait_kind(MessageType.HOOK_COMPLETED, within=10)
    (result,) = _results(rec)
    assert result.data.event.event_id == "E1"
    assert result.data.outcome == "not-started"
    store = await StateStore.open(state)
    try:
        assert await store.hook_runs() == []  # reported once, not again at the next start
    finally:
        await store.close()


async def test_a_hook_command_longer_than_200_characters_is_reported(tmp_path: Path) -> None:
    """A hook's command is no database key: a long one (a long path and arguments) is reported
    as it is (it once failed the contract's bound on names after the hook ran, and the stored
    run failed every restart again)."""
    broker, channels = _broker("hook-long")
    hook = HookSpec(
        frozenset({TransitionKind.SCHEDULED}),
        f"{sys.executable} -c pass " + " ".join(["--drain-timeout=600"] * 12),
    )
    assert len(hook.command) > 200
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        settings = settings_for(
            server, "web-7", broker, channels, None, hooks=(hook,), poll_interval=0.2
        )
        async with running(settings):
            server.simulator.add_event(
                EventSpec(event_type=EventType.FREEZE, not_before_seconds=900)
            )
            await rec.wait_kind(MessageType.HOOK_COMPLETED, within=10)
    (result,) = _results(rec)
    assert result.data.outcome == "ok"
    assert result.data.hook == hook.command
