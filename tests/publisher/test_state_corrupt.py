"""A state file SQLite can open whose stored rows cannot be read (a torn or hand-edited row, a
downgrade) stopped every start with a raw JSONDecodeError, AttributeError or ValueError: a
traceback and exit 1, at every start, until someone found the row.

What can be dropped is dropped with a warning that says what is lost and what happens next (the
last document: the next poll's takes its place; the store's epoch and creation time). What the
agent cannot do without (the message sequence, the event revisions: without them it would reuse
message ids or let the sequence go back) is replaced by numbers above any the store can have
given, with a warning naming the state file (it was a ConfigError, exit 2, at every start)."""

from __future__ import annotations

import logging
import sqlite3
import time
import uuid
from pathlib import Path

import pytest

from publisher._state import STATE_FILE, StateStore
from publisher.simulator import EventSpec, EventType
from schemas import MessageType, TransitionMessage
from schemas.channels import ChannelNames
from schemas.messages import expected_id

from .harness import recorder, running, settings_for, simulator_server


async def _stored(state: Path, **rows: str) -> Path:
    """A state dir whose ``meta`` rows are set to ``rows`` (as a hand edit would)."""
    store = await StateStore.open(state)
    await store.close()
    with sqlite3.connect(state / STATE_FILE) as db:
        for key, value in rows.items():
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))
    db.close()
    return state / STATE_FILE


def _meta(path: Path, key: str) -> str | None:
    with sqlite3.connect(path) as db:
        row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    db.close()
    return None if row is None else str(row[0])


# ------------------------------------------------- what cannot be dropped is replaced


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("next_sequence", "x"),
        ("next_sequence", "-1"),
        ("next_sequence", "1e3"),
        ("next_sequence", str(2**63)),
        ("revisions", "[1, 2]"),
        ("revisions", "{not json"),
        ("revisions", '{"A-1": "x"}'),
        ("revisions", '{"A-1": -1}'),
        ("revisions", '{"A-1": 1.5}'),
        ("revisions", "[" * 100_000),
    ],
)
async def test_an_unreadable_sequence_or_revisions_row_is_replaced_with_a_warning_naming_the_file(
    tmp_path: Path, key: str, value: str, caplog: pytest.LogCaptureFixture
) -> None:
    """These rows stopped the start (a ConfigError, exit 2, on every VM made from an image of
    the store); the agent's tests of what follows (no sequence nor id given twice) are in
    test_state_damaged.py and test_state_owner.py."""
    path = await _stored(tmp_path / "state", **{key: value})
    store = await StateStore.open(tmp_path / "state")
    try:
        with caplog.at_level(logging.WARNING, logger="publisher"):
            state = await store.load()
    finally:
        await store.close()
    assert state.next_sequence >= 1
    assert all(isinstance(r, int) and r >= 0 for r in state.revisions.values())
    warned = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert len(warned) == 1, warned
    assert str(path) in warned[0]
    assert "replaced" in warned[0]
    stored = _meta(path, key)
    assert stored != value  # stored, so the next start reads it and says nothing


# ------------------------------------------------------------------------ what is dropped


@pytest.mark.parametrize(
    "document",
    [
        "{not json",
        "[1, 2]",
        '{"DocumentIncarnation": "many", "Events": 7}',
        "[" * 100_000,
        # A document whose one event was damaged on disk (the agent stores only events it could
        # read): that event is left out, and the operator told so, as for a whole document.
        '{"DocumentIncarnation": 1, "Events": [{"EventId": "B7E1", "EventStatus": "Scheduled"}]}',
    ],
)
async def test_an_unreadable_document_is_dropped_and_the_next_poll_replaces_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, document: str
) -> None:
    """The agent starts; the event IMDS shows is announced again, under a revision above the
    one stored (no message id of an earlier message is given again), and the row is replaced
    by the document just read."""
    unique = uuid.uuid4().hex[:8]
    broker, channels = f"memory://cm-{unique}", ChannelNames().suffixed(unique)
    state = tmp_path / "state"
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        event = server.simulator.add_event(
            EventSpec(event_type=EventType.FREEZE, resources=["web-7"], not_before_seconds=900)
        )
        path = await _stored(
            state, document=document, revisions=f'{{"{event.event_id}": 4}}', next_sequence="9"
        )
        settings = settings_for(server, "web-7", broker, channels, state, poll_interval=0.2)
        with caplog.at_level(logging.WARNING, logger="publisher"):
            async with running(settings):
                await rec.wait_kind(MessageType.SCHEDULED)
    (scheduled,) = rec.of(MessageType.SCHEDULED)
    assert isinstance(scheduled, TransitionMessage)
    assert scheduled.data.revision == 5
    assert scheduled.id == expected_id(scheduled)
    assert scheduled.sequence >= 9
    warned = [r.getMessage() for r in caplog.records if "document" in r.getMessage()]
    assert warned
    assert str(path) in warned[0]
    assert "announced again" in warned[0]
    stored = _meta(path, "document")
    assert stored is not None
    assert event.event_id in stored


@pytest.mark.parametrize("created", ["x", "nan", "inf", "1e300", "-1e300"])
async def test_an_unreadable_creation_time_is_taken_as_now(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, created: str
) -> None:
    """It tells an approval issued before the state existed (reported as a possible repeat):
    now is the safe side. Before, ValueError at start; 1e300 passed the load and raised in
    the approval handler."""
    path = await _stored(tmp_path / "state", created=created)
    before = time.time()
    with caplog.at_level(logging.WARNING, logger="publisher"):
        store = await StateStore.open(tmp_path / "state")
        try:
            loaded = await store.load()
        finally:
            await store.close()
    assert before <= loaded.created <= time.time()
    assert any("creation time" in r.getMessage() for r in caplog.records)
    assert _meta(path, "created") == repr(loaded.created)  # said once, not at every start


@pytest.mark.parametrize("epoch", ["", "x" * 10_000, "\x00"])
async def test_an_unreadable_epoch_is_a_new_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, epoch: str
) -> None:
    path = await _stored(tmp_path / "state", epoch=epoch)
    with caplog.at_level(logging.WARNING, logger="publisher"):
        store = await StateStore.open(tmp_path / "state")
        try:
            loaded = await store.load()
        finally:
            await store.close()
    assert len(loaded.epoch) == 32
    assert loaded.epoch != epoch
    assert any("epoch" in r.getMessage() for r in caplog.records)
    assert _meta(path, "epoch") == loaded.epoch
