"""A stored hook run executes a hook configured now, never the command its row names: an
operator who removed a hook, or changed its command, and restarted the agent got the old command
run for the runs queued before; and whoever could write a row into the state file got any
command run as the agent. The hook runner with the real SQLite state store; its results are
read from the store's outbox, where the runner puts them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import sqlite3
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from publisher import HookSpec
from publisher._hooks import HookRunner
from publisher._observability import Metrics
from publisher._state import STATE_FILE, StateStore
from schemas import (
    HookResultMessage,
    ReplyAddress,
    TransitionMessage,
    VmIdentity,
    decode,
)
from schemas.transitions import TransitionKind

from .harness import scheduled_freezes

SCHEDULED = frozenset({TransitionKind.SCHEDULED})


def _transition(event_id: str) -> TransitionMessage:
    """The ``scheduled`` transition of a Freeze on web-7, as the agent builds it."""
    (message,) = scheduled_freezes([event_id])
    return message


def _marking(tmp_path: Path, name: str) -> tuple[str, Path]:
    """A hook command that appends to a marker file when it runs, and that file."""
    marker = tmp_path / f"{name}.ran"
    script = tmp_path / f"{name}.py"
    script.write_text(f"open({str(marker)!r}, 'a').write('ran\\n')\n")
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}", marker


async def _queue(store: StateStore, transition: TransitionMessage, *hooks: str) -> bytes:
    """Publish ``transition`` with runs of ``hooks`` queued for it, as the watcher commits it;
    its outbox row is then sent (deleted), so the outbox holds hook results only. Returns the
    transition's stored body."""
    committed = await store.commit([transition], hooks=[(0, hook) for hook in hooks])
    (row,) = committed.rows
    await store.delete(row.sequence)
    return row.body


@contextlib.asynccontextmanager
async def _runner(
    store: StateStore, hooks: Sequence[HookSpec], *, rerun: bool = False
) -> AsyncIterator[HookRunner]:
    """The hook runner as the agent starts it, with ``hooks`` configured."""
    runner = HookRunner(
        timeout=30,
        identity=VmIdentity(name="web-7"),
        reply_to=ReplyAddress(channel="approvals", key="web-7"),
        store=store,
        metrics=Metrics(),
        committed=lambda: None,
        rerun_interrupted=rerun,
        hooks=hooks,
    )
    task = asyncio.create_task(runner.run())
    try:
        yield runner
        # Every stored run handled (reported and removed), or the runner's failure.
        async with asyncio.timeout(20):
            while await store.hook_runs():
                if task.done():
                    task.result()
                    raise AssertionError("the hook runner ended")
                await asyncio.sleep(0.05)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _results(store: StateStore) -> dict[str, HookResultMessage]:
    """The hook results in the outbox, by the event they are about."""
    found = [decode(row.body) for row in await store.pending()]
    return {m.data.event.event_id: m for m in found if isinstance(m, HookResultMessage)}


@pytest.mark.parametrize(
    ("cut_off", "outcome"),
    [(False, "not-started"), (True, "interrupted")],
    ids=["queued", "cut-off-with-rerun"],
)
async def test_a_stored_run_of_a_hook_no_longer_configured_is_reported_not_executed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, cut_off: bool, outcome: str
) -> None:
    """Hook A ran on ``scheduled``; the operator replaced it with hook B (same transition, another
    command) and restarted the agent with a run of A still stored (queued, or cut off by a crash
    with hook_rerun_interrupted set). A's command never runs: the run is reported with why, and
    removed; B's runs go on."""
    command_a, marker_a = _marking(tmp_path, "a")
    command_b, marker_b = _marking(tmp_path, "b")
    hook_a, hook_b = HookSpec(SCHEDULED, command_a), HookSpec(SCHEDULED, command_b)
    before, after = _transition("E-before"), _transition("E-after")
    store = await StateStore.open(tmp_path / "state")
    try:
        await _queue(store, before, str(hook_a))
        if cut_off:
            await store.hook_started(f"{before.id}/{hook_a}", 1)
        with caplog.at_level(logging.INFO, logger="publisher"):
            async with _runner(store, [hook_b], rerun=True):
                pass
            reported = await _results(store)
            async with _runner(store, [hook_b], rerun=True) as runner:
                await _queue(store, after, str(hook_b))
                runner.notify()
        results = await _results(store)
        assert await store.hook_runs() == []
    finally:
        await store.close()
    assert not marker_a.exists(), "the removed hook's command ran"
    old = reported[before.data.event.event_id]
    assert old.data.outcome == outcome
    assert old.data.exit_code is None
    assert old.data.hook == command_a
    assert old.data.transition_id == before.id
    assert "no longer configured" in old.data.output_tail
    (said,) = [r.getMessage() for r in caplog.records if "no longer configured" in r.getMessage()]
    assert before.id in said
    assert f"reported as {outcome}" in said
    assert marker_b.read_text() == "ran\n"
    new = results[after.data.event.event_id]
    assert (new.data.outcome, new.data.hook) == ("ok", command_b)


async def test_a_hook_run_crafted_into_the_state_file_is_not_executed(tmp_path: Path) -> None:
    """A row written into hook_runs by hand (a state file edited, or restored from another VM's
    backup) with a command of its own, for a real transition: before, its command ran as the
    agent. Now it is reported not started, and removed; the configured hook is not run in its
    place."""
    command_b, marker_b = _marking(tmp_path, "configured")
    crafted, marker_x = _marking(tmp_path, "crafted")
    transition = _transition("E1")
    state = tmp_path / "state"
    store = await StateStore.open(state)
    try:
        body = await _queue(store, transition)  # published, no hook queued for it
        db = sqlite3.connect(state / STATE_FILE)
        try:
            db.execute(
                "INSERT INTO hook_runs (run_id, position, hook, transition_id, body, state, "
                "attempt) VALUES (?, 1, ?, ?, ?, 'queued', 0)",
                ("crafted", f"scheduled={crafted}", transition.id, body),
            )
            db.commit()
        finally:
            db.close()
        async with _runner(store, [HookSpec(SCHEDULED, command_b)]):
            pass
        results = await _results(store)
        assert await store.hook_runs() == []
    finally:
        await store.close()
    assert not marker_x.exists(), "the crafted row's command ran"
    assert not marker_b.exists()
    result = results["E1"]
    assert result.data.outcome == "not-started"
    assert "no longer configured" in result.data.output_tail


@pytest.mark.parametrize(
    ("stored", "configured", "runs"),
    [
        ("scheduled", frozenset({TransitionKind.SCHEDULED, TransitionKind.STARTED}), True),
        ("scheduled", frozenset({TransitionKind.STARTED}), False),
    ],
    ids=["more-transitions", "not-on-this-transition"],
)
async def test_a_stored_run_executes_the_command_configured_for_its_transition(
    tmp_path: Path, stored: str, configured: frozenset[TransitionKind], runs: bool
) -> None:
    """A hook is known by its command: a stored run executes when a hook with that command is
    configured now for the run's transition (the one the run's body holds), whatever other
    transitions its flag names now. One that now runs on other transitions only does not run."""
    command, marker = _marking(tmp_path, "drain")
    transition = _transition("E1")
    store = await StateStore.open(tmp_path / "state")
    try:
        await _queue(store, transition, f"{stored}={command}")
        async with _runner(store, [HookSpec(configured, command)]):
            pass
        result = (await _results(store))["E1"]
    finally:
        await store.close()
    assert marker.exists() == runs
    assert result.data.outcome == ("ok" if runs else "not-started")
