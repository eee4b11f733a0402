"""Upgrading the central database: a database that schema version 2 made (message ids unique
alone) becomes version 3 (unique by VM and id) with every row, position and guarantee kept,
on SQLite and on the real PostgreSQL."""

from __future__ import annotations

import contextlib
import sqlite3

import pytest

from consumers._approver_state import ApproverState
from consumers._audit import Appended, open_ledger
from consumers._db import DatabaseError, open_database
from consumers._fleet import FleetView
from consumers._schema import SCHEMA_VERSION, schema_version

from ._factory import event, transition, vm

pytestmark = pytest.mark.asyncio

# The two tables version 2 made unique by id alone, as it made them (the rest of its schema is
# what version 3 makes too). The ledger's triggers as 2 made them.
_V2_SQLITE = """
CREATE TABLE central_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO central_meta VALUES ('schema_version', '2');
CREATE TABLE ledger_messages (
    position      INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id    TEXT NOT NULL UNIQUE,
    time          TEXT NOT NULL,
    kind          TEXT NOT NULL,
    source        TEXT NOT NULL,
    vm            TEXT NOT NULL COLLATE NOCASE,
    event_id      TEXT,
    event_type    TEXT,
    sequence      INTEGER NOT NULL,
    body          TEXT NOT NULL,
    received_at   TEXT NOT NULL,
    sender        TEXT,
    schemaversion TEXT,
    raw           BLOB
);
CREATE INDEX ledger_messages_vm ON ledger_messages (vm, time);
CREATE TRIGGER ledger_messages_no_delete BEFORE DELETE ON ledger_messages
BEGIN SELECT RAISE(ABORT, 'the audit ledger is append-only'); END;
CREATE TRIGGER ledger_messages_append_only BEFORE UPDATE ON ledger_messages
BEGIN SELECT RAISE(ABORT, 'the audit ledger is append-only'); END;
CREATE TRIGGER ledger_messages_no_replace BEFORE INSERT ON ledger_messages
WHEN EXISTS (SELECT 1 FROM ledger_messages
             WHERE message_id = NEW.message_id OR position = NEW.position)
BEGIN SELECT RAISE(IGNORE); END;
CREATE TABLE approver_messages (
    position    INTEGER PRIMARY KEY AUTOINCREMENT,
    grp         TEXT NOT NULL,
    message_id  TEXT NOT NULL,
    event_id    TEXT,
    vm          TEXT NOT NULL,
    raw         BLOB NOT NULL,
    UNIQUE (grp, message_id)
);
"""

_V2_POSTGRES = """
CREATE TABLE central_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO central_meta VALUES ('schema_version', '2');
CREATE TABLE ledger_messages (
    position      BIGSERIAL PRIMARY KEY,
    message_id    TEXT NOT NULL UNIQUE,
    time          TIMESTAMPTZ NOT NULL,
    kind          TEXT NOT NULL,
    source        TEXT NOT NULL,
    vm            TEXT NOT NULL,
    event_id      TEXT,
    event_type    TEXT,
    sequence      BIGINT NOT NULL,
    body          JSONB NOT NULL,
    received_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    sender        TEXT,
    schemaversion TEXT,
    raw           BYTEA
);
CREATE TABLE approver_messages (
    position    BIGSERIAL PRIMARY KEY,
    grp         TEXT NOT NULL,
    message_id  TEXT NOT NULL,
    event_id    TEXT,
    vm          TEXT NOT NULL,
    raw         BYTEA NOT NULL,
    UNIQUE (grp, message_id)
);
"""


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def v2_url(request, tmp_path):
    """A database as schema version 2 left it, holding nothing yet."""
    if request.param == "sqlite":
        path = tmp_path / "central.db"
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.executescript(_V2_SQLITE)
        return f"sqlite:///{path}"
    url = request.getfixturevalue("postgres_url")
    return url


async def test_a_version_2_database_is_upgraded_with_every_row_kept(v2_url):
    """Rows version 2 holds (the ledger's, the approver's) survive the upgrade with their
    positions; afterwards two VMs' messages under one id are both kept, a copy is still a copy,
    new rows come after the old ones, and the ledger still refuses deletes."""
    if v2_url.startswith("postgresql"):
        async with open_database(v2_url) as raw:
            await raw.script(_V2_POSTGRES)
    now_ = transition("scheduled", event("EVT-A", resources=("web-a",)), vm("web-a")).time
    own = transition("scheduled", event("EVT-B", resources=("web-b",)), vm("web-b"), at=now_)
    squatter = transition(
        "scheduled", event("EVT-A", resources=("web-a",)), vm("web-a"), at=now_
    ).model_copy(update={"id": own.id})
    old = transition("scheduled", event("EVT-C", resources=("web-c",)), vm("web-c"), at=now_)
    # What version 2 holds: one ledger row and one approver row, written as 2 wrote them.
    async with open_database(v2_url) as db:
        assert await schema_version(db) == 2
        await db.execute(
            "INSERT INTO ledger_messages (message_id, time, kind, source, vm, event_id, "
            "event_type, sequence, body, received_at, raw) VALUES "
            "(?, ?, 'scheduled', ?, 'web-c', 'EVT-C', 'Freeze', 1, ?, ?, ?)",
            old.id,
            old.time,
            old.source,
            old.to_bytes().decode(),
            old.time,
            old.to_bytes(),
        )
        await db.execute(
            "INSERT INTO approver_messages (grp, message_id, event_id, vm, raw) "
            "VALUES ('approver', ?, 'EVT-C', 'web-c', ?)",
            old.id,
            old.to_bytes(),
        )

    async with open_ledger(v2_url) as ledger:  # upgrades, as every service does at its start
        assert await schema_version(ledger.db) == SCHEMA_VERSION == 3
        assert await ledger.append(old) is Appended.DUPLICATE
        assert await ledger.append(squatter) is Appended.NEW
        assert await ledger.append(own) is Appended.NEW
        positions = await ledger.db.fetch(
            "SELECT message_id, vm, position FROM ledger_messages ORDER BY position"
        )
        await ApproverState(ledger.db, "approver").commit([squatter, own], [], [])
        view = FleetView()
        await ApproverState(ledger.db, "approver").load(view)
        with pytest.raises(DatabaseError, match="append-only"):
            await ledger.db.execute("DELETE FROM ledger_messages")
    assert [(row[0], row[1]) for row in positions] == [
        (old.id, "web-c"),
        (own.id, "web-a"),
        (own.id, "web-b"),
    ]
    assert positions[0][2] < positions[1][2] < positions[2][2]
    assert {s.event_id for s in view.events(open_only=True)} == {"EVT-A", "EVT-B", "EVT-C"}


async def test_two_services_upgrading_one_sqlite_file_at_once_copy_it_once(tmp_path, caplog):
    """The approver and the audit share a SQLite file and start together after an upgrade of
    the code: one upgrades, the other waits for it and finds the work done (before, each copied
    the tables, the second over the first's copy, and a second copy of a large ledger could
    outlast the wait for the lock)."""
    import asyncio
    import logging

    path = tmp_path / "central.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.executescript(_V2_SQLITE)
        conn.executemany(
            "INSERT INTO ledger_messages (message_id, time, kind, source, vm, event_id, "
            "event_type, sequence, body, received_at) VALUES (?, 't', 'scheduled', 's', ?, "
            "'E', 'Freeze', 1, '{}', 't')",
            ((f"id-{i}", f"vm-{i % 7}") for i in range(5000)),
        )
        conn.commit()

    async def start() -> None:
        async with open_ledger(f"sqlite:///{path}"):
            pass

    with caplog.at_level(logging.INFO, logger="consumers._schema"):
        await asyncio.gather(start(), start())
    copies = [r for r in caplog.records if "copying" in r.getMessage()]
    async with open_ledger(f"sqlite:///{path}") as ledger:
        assert await schema_version(ledger.db) == SCHEMA_VERSION
        assert await ledger.count() == 5000
    assert len(copies) == 1, [r.getMessage() for r in copies]


async def test_a_ledger_of_0_1_is_upgraded_to_the_current_schema(tmp_path):
    """A 0.1 ledger (schema 1: no schema version row, no raw bytes) gets the columns 2 added and
    the uniqueness 3 changed, in the same transaction; its rows keep their positions and are
    still told apart from other content by what they say."""
    path = tmp_path / "central.db"
    v1 = _V2_SQLITE.split("CREATE TABLE ledger_messages", 1)[1].split("CREATE INDEX", 1)[0]
    added = ",\n    sender        TEXT,\n    schemaversion TEXT,\n    raw           BLOB"
    v1 = v1.replace(added, "")
    old = transition("scheduled", event("EVT-C", resources=("web-c",)), vm("web-c"))
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.executescript(f"CREATE TABLE ledger_messages {v1}")
        conn.execute(
            "INSERT INTO ledger_messages (position, message_id, time, kind, source, vm, "
            "event_id, event_type, sequence, body, received_at) "
            "VALUES (7, ?, 't', 'scheduled', 's', 'web-c', 'EVT-C', 'Freeze', 1, ?, 't')",
            (old.id, old.to_bytes().decode()),
        )
        conn.commit()
    async with open_ledger(f"sqlite:///{path}") as ledger:
        assert await schema_version(ledger.db) == SCHEMA_VERSION
        assert await ledger.append(old) is Appended.DUPLICATE
        changed = old.model_copy(update={"subject": "EVT-OTHER"})
        assert await ledger.append(changed) is Appended.CONFLICT
        rows = await ledger.db.fetch("SELECT position, message_id, raw FROM ledger_messages")
    assert rows == [(7, old.id, None)]
