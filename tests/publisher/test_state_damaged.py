"""A state file SQLite opens whose rows are of the wrong type or shape (a hand edit, a damaged
disk, a table another version made): the outbox, the hook runs, the approval intents and
outcomes, the sequence and the revisions, text that is not UTF-8. Each unreadable row costs that
row (set aside, left with an error naming it, or replaced), never the agent: before, each of
these ended it, at every start, and nothing behind the row was published or run.

A real agent on a real state dir, the simulator over HTTP, the in-memory broker (and RabbitMQ
for the outbox: the rows behind the bad one are on the broker)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import sys
import uuid
from pathlib import Path

import pytest

from publisher._settings import HookSpec
from publisher._state import STATE_FILE, OutboxRow, StateStore
from publisher.simulator import EventSpec, EventType
from schemas import (
    HookResultMessage,
    MessageType,
    TransitionKind,
    TransitionMessage,
)
from schemas.channels import ChannelNames
from schemas.messages import expected_id

from .conftest import Broker
from .harness import (
    Recorder,
    eventually,
    recorder,
    running,
    scheduled_freezes,
    settings_for,
    simulator_server,
)
from .test_approvals import _channels, _intent_left_by_a_stop, _outcome, _web7


def _memory(name: str) -> Broker:
    unique = uuid.uuid4().hex[:8]
    return Broker(f"memory://{name}-{unique}", ChannelNames().suffixed(unique), "memory")


def _transitions(count: int) -> list[TransitionMessage]:
    """``count`` transitions of web-7 (one Scheduled Freeze each), as the agent builds them."""
    return sorted(
        scheduled_freezes([f"E{n}" for n in range(count)]), key=lambda m: m.data.event.event_id
    )


def _sql(state: Path, *statements: str) -> None:
    """Edit the state file as an operator's ``sqlite3`` would."""
    db = sqlite3.connect(state / STATE_FILE)
    try:
        for statement in statements:
            db.execute(statement)
        db.commit()
    finally:
        db.close()


#: Damage to a ``meta`` row the agent must read before it can number or name its messages (a
#: hand edit, a damaged disk, another version's value): row, and the SQL value put in it.
UNREADABLE_META = {
    "sequence-garbage": ("next_sequence", "'x'"),
    "sequence-negative": ("next_sequence", "'-1'"),
    "sequence-too-large": ("next_sequence", f"'{2**63}'"),
    "sequence-not-utf8": ("next_sequence", "CAST(x'31ff' AS TEXT)"),
    "sequence-bytes": ("next_sequence", "x'01'"),
    "revisions-not-json": ("revisions", "'{not json'"),
    "revisions-not-utf8": ("revisions", "CAST(x'7bff' AS TEXT)"),
    "revisions-negative": ("revisions", "'{\"A-1\": -1}'"),
}
UNREADABLE_SEQUENCE = {k: v for k, v in UNREADABLE_META.items() if v[0] == "next_sequence"}


def _rows(state: Path, query: str) -> list[tuple[object, ...]]:
    db = sqlite3.connect(state / STATE_FILE)
    db.text_factory = bytes
    try:
        return db.execute(query).fetchall()
    finally:
        db.close()


#: The outbox table as another version might have made it: no NOT NULL (so a NULL can be there).
_LOOSE_OUTBOX = (
    "CREATE TABLE loose (sequence INTEGER PRIMARY KEY, message_id TEXT, kind TEXT, "
    "droppable INTEGER, body BLOB, created REAL)",
    "INSERT INTO loose SELECT * FROM outbox",
    "DROP TABLE outbox",
    "ALTER TABLE loose RENAME TO outbox",
)

#: Damage to one outbox row (``{seq}``), and what the error says of it.
OUTBOX_DAMAGE = {
    "body-text": (("UPDATE outbox SET body = 'text, not bytes' WHERE sequence = {seq}",), "body"),
    "body-null": ((*_LOOSE_OUTBOX, "UPDATE outbox SET body = NULL WHERE sequence = {seq}"), "body"),
    "created-text": (("UPDATE outbox SET created = 'x' WHERE sequence = {seq}",), "created"),
    "created-infinite": (("UPDATE outbox SET created = 9e999 WHERE sequence = {seq}",), "created"),
    "id-not-utf8": (
        ("UPDATE outbox SET message_id = CAST(x'ff' AS TEXT) WHERE sequence = {seq}",),
        "message_id",
    ),
    "kind-bytes": (("UPDATE outbox SET kind = x'00' WHERE sequence = {seq}",), "kind"),
}


@pytest.mark.parametrize("damage", list(OUTBOX_DAMAGE.values()), ids=list(OUTBOX_DAMAGE))
async def test_an_unreadable_outbox_row_is_set_aside_and_the_rows_behind_it_are_published(
    broker: Broker,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    damage: tuple[tuple[str, ...], str],
) -> None:
    """Three messages wait in the outbox from the last run; the first one's row was damaged.
    Before, reading the outbox raised on most of these (bytes() of text or NULL, float() of
    'x', the cursor on text that is not UTF-8): the publisher ended, and with it the agent, at
    every start, and the two good messages were never sent. Now a row whose cells are not of
    the types the agent writes is set aside (kept, counted, the cell named in the log), and
    the others reach the broker."""
    statements, column = damage
    state = tmp_path / "state"
    store = await StateStore.open(state)
    try:
        committed = await store.commit(_transitions(3))
    finally:
        await store.close()
    bad, *good = committed.rows
    _sql(state, *(s.format(seq=bad.sequence) for s in statements))
    async with simulator_server("web-7") as server, recorder(broker.url, broker.channels) as rec:
        settings = settings_for(server, "web-7", broker.url, broker.channels, state)
        with caplog.at_level(logging.ERROR, logger="publisher"):
            async with running(settings) as agent:
                await rec.wait_for(
                    lambda ms: {r.message_id for r in good} <= {m.id for m in ms}, within=15
                )
                outbox = agent._outbox
                assert outbox is not None
                await eventually(lambda: outbox.set_aside == 1, 5)
    assert bad.message_id not in {m.id for m in rec.messages}
    (why,) = [
        r.getMessage() for r in caplog.records if f"outbox row {bad.sequence} " in r.getMessage()
    ]
    assert "set aside, unreadable" in why
    assert column in why
    assert _rows(state, "SELECT sequence, why FROM outbox_set_aside") == [
        (bad.sequence, b"unreadable")
    ]


# ------------------------------------------------------------------------------- hook runs


def _hook_result_of(rec: Recorder, transition: TransitionMessage) -> HookResultMessage | None:
    found = [
        m
        for m in rec.messages
        if isinstance(m, HookResultMessage)
        and m.data.event.event_id == transition.data.event.event_id
    ]
    return found[0] if found else None


async def _queued_hooks(state: Path, count: int, command: str) -> list[TransitionMessage]:
    """A state dir with ``count`` transitions already published and a run of ``command`` queued
    for each (the agent stopped before it ran them)."""
    transitions = _transitions(count)
    store = await StateStore.open(state)
    try:
        committed = await store.commit(
            transitions, hooks=[(n, f"scheduled={command}") for n in range(count)]
        )
        for row in committed.rows:
            await store.delete(row.sequence)
    finally:
        await store.close()
    return transitions


def _hooked(command: str) -> tuple[HookSpec, ...]:
    """The agent's hooks: ``command`` on scheduled (the runs :func:`_queued_hooks` queued)."""
    return (HookSpec(frozenset({TransitionKind.SCHEDULED}), command),)


#: Damage to one hook run (``{transition}``: its transition's id), and what the error says of it.
HOOK_RUN_DAMAGE = {
    "attempt-text": (
        "UPDATE hook_runs SET attempt = 'x' WHERE transition_id = '{transition}'",
        "attempt",
    ),
    "attempt-last": (
        f"UPDATE hook_runs SET attempt = {2**63 - 1} WHERE transition_id = '{{transition}}'",
        "attempt",
    ),
    "body-text": (
        "UPDATE hook_runs SET body = 'text, not bytes' WHERE transition_id = '{transition}'",
        "body",
    ),
    "state-unknown": (
        "UPDATE hook_runs SET state = 'paused' WHERE transition_id = '{transition}'",
        "state",
    ),
    "hook-bytes": (
        "UPDATE hook_runs SET hook = x'00' WHERE transition_id = '{transition}'",
        "hook",
    ),
    "id-not-utf8": (
        "UPDATE hook_runs SET run_id = CAST(x'ff' AS TEXT) WHERE transition_id = '{transition}'",
        "run_id",
    ),
}


@pytest.mark.parametrize("damage", list(HOOK_RUN_DAMAGE.values()), ids=list(HOOK_RUN_DAMAGE))
async def test_an_unreadable_hook_run_is_left_with_an_error_and_the_other_runs_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: tuple[str, str]
) -> None:
    """Two hook runs wait from the last run; the first one's row was damaged. Before, reading
    the runs raised (int('x'), bytes() of text, the cursor on text that is not UTF-8; the
    last attempt number had no next one to store), which ended the hook runner and the agent
    at every start, and the second hook never ran; an unknown state was passed over without a
    word. Now that row is left as it is with an error naming it, and the second hook runs (a
    real command) and its result is published."""
    statement, column = damage
    broker = _memory("hook-damaged")
    state = tmp_path / "state"
    ran = tmp_path / "ran"
    command = f"{sys.executable} -c \"open({str(ran)!r}, 'a').write('x')\""
    first, second = await _queued_hooks(state, 2, command)
    _sql(state, statement.format(transition=first.id))
    async with simulator_server("web-7") as server, recorder(broker.url, broker.channels) as rec:
        settings = settings_for(
            server, "web-7", broker.url, broker.channels, state, hooks=_hooked(command)
        )
        with caplog.at_level(logging.ERROR, logger="publisher"):
            async with running(settings):
                await rec.wait_for(lambda ms: _hook_result_of(rec, second) is not None, within=15)
    result = _hook_result_of(rec, second)
    assert result is not None
    assert result.data.outcome == "ok"
    assert ran.read_text() == "x"  # the damaged run's hook did not run
    assert _hook_result_of(rec, first) is None
    (said,) = [r.getMessage() for r in caplog.records if "hook run" in r.getMessage()]
    assert "cannot be read" in said
    assert column in said
    assert "left as it is" in said
    left = _rows(state, "SELECT transition_id FROM hook_runs")
    assert left == [(first.id.encode(),)]


@pytest.mark.parametrize(
    "transition_id",
    ["'a' || char(0) || 'b'", "'" + "x" * 300 + "'", "'another-transition'"],
    ids=["nul", "long", "another"],
)
async def test_a_hook_runs_result_names_its_transition_whatever_the_run_row_says(
    tmp_path: Path, transition_id: str
) -> None:
    """The result named its transition with the run row's transition_id cell, not with the id
    of the transition it ran for (the body, which the contract checked): an edited or damaged
    cell went into the result (one with a NUL made it unpublishable: set aside, never seen).
    Now the result carries the transition's own id."""
    broker = _memory("hook-transition-id")
    state = tmp_path / "state"
    command = f"{sys.executable} -c pass"
    (transition,) = await _queued_hooks(state, 1, command)
    _sql(state, f"UPDATE hook_runs SET transition_id = {transition_id}")
    async with simulator_server("web-7") as server, recorder(broker.url, broker.channels) as rec:
        settings = settings_for(
            server, "web-7", broker.url, broker.channels, state, hooks=_hooked(command)
        )
        async with running(settings) as agent:
            await rec.wait_for(lambda ms: _hook_result_of(rec, transition) is not None, 10)
            assert agent._outbox is not None
            assert agent._outbox.set_aside == 0
    result = _hook_result_of(rec, transition)
    assert result is not None
    assert result.data.outcome == "ok"
    assert result.data.transition_id == transition.id


async def test_the_agent_runs_only_the_hooks_configured_now_for_stored_runs(
    tmp_path: Path,
) -> None:
    """Runs were queued for a hook that the operator then removed (another hook configured in
    its place) before the agent started again. The agent executed each stored row's command:
    the removed hook ran. Now the agent's configured hooks decide: the removed hook's runs are
    reported not started and never executed."""
    broker = _memory("hook-removed")
    state = tmp_path / "state"
    removed, kept = tmp_path / "removed-ran", tmp_path / "kept-ran"
    (transition,) = await _queued_hooks(
        state, 1, f"{sys.executable} -c \"open({str(removed)!r}, 'a').write('x')\""
    )
    configured = _hooked(f"{sys.executable} -c \"open({str(kept)!r}, 'a').write('x')\"")
    async with simulator_server("web-7") as server, recorder(broker.url, broker.channels) as rec:
        settings = settings_for(
            server, "web-7", broker.url, broker.channels, state, hooks=configured
        )
        async with running(settings):
            await rec.wait_for(lambda ms: _hook_result_of(rec, transition) is not None, 10)
    result = _hook_result_of(rec, transition)
    assert result is not None
    assert result.data.outcome == "not-started"
    assert "no longer configured" in result.data.output_tail
    assert not removed.exists()  # the removed hook never ran
    assert not kept.exists()  # nor the configured one in its place, for a run not its own
    assert _rows(state, "SELECT run_id FROM hook_runs") == []


async def test_an_interrupted_run_whose_transition_cannot_be_read_is_dropped_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run cut off by a restart whose stored transition is no message: said to be dropped,
    it was left in the store (until some later transition woke the runner), and said to be
    dropped again at every start. Now it is removed when it is said to be."""
    broker = _memory("hook-interrupted")
    state = tmp_path / "state"
    await _queued_hooks(state, 1, f"{sys.executable} -c pass")
    _sql(state, "UPDATE hook_runs SET state = 'running', attempt = 1, body = x'00ff'")
    async with simulator_server("web-7") as server, recorder(broker.url, broker.channels):
        settings = settings_for(server, "web-7", broker.url, broker.channels, state)
        with caplog.at_level(logging.ERROR, logger="publisher"):
            async with running(settings):
                await eventually(lambda: any("dropped" in r.getMessage() for r in caplog.records))
                await asyncio.sleep(0.2)
    assert _rows(state, "SELECT run_id FROM hook_runs") == []


# ------------------------------------------------------------ text that is not UTF-8, others


async def test_a_stored_document_that_is_not_utf8_is_dropped_and_the_agent_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The last document stored, damaged into text that is not UTF-8: the cursor raised at
    load, and the agent never started. Now it is dropped as any unreadable document is (the
    next poll's takes its place), and the event IMDS shows is announced."""
    broker = _memory("document-utf8")
    state = tmp_path / "state"
    async with simulator_server("web-7") as server, recorder(broker.url, broker.channels) as rec:
        event = server.simulator.add_event(
            EventSpec(event_type=EventType.FREEZE, resources=["web-7"], not_before_seconds=900)
        )
        settings = settings_for(
            server, "web-7", broker.url, broker.channels, state, poll_interval=0.2
        )
        async with running(settings):
            await rec.wait_kind(MessageType.SCHEDULED)
        _sql(state, "UPDATE meta SET value = CAST(x'7bff' AS TEXT) WHERE key = 'document'")
        with caplog.at_level(logging.WARNING, logger="publisher"):
            async with running(settings):
                await rec.wait_kind(MessageType.SCHEDULED, count=2)
    assert [m.subject for m in rec.of(MessageType.SCHEDULED)] == [event.event_id] * 2
    warned = [r.getMessage() for r in caplog.records if "document" in r.getMessage()]
    assert warned
    assert "not UTF-8" in warned[0]


async def test_a_stored_intent_that_is_not_utf8_does_not_stop_the_agent(tmp_path: Path) -> None:
    """An approval intent whose id is text that is not UTF-8: the cursor raised out of the
    reconciling at start, which ended the agent at every start (an intent of the wrong type no
    longer did). Now that row is left with an error naming it, the others are reconciled."""
    broker = Broker(f"memory://intent-{uuid.uuid4().hex[:6]}", _channels("intent"), "memory")
    spec = EventSpec(
        event_type=EventType.REDEPLOY, resources=["web-7"], not_before_seconds=3 * 86400
    )
    async with _web7(broker, tmp_path, spec) as (sim, rec, event, key, settings):
        approval = await _intent_left_by_a_stop(sim, event, key, settings)
        assert settings.state_dir is not None
        _sql(
            settings.state_dir,
            "INSERT INTO approval_intents (approval_id, event_id, event_version, body, at) "
            "VALUES (CAST(x'ff' AS TEXT), 'EVT-X', 'v', x'00', 0)",
        )
        async with running(settings):
            outcome = await _outcome(rec, approval.approval_id)
            await asyncio.sleep(0.5)
    assert outcome.kind is MessageType.APPROVAL_APPLIED  # the readable one was reconciled


async def test_an_applied_event_row_that_is_not_utf8_does_not_stop_the_agent(
    tmp_path: Path,
) -> None:
    """An event this agent approved (its row in applied_events: it ran here) whose approval id
    is text that is not UTF-8: when the event left IMDS, the cursor raised in the watcher, which
    ended the agent, and again at each start. Now the row still counts (the event is reported
    completed: it ran here, not canceled) and the agent runs on."""
    broker = _memory("applied-utf8")
    state = tmp_path / "state"
    async with simulator_server("web-7") as server, recorder(broker.url, broker.channels) as rec:
        sim = server.simulator
        event = sim.add_event(
            EventSpec(event_type=EventType.FREEZE, resources=["web-7"], not_before_seconds=900)
        )
        settings = settings_for(
            server, "web-7", broker.url, broker.channels, state, poll_interval=0.2
        )
        async with running(settings):
            await rec.wait_kind(MessageType.SCHEDULED)
        _sql(
            state,
            "INSERT INTO applied_events (event_id, approval_id, at) "
            f"VALUES ('{event.event_id}', CAST(x'41ff' AS TEXT), 0)",
        )
        sim.cancel_event(event.event_id)
        async with running(settings):
            await rec.wait_kind(MessageType.COMPLETED)
            await asyncio.sleep(0.5)
    assert not rec.of(MessageType.CANCELED)


async def test_an_approval_outcome_of_the_wrong_type_does_not_stop_the_agent(
    tmp_path: Path,
) -> None:
    """An approval's stored outcome (its report, kept to answer a redelivery) stored as text:
    reading it (bytes() of text) raised out of the reconciling of intents at start, which
    ended the agent at every start. A stored outcome still means the approval was handled:
    its intent is not reconciled again, and the agent runs."""
    broker = Broker(f"memory://outcome-{uuid.uuid4().hex[:6]}", _channels("outcome"), "memory")
    spec = EventSpec(
        event_type=EventType.REDEPLOY, resources=["web-7"], not_before_seconds=3 * 86400
    )
    async with _web7(broker, tmp_path, spec) as (sim, rec, event, key, settings):
        approval = await _intent_left_by_a_stop(sim, event, key, settings)
        assert settings.state_dir is not None
        _sql(
            settings.state_dir,
            "INSERT INTO approvals (approval_id, message, decided) "
            f"VALUES ('{approval.approval_id}', 'text, not bytes', 0)",
        )
        async with running(settings):
            await rec.wait_kind(MessageType.SCHEDULED, within=15)
            await asyncio.sleep(0.5)
    assert not sim.get_event(event.event_id).approvals  # handled already: no POST again
    assert not [m for m in rec.messages if m.kind.value.startswith("approval.")]


async def test_a_sequence_below_the_rows_kept_is_raised_above_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A next_sequence (hand-)set below messages still in the outbox: the first commit gave a
    new message the sequence of a kept one, and SQLite refused it (an IntegrityError
    traceback, exit 1, at every start); below a row set aside, the next row set aside under
    it would have replaced that kept row. The sequence is raised above every row kept, with a
    warning (a gap, which consumers see; never a step back), and the agent runs."""
    broker = _memory("sequence-floor")
    state = tmp_path / "state"
    store = await StateStore.open(state)
    try:
        committed = await store.commit(_transitions(3))
    finally:
        await store.close()
    _sql(state, "UPDATE meta SET value = '2' WHERE key = 'next_sequence'")
    last = committed.rows[-1].sequence
    async with simulator_server("web-7") as server, recorder(broker.url, broker.channels) as rec:
        settings = settings_for(server, "web-7", broker.url, broker.channels, state)
        with caplog.at_level(logging.WARNING, logger="publisher"):
            async with running(settings):
                await rec.wait_kind(MessageType.AGENT_ONLINE)
                await rec.wait_kind(MessageType.SCHEDULED, count=3)
    (online,) = rec.of(MessageType.AGENT_ONLINE)
    assert online.sequence == last + 1
    assert sorted(m.sequence for m in rec.of(MessageType.SCHEDULED)) == [
        r.sequence for r in committed.rows
    ]
    warned = [r.getMessage() for r in caplog.records if "next_sequence" in r.getMessage()]
    assert warned
    assert f"raised to {last + 1}" in warned[0]


# --------------------------------------------- the sequence and the revisions of the VM's own


@pytest.mark.parametrize("unsent", [True, False], ids=["unsent", "drained"])
@pytest.mark.parametrize(
    "value", [v for _, v in UNREADABLE_SEQUENCE.values()], ids=list(UNREADABLE_SEQUENCE)
)
async def test_an_unreadable_sequence_costs_that_row_and_no_sequence_is_given_twice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, value: str, unsent: bool
) -> None:
    """This VM's own store, its next_sequence row damaged: the agent stopped at open (a
    ConfigError, exit 2, at every start), and nothing it held was published. Now it starts,
    publishes what its outbox held under the sequences they were stored with, and numbers its
    new messages above every sequence it gave before: the ones still held, and the ones
    published and gone from the outbox ("drained": all of them, as after a clean stop), which
    no row of the store records any more."""
    broker = _memory("sequence-unreadable")
    state = tmp_path / "state"
    async with simulator_server("web-7") as server, recorder(broker.url, broker.channels) as rec:
        settings = settings_for(server, "web-7", broker.url, broker.channels, state)
        async with running(settings):
            await rec.wait_kind(MessageType.AGENT_ONLINE)
        await rec.wait_kind(MessageType.AGENT_OFFLINE)
        held: list[OutboxRow] = []
        if unsent:  # the agent stopped before the broker confirmed these
            store = await StateStore.open(state)
            try:
                held = (await store.commit(_transitions(2))).rows
            finally:
                await store.close()
        before = list(rec.messages)
        _sql(state, f"UPDATE meta SET value = {value} WHERE key = 'next_sequence'")
        with caplog.at_level(logging.WARNING, logger="publisher"):
            async with running(settings):
                await rec.wait_kind(MessageType.AGENT_ONLINE, count=2)
                await rec.wait_for(lambda ms: {r.message_id for r in held} <= {m.id for m in ms})
        await rec.wait_kind(MessageType.AGENT_OFFLINE, count=2)

    after = rec.messages[len(before) :]
    held_ids = {r.message_id for r in held}
    assert {m.id: m.sequence for m in after if m.id in held_ids} == {
        r.message_id: r.sequence for r in held
    }
    new = [m for m in after if m.id not in held_ids]
    assert {m.kind for m in new} >= {MessageType.AGENT_ONLINE, MessageType.AGENT_OFFLINE}
    given = [m.sequence for m in before] + [r.sequence for r in held]
    assert min(m.sequence for m in new) > max(given)
    assert len({m.sequence for m in rec.messages}) == len(rec.messages)
    assert not {m.id for m in new} & {m.id for m in before}
    (warned,) = [r.getMessage() for r in caplog.records if "next_sequence" in r.getMessage()]
    assert str(state / STATE_FILE) in warned
    assert f"replaced by {min(m.sequence for m in new)}" in warned


async def test_unreadable_revisions_cost_that_row_and_no_message_id_is_given_twice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """This VM's own store, its revisions row damaged: the agent stopped at open (a
    ConfigError, exit 2, at every start). Now it starts, and the event it stored goes on
    above every revision given before. A transition's id is made of its event's revision:
    counting from 0 again would give the second update after the damage the id of the first
    update before it, with other content, which consumers drop as an id conflict."""
    broker = _memory("revisions-unreadable")
    state = tmp_path / "state"
    async with simulator_server("web-7") as server, recorder(broker.url, broker.channels) as rec:
        sim = server.simulator
        event = sim.add_event(
            EventSpec(event_type=EventType.FREEZE, resources=["web-7"], not_before_seconds=900)
        )
        settings = settings_for(
            server, "web-7", broker.url, broker.channels, state, poll_interval=0.2
        )
        async with running(settings):
            await rec.wait_kind(MessageType.SCHEDULED)
            for n in (1, 2):
                sim.update_event(event.event_id, description=f"update {n}")
                await rec.wait_kind(MessageType.UPDATED, count=n)
        _sql(state, "UPDATE meta SET value = '{not json' WHERE key = 'revisions'")
        with caplog.at_level(logging.WARNING, logger="publisher"):
            async with running(settings):
                for n in (3, 4):
                    sim.update_event(event.event_id, description=f"update {n}")
                    await rec.wait_kind(MessageType.UPDATED, count=n)

    transitions = rec.transitions()
    assert [m.kind for m in transitions] == [MessageType.SCHEDULED] + [MessageType.UPDATED] * 4
    assert all(isinstance(m, TransitionMessage) and m.id == expected_id(m) for m in transitions)
    ids = [m.id for m in transitions]
    assert len(set(ids)) == len(ids)
    (warned,) = [r.getMessage() for r in caplog.records if "revisions" in r.getMessage()]
    assert str(state / STATE_FILE) in warned
    assert "1 event" in warned
