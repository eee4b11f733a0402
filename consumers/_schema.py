"""The central database: the audit ledger and the approver's durable state, one schema.

==========================  ==================================================================
``ledger_messages``         every lifecycle message the audit received: its bytes as received
                            (``raw``) beside the parsed columns; append-only
``ledger_decisions``        every decision of an approver and every operator action (approve,
                            wait, never, hold, release), with its reason and the event version
                            it judged; append-only
``approver_messages``       what an approver's fleet view is made of (the messages about open
                            events, the last message of each agent), replayed by the standby
                            that takes over; pruned as events end
``approver_approvals``      every approval an approver signed, with its version, before it is
                            sent (``sending``) and once the broker took it (``sent``)
``approver_holds``          events an operator holds: the approver leaves them to NotBefore
``central_meta``            the schema version, and each approver group's state version (a
                            counter every write moves, so a process knows when another one wrote)
==========================  ==================================================================

The schema is created on first use where the role may create tables (SQLite always; a
PostgreSQL owner). ``scheduled-events migrate`` creates or upgrades it explicitly, and can grant
least-privilege roles: an **audit** role may only INSERT and SELECT (the ledger refuses UPDATE,
DELETE and TRUNCATE even to its owner, by triggers), an **approver** role also writes its own
``approver_*`` tables.
"""

from __future__ import annotations

import logging
import re
import sqlite3

from schemas import ConfigError

from ._db import Database, DatabaseError, Executor

__all__ = ["SCHEMA_VERSION", "ensure_schema", "grant", "schema_version"]

log = logging.getLogger(__name__)

#: 1: the ledger of 0.1; 2: raw bytes, sender and schema version of each message, the
#: approver's durable state, holds; 3: a message is unique by its VM and its id, not its id
#: alone (ids are the senders' own: one VM's message must not keep another's out).
SCHEMA_VERSION = 3

# The approver's tables, the same in both dialects but for the types.
_APPROVER = """
CREATE TABLE IF NOT EXISTS approver_messages (
    position    {serial},
    grp         TEXT NOT NULL,
    message_id  TEXT NOT NULL,
    event_id    TEXT,
    vm          TEXT NOT NULL,
    raw         {blob} NOT NULL
);
-- vm is stored case-folded by the approver.
CREATE UNIQUE INDEX IF NOT EXISTS approver_messages_id ON approver_messages (grp, vm, message_id);
CREATE INDEX IF NOT EXISTS approver_messages_event ON approver_messages (grp, event_id);
CREATE INDEX IF NOT EXISTS approver_messages_vm ON approver_messages (grp, vm, event_id);
CREATE TABLE IF NOT EXISTS approver_approvals (
    grp           TEXT NOT NULL,
    approval_id   TEXT NOT NULL,
    event_id      TEXT NOT NULL,
    event_version TEXT NOT NULL,
    target        TEXT NOT NULL,
    reply_channel TEXT NOT NULL,
    reply_key     TEXT NOT NULL,
    body          {blob} NOT NULL,
    state         TEXT NOT NULL,
    at            {time} NOT NULL,
    PRIMARY KEY (grp, approval_id)
);
CREATE INDEX IF NOT EXISTS approver_approvals_event ON approver_approvals (grp, event_id);
CREATE TABLE IF NOT EXISTS approver_holds (
    event_id    TEXT PRIMARY KEY,
    held_by     TEXT NOT NULL,
    reason      TEXT NOT NULL,
    at          {time} NOT NULL
);
"""

_SQLITE = """
CREATE TABLE IF NOT EXISTS central_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS ledger_messages (
    position      INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id    TEXT NOT NULL,
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
CREATE UNIQUE INDEX IF NOT EXISTS ledger_messages_id ON ledger_messages (lower(vm), message_id);
CREATE INDEX IF NOT EXISTS ledger_messages_vm ON ledger_messages (vm, time);
CREATE INDEX IF NOT EXISTS ledger_messages_event ON ledger_messages (event_id, time);
CREATE INDEX IF NOT EXISTS ledger_messages_time ON ledger_messages (time);
CREATE TABLE IF NOT EXISTS ledger_decisions (
    position    INTEGER PRIMARY KEY AUTOINCREMENT,
    time        TEXT NOT NULL,
    event_id    TEXT NOT NULL,
    event_type  TEXT,
    target      TEXT COLLATE NOCASE,
    body        TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_decisions_event ON ledger_decisions (event_id, time);
CREATE TRIGGER IF NOT EXISTS ledger_messages_append_only BEFORE UPDATE ON ledger_messages
BEGIN SELECT RAISE(ABORT, 'the audit ledger is append-only'); END;
CREATE TRIGGER IF NOT EXISTS ledger_messages_no_delete BEFORE DELETE ON ledger_messages
BEGIN SELECT RAISE(ABORT, 'the audit ledger is append-only'); END;
CREATE TRIGGER IF NOT EXISTS ledger_decisions_append_only BEFORE UPDATE ON ledger_decisions
BEGIN SELECT RAISE(ABORT, 'the audit ledger is append-only'); END;
CREATE TRIGGER IF NOT EXISTS ledger_decisions_no_delete BEFORE DELETE ON ledger_decisions
BEGIN SELECT RAISE(ABORT, 'the audit ledger is append-only'); END;
-- INSERT OR REPLACE deletes the row it replaces without firing delete triggers: an insert that
-- would replace a row (same message id or position) is ignored instead.
CREATE TRIGGER IF NOT EXISTS ledger_messages_no_replace BEFORE INSERT ON ledger_messages
WHEN EXISTS (SELECT 1 FROM ledger_messages
             WHERE (lower(vm) = lower(NEW.vm) AND message_id = NEW.message_id)
             OR position = NEW.position)
BEGIN SELECT RAISE(IGNORE); END;
CREATE TRIGGER IF NOT EXISTS ledger_decisions_no_replace BEFORE INSERT ON ledger_decisions
WHEN EXISTS (SELECT 1 FROM ledger_decisions WHERE position = NEW.position)
BEGIN SELECT RAISE(IGNORE); END;
"""

_POSTGRES = """
CREATE TABLE IF NOT EXISTS central_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS ledger_messages (
    position      BIGSERIAL PRIMARY KEY,
    message_id    TEXT NOT NULL,
    time          TIMESTAMPTZ NOT NULL,
    kind          TEXT NOT NULL,
    source        TEXT NOT NULL,
    vm            TEXT NOT NULL,
    event_id      TEXT,
    event_type    TEXT,
    sequence      BIGINT NOT NULL,
    body          JSONB NOT NULL,
    received_at   TIMESTAMPTZ NOT NULL DEFAULT now()
);
ALTER TABLE ledger_messages ADD COLUMN IF NOT EXISTS sender TEXT;
ALTER TABLE ledger_messages ADD COLUMN IF NOT EXISTS schemaversion TEXT;
ALTER TABLE ledger_messages ADD COLUMN IF NOT EXISTS raw BYTEA;
-- 2 made message_id unique alone.
ALTER TABLE ledger_messages DROP CONSTRAINT IF EXISTS ledger_messages_message_id_key;
CREATE UNIQUE INDEX IF NOT EXISTS ledger_messages_id ON ledger_messages (lower(vm), message_id);
CREATE INDEX IF NOT EXISTS ledger_messages_vm ON ledger_messages (lower(vm), time);
CREATE INDEX IF NOT EXISTS ledger_messages_event ON ledger_messages (event_id, time);
CREATE INDEX IF NOT EXISTS ledger_messages_time ON ledger_messages (time);
CREATE TABLE IF NOT EXISTS ledger_decisions (
    position    BIGSERIAL PRIMARY KEY,
    time        TIMESTAMPTZ NOT NULL,
    event_id    TEXT NOT NULL,
    event_type  TEXT,
    target      TEXT,
    body        JSONB NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_decisions_event ON ledger_decisions (event_id, time);
CREATE OR REPLACE FUNCTION ledger_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'the audit ledger is append-only'; END $$;
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'ledger_messages_append_only') THEN
        CREATE TRIGGER ledger_messages_append_only BEFORE UPDATE OR DELETE ON ledger_messages
        FOR EACH ROW EXECUTE FUNCTION ledger_append_only();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'ledger_decisions_append_only') THEN
        CREATE TRIGGER ledger_decisions_append_only BEFORE UPDATE OR DELETE ON ledger_decisions
        FOR EACH ROW EXECUTE FUNCTION ledger_append_only();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'ledger_messages_no_truncate') THEN
        CREATE TRIGGER ledger_messages_no_truncate BEFORE TRUNCATE ON ledger_messages
        FOR EACH STATEMENT EXECUTE FUNCTION ledger_append_only();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'ledger_decisions_no_truncate') THEN
        CREATE TRIGGER ledger_decisions_no_truncate BEFORE TRUNCATE ON ledger_decisions
        FOR EACH STATEMENT EXECUTE FUNCTION ledger_append_only();
    END IF;
END $$;
"""

_SQLITE += _APPROVER.format(serial="INTEGER PRIMARY KEY AUTOINCREMENT", blob="BLOB", time="TEXT")
_POSTGRES += _APPROVER.format(serial="BIGSERIAL PRIMARY KEY", blob="BYTEA", time="TIMESTAMPTZ")
# 2 made a message unique by its group and id alone.
_POSTGRES += (
    "ALTER TABLE approver_messages "
    "DROP CONSTRAINT IF EXISTS approver_messages_grp_message_id_key;\n"
)

# SQLite's ALTER TABLE has no IF NOT EXISTS: the columns 2 added to a ledger of 1, one by one.
_SQLITE_V2_COLUMNS = (("sender", "TEXT"), ("schemaversion", "TEXT"), ("raw", "BLOB"))

_LEDGER_TABLES = ("ledger_messages", "ledger_decisions")
_APPROVER_TABLES = ("approver_messages", "approver_approvals", "approver_holds")


async def schema_version(db: Database) -> int | None:
    """The schema version recorded in the database; 1 for a 0.1 ledger; None when empty."""
    return await _version(db, db.dialect)


async def _version(db: Executor, dialect: str) -> int | None:
    if dialect == "sqlite":
        tables = {
            row[0] for row in await db.fetch("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
    else:
        tables = {
            row[0]
            for row in await db.fetch(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
            )
        }
    if "central_meta" in tables:
        row = await db.fetchone("SELECT value FROM central_meta WHERE key = 'schema_version'")
        if row is not None:
            return int(row[0])
    return 1 if "ledger_messages" in tables else None


async def ensure_schema(db: Database, *, create: bool = True) -> None:
    """Make sure the schema is there at :data:`SCHEMA_VERSION`: create or upgrade it when
    ``create`` (and the role may), else :class:`ConfigError` saying how to migrate."""
    found = await schema_version(db)
    if found == SCHEMA_VERSION:
        return
    if found is not None and found > SCHEMA_VERSION:
        raise ConfigError(
            f"{db.display} holds schema version {found}, newer than this code's "
            f"{SCHEMA_VERSION}: upgrade the central services"
        )
    if not create:
        what = "no schema" if found is None else f"schema version {found}"
        raise ConfigError(
            f"{db.display} has {what}: run `scheduled-events migrate --db URL` as its owner"
        )
    try:
        if db.dialect == "sqlite":
            found = await _sqlite_upgrade(db)
        else:
            # Two processes starting at once must not race on the DDL.
            await db.script(f"SELECT pg_advisory_xact_lock(7061);\n{_POSTGRES}\n{_VERSION_ROW}")
    except DatabaseError as exc:
        raise ConfigError(
            f"cannot create or upgrade the schema in {db.display} ({exc}): run "
            "`scheduled-events migrate --db URL` as the database's owner, then start this "
            "service with its least-privilege role"
        ) from exc
    if found != SCHEMA_VERSION:  # else another process upgraded it meanwhile
        log.info("schema of %s at version %d (was %s)", db.display, SCHEMA_VERSION, found or "none")


_VERSION_ROW = (
    f"INSERT INTO central_meta (key, value) VALUES ('schema_version', '{SCHEMA_VERSION}') "
    "ON CONFLICT (key) DO UPDATE SET value = excluded.value;"
)

#: The tables whose uniqueness 3 changed: SQLite cannot drop a constraint, so they are copied
#: into tables made as 3 makes them.
_SQLITE_REBUILT = ("ledger_messages", "approver_messages")


async def _sqlite_upgrade(db: Database) -> int | None:
    """Create or upgrade the schema in one transaction that holds SQLite's write lock from its
    start: a process that starts beside this one (the approver and the audit on one file) waits
    for it, then finds the work done. The version found under the lock."""
    async with db.transaction() as tx:
        found = await _version(tx, "sqlite")
        if found == SCHEMA_VERSION:
            return found
        if found == 1:
            columns = {row[1] for row in await tx.fetch("PRAGMA table_info(ledger_messages)")}
            for name, kind in _SQLITE_V2_COLUMNS:
                if name not in columns:
                    await tx.execute(f"ALTER TABLE ledger_messages ADD COLUMN {name} {kind}")
        rebuild = ""
        if found is not None:
            tables = {row[0] for row in await tx.fetch("SELECT name FROM sqlite_master")}
            rebuilt = [table for table in _SQLITE_REBUILT if table in tables]
            if rebuilt:
                log.info(
                    "upgrading %s from schema version %d: copying %s into tables of version %d "
                    "(one transaction; the services wait for it)",
                    db.display,
                    found,
                    " and ".join(rebuilt),
                    SCHEMA_VERSION,
                )
            rebuild = "".join(_sqlite_rebuild(table) for table in rebuilt)
        # The copies, then the tables, indexes and triggers (those of the tables made anew).
        for statement in _statements(f"{rebuild}{_SQLITE}\n{_VERSION_ROW}"):
            await tx.execute(statement)
        return found


def _statements(script: str) -> list[str]:
    """``script``'s statements, one by one (a trigger's body stays whole)."""
    statements: list[str] = []
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            statements.append(pending.strip())
            pending = ""
    if pending.strip():
        raise ValueError(f"an incomplete statement ends the script: {pending.strip()[:80]!r}")
    return statements


def _sqlite_rebuild(table: str) -> str:
    """SQL that replaces ``table`` by a copy made as :data:`_SQLITE` makes it (its rows, their
    positions, and the autoincrement counter kept); its indexes and triggers go with the old
    table and :data:`_SQLITE` makes them again."""
    match = re.search(rf"CREATE TABLE IF NOT EXISTS {table} \((.*?)\n\);", _SQLITE, re.DOTALL)
    assert match is not None, table
    body = match.group(1)
    columns = ", ".join(
        line.split()[0]
        for line in body.strip().splitlines()
        if line.strip() and not line.strip().startswith(("UNIQUE", "PRIMARY", "--"))
    )
    new = f"{table}_rebuilt"
    return (
        f"CREATE TABLE {new} ({body}\n);\n"
        f"INSERT INTO {new} ({columns}) SELECT {columns} FROM {table};\n"
        f"DROP TABLE {table};\n"
        f"ALTER TABLE {new} RENAME TO {table};\n"
    )


_ROLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


async def grant(db: Database, *, audit: str | None = None, approver: str | None = None) -> None:
    """Grant PostgreSQL roles (created by the DBA) what each service needs and no more: the
    audit INSERT and SELECT on the ledger; the approver that, plus its own tables."""
    if db.dialect != "postgres":
        raise ConfigError("roles and grants are PostgreSQL's: SQLite has no users")
    statements: list[str] = []
    for role, writes in ((audit, ()), (approver, _APPROVER_TABLES)):
        if role is None:
            continue
        if not _ROLE.match(role):
            raise ConfigError(f"role {role!r} is not a plain PostgreSQL identifier")
        statements.append(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role}")
        for table in (*_LEDGER_TABLES, "central_meta"):
            statements.append(f"GRANT SELECT ON {table} TO {role}")
        for table in _LEDGER_TABLES:
            statements.append(f"GRANT INSERT ON {table} TO {role}")
            statements.append(f"GRANT USAGE ON SEQUENCE {table}_position_seq TO {role}")
        for table in writes:
            statements.append(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {role}")
        if writes:
            statements.append(f"GRANT USAGE ON SEQUENCE approver_messages_position_seq TO {role}")
            statements.append(f"GRANT INSERT, UPDATE ON central_meta TO {role}")
    await db.script(";\n".join(statements) + ";")
