"""A hook is the operator's command, and what it does is a local input the agent must survive: a
command that cannot start is that run's ``not-started`` result, its output (however large, with
whatever bytes) costs the agent no more than the tail it keeps, and its result is always
published. The simulator over HTTP, the in-memory broker."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

import publisher._hooks
from publisher import HookSpec
from publisher._state import StateStore
from publisher.simulator import EventSpec, EventType
from schemas import (
    HookResultData,
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

from .harness import Recorder, eventually, recorder, running, settings_for, simulator_server


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


@pytest.mark.parametrize(
    "command",
    ['/bin/echo "unterminated', "/bin/echo a\0b"],
    ids=["unbalanced-quote", "nul"],
)
async def test_a_stored_run_of_a_hook_that_cannot_start_does_not_stop_a_restart(
    command: str, tmp_path: Path
) -> None:
    """A run an older agent queued (its flag accepted then) is reported at the next start, even
    with no hook configured any more: before, it raised again at each start. A NUL in the
    command is replaced in the report (the contract refuses U+0000: the report was set aside)."""
    broker, channels = _broker("hook-stored")
    state = tmp_path / "state"
    bad = HookSpec(frozenset({TransitionKind.SCHEDULED}), command)
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
    assert result.data.hook == command.replace("\0", "\ufffd")
    store = await StateStore.open(state)
    try:
        assert await store.hook_runs() == []  # reported once, not again at the next start
    finally:
        await store.close()


async def test_a_hooks_output_does_not_grow_the_agents_memory(tmp_path: Path) -> None:
    """Only the last 2,000 bytes of a hook's output are reported; before, all of it was read
    into memory first (a hook writing 400 MB grew the agent by 783 MiB). The agent runs as its
    own process so its memory is its own."""
    broker, _ = _broker("hook-memory")
    log = tmp_path / "agent.log"
    hook = "scheduled=sh -c 'yes | head -c 200000000; echo the-end'"  # 200 MB
    async with simulator_server("web-7") as server:
        with log.open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "publisher",
                "--imds-url", server.vm_url("web-7"), "--broker", broker,
                "--state-dir", str(tmp_path / "state"), "--poll-interval", "0.3",
                "--imds-first-timeout", "5", "--hook", hook, "--hook-timeout", "60",
                stdout=asyncio.subprocess.DEVNULL, stderr=stderr,
                env={k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_EVENTS")},
            )  # fmt: skip
        try:
            await eventually(lambda: "agent ready" in log.read_text(), 30)
            agent = psutil.Process(process.pid)
            before = peak = agent.memory_info().rss
            server.simulator.add_event(
                EventSpec(event_type=EventType.FREEZE, not_before_seconds=900)
            )
            async with asyncio.timeout(60):
                while " (exit " not in log.read_text():
                    peak = max(peak, agent.memory_info().rss)
                    await asyncio.sleep(0.02)
            assert ": ok (exit 0" in log.read_text(), log.read_text()
            assert process.returncode is None, log.read_text()
        finally:
            process.terminate()
            await process.wait()
    assert (peak - before) / 2**20 < 30, f"{(peak - before) / 2**20:.1f} MiB more"


async def test_a_nul_byte_in_a_hooks_output_does_not_lose_its_result(tmp_path: Path) -> None:
    """The contract refuses U+0000 (no database text type stores it): a NUL in the output's
    tail made the result unpublishable, set aside. It is replaced, the rest kept."""
    broker, channels = _broker("hook-nul")
    script = tmp_path / "hook.py"
    script.write_text("import sys; sys.stdout.buffer.write(b'drained\\x00ok \\xff\\n')")
    hook = HookSpec(frozenset({TransitionKind.SCHEDULED}), f"{sys.executable} {script}")
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        settings = settings_for(
            server, "web-7", broker, channels, None, hooks=(hook,), poll_interval=0.2
        )
        async with running(settings) as agent:
            server.simulator.add_event(
                EventSpec(event_type=EventType.FREEZE, not_before_seconds=900)
            )
            await rec.wait_kind(MessageType.SCHEDULED, within=10)
            await eventually(
                lambda: (
                    agent.metrics.registry.get_sample_value("agent_hooks_total", {"result": "ok"})
                    == 1.0
                ),
                10,
            )
            outbox = agent._outbox
            assert outbox is not None
            await eventually(lambda: outbox.depth == 0, 5)
            assert outbox.set_aside == 0, "the hook.completed message was set aside"
            await rec.wait_kind(MessageType.HOOK_COMPLETED, within=5)
    (result,) = _results(rec)
    assert result.data.output_tail == "drained\ufffdok \ufffd\n"


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


async def test_a_result_the_contract_refuses_costs_that_run_not_the_hook_runner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A hook result that cannot be built (the contract refusing it) raised out of the hook
    runner: the runner ended, the agent with it, and the run, stored, failed the same way at
    every start; no later hook ever reported. Now that run is logged with its traceback and
    marked done (not run again), and the next hook runs and reports.

    No input reaches this in this version (what the result carries is the transition's own,
    checked, or replaced: NUL, bad UTF-8), so the contract's refusal of one result is made
    here, by a stand-in for HookResultMessage in the hook runner: the one thing not real."""
    broker, channels = _broker("hook-refused")
    state = tmp_path / "state"
    script = tmp_path / "hook.py"
    script.write_text("import os; print('drained', os.environ['EVENT_ID'])")
    hook = HookSpec(frozenset({TransitionKind.SCHEDULED}), f"{sys.executable} {script}")
    refused: list[str] = []

    class Refusing:
        @staticmethod
        def build(data: HookResultData, **kwargs: Any) -> HookResultMessage:
            if not refused:
                refused.append(data.event.event_id)
                raise ValueError("1 validation error for HookResultData (made by the test)")
            return HookResultMessage.build(data, **kwargs)

    monkeypatch.setattr(publisher._hooks, "HookResultMessage", Refusing)
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        settings = settings_for(
            server, "web-7", broker, channels, state, hooks=(hook,), poll_interval=0.2
        )
        with caplog.at_level(logging.ERROR, logger="publisher"):
            async with running(settings):
                hooks = next(t for t in asyncio.all_tasks() if t.get_name() == "agent-hooks")
                first = server.simulator.add_event(
                    EventSpec(event_type=EventType.FREEZE, not_before_seconds=900)
                )
                await eventually(lambda: bool(refused), 10)
                second = server.simulator.add_event(
                    EventSpec(event_type=EventType.FREEZE, not_before_seconds=900)
                )
                await rec.wait_kind(MessageType.HOOK_COMPLETED, within=10)
                assert not hooks.done(), f"the hook runner ended: {hooks.exception()!r}"
    assert refused == [first.event_id]
    (result,) = _results(rec)
    assert result.data.event.event_id == second.event_id
    assert result.data.outcome == "ok"
    (said,) = [r for r in caplog.records if "cannot be built" in r.getMessage()]
    assert said.exc_info is not None  # with its traceback
    assert first.event_id in said.getMessage()
    assert "not run again" in said.getMessage()
    store = await StateStore.open(state)
    try:
        assert await store.hook_runs() == []  # marked done: not tried again at the next start
    finally:
        await store.close()
