"""The audit ledger: every lifecycle message, and every approver decision, appended once.

Append-only by construction: the tables refuse UPDATE and DELETE (triggers), and an append is
idempotent on the message id, so a redelivery or a second audit process changes nothing.
SQLite (aiosqlite) by default; PostgreSQL (asyncpg, the ``postgres`` extra) for central
deployments. The URL picks the backend:

=================================  =======================================================
``audit.db``, ``sqlite:///REL``    SQLite file (``sqlite:////ABS`` for an absolute path)
``postgresql://user@host/db``      PostgreSQL
=================================  =======================================================

>>> async with open_ledger("sqlite:///audit.db") as ledger:    # doctest: +SKIP
...     await ledger.append(message)
...     for entry in await ledger.history(event_id="EVT-1"): ...
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self
from urllib.parse import urlsplit

from schemas import ConfigError, LifecycleMessage, TransportError
from schemas.transport import AsyncResource, redact

from ._policies import Verdict

__all__ = [
    "Ledger",
    "LedgerEntry",
    "PostgresLedger",
    "SqliteLedger",
    "open_ledger",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One line of a timeline: a lifecycle message (``record == "message"``) or an approver
    decision (``record == "decision"``; ``kind`` is then ``decision.<action>``)."""

    record: str
    time: datetime
    kind: str
    vm: str
    event_id: str | None
    event_type: str | None
    sequence: int
    message_id: str
    #: The message as received (CloudEvent JSON), or the decision's fields.
    body: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "record": self.record,
            "time": self.time.astimezone(UTC).isoformat(),
            "kind": self.kind,
            "vm": self.vm,
            "event_id": self.event_id,
            "event_type": self.event_type,
            "sequence": self.sequence,
            "id": self.message_id,
            "body": self.body,
        }


class Ledger(Protocol):
    """What the audit service and ``audit history`` need from a store."""

    async def connect(self) -> None: ...
    async def close(self) -> None: ...
    async def __aenter__(self) -> Self: ...
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    async def append(self, message: LifecycleMessage) -> bool:
        """Record a message; False when its id was recorded already."""
        ...

    async def append_decision(
        self,
        event_id: str,
        verdict: Verdict,
        *,
        decided_by: str,
        target: str | None = None,
        event_type: str | None = None,
        at: datetime | None = None,
    ) -> None: ...

    async def history(
        self, *, vm: str | None = None, event_id: str | None = None
    ) -> list[LedgerEntry]:
        """The timeline of a VM or an event, oldest first."""
        ...

    async def count(self) -> int: ...


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _row_of(message: LifecycleMessage) -> tuple[Any, ...]:
    return (
        message.id,
        message.time,
        message.kind.value,
        message.source,
        message.vm.name,
        message.subject,
        message.event_type,
        message.sequence,
        message.to_bytes().decode(),
    )


def _decision_body(verdict: Verdict, decided_by: str, target: str | None) -> dict[str, Any]:
    return {
        "action": verdict.action.value,
        "reason": verdict.reason,
        "policy": verdict.policy,
        "decided_by": decided_by,
        "target": target,
    }


# ------------------------------------------------------------------------------------ SQLite

_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger_messages (
    position    INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id  TEXT NOT NULL UNIQUE,
    time        TEXT NOT NULL,
    kind        TEXT NOT NULL,
    source      TEXT NOT NULL,
    vm          TEXT NOT NULL COLLATE NOCASE,
    event_id    TEXT,
    event_type  TEXT,
    sequence    INTEGER NOT NULL,
    body        TEXT NOT NULL,
    received_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_messages_vm ON ledger_messages (vm, time);
CREATE INDEX IF NOT EXISTS ledger_messages_event ON ledger_messages (event_id, time);
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
"""


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


class SqliteLedger(AsyncResource):
    """The ledger in one SQLite file (WAL mode; work runs in aiosqlite's thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db: Any = None

    async def connect(self) -> None:
        import aiosqlite

        if self._db is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            db = await aiosqlite.connect(self.path)
            await db.execute("PRAGMA journal_mode=WAL")
            await db.execute("PRAGMA synchronous=NORMAL")
            await db.executescript(_SQLITE_SCHEMA)
            await db.commit()
        except aiosqlite.Error as exc:
            raise ConfigError(f"cannot open the audit ledger {self.path}: {exc}") from exc
        self._db = db

    async def close(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            await db.close()

    def _conn(self) -> Any:
        if self._db is None:
            raise RuntimeError("open the ledger first (async with open_ledger(...))")
        return self._db

    async def append(self, message: LifecycleMessage) -> bool:
        row = list(_row_of(message))
        row[1] = _iso(row[1])
        db = self._conn()
        cursor = await db.execute(
            "INSERT OR IGNORE INTO ledger_messages (message_id, time, kind, source, vm, "
            "event_id, event_type, sequence, body, received_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (*row, _iso(datetime.now(UTC))),
        )
        await db.commit()
        return bool(cursor.rowcount)

    async def append_decision(
        self,
        event_id: str,
        verdict: Verdict,
        *,
        decided_by: str,
        target: str | None = None,
        event_type: str | None = None,
        at: datetime | None = None,
    ) -> None:
        db = self._conn()
        await db.execute(
            "INSERT INTO ledger_decisions (time, event_id, event_type, target, body) "
            "VALUES (?, ?, ?, ?, ?)",
            (
                _iso(at or datetime.now(UTC)),
                event_id,
                event_type,
                target,
                json.dumps(_decision_body(verdict, decided_by, target)),
            ),
        )
        await db.commit()

    async def history(
        self, *, vm: str | None = None, event_id: str | None = None
    ) -> list[LedgerEntry]:
        where, args = _where(vm, event_id, "?")
        db = self._conn()
        async with db.execute(
            "SELECT time, kind, vm, event_id, event_type, sequence, message_id, body, position "
            f"FROM ledger_messages WHERE {where}",
            args,
        ) as cursor:
            messages = await cursor.fetchall()
        target_where = where.replace("vm =", "target =")
        async with db.execute(
            "SELECT time, event_id, event_type, target, body, position "
            f"FROM ledger_decisions WHERE {target_where}",
            args,
        ) as cursor:
            decisions = await cursor.fetchall()
        entries = [(_message_entry(_parse_time(r[0]), *r[1:8]), 0, r[8]) for r in messages] + [
            (_decision_entry(_parse_time(r[0]), *r[1:5]), 1, r[5]) for r in decisions
        ]
        return _ordered(entries)

    async def count(self) -> int:
        async with self._conn().execute("SELECT count(*) FROM ledger_messages") as cursor:
            row = await cursor.fetchone()
        return int(row[0])


def _where(vm: str | None, event_id: str | None, placeholder: str) -> tuple[str, list[str]]:
    if (vm is None) == (event_id is None):
        raise ValueError("ask for the history of one VM or of one event")
    if vm is not None:
        return f"vm = {placeholder}", [vm]
    assert event_id is not None
    return f"event_id = {placeholder}", [event_id]


def _message_entry(
    time: datetime,
    kind: str,
    vm: str,
    event_id: str | None,
    event_type: str | None,
    sequence: int,
    message_id: str,
    body: str,
) -> LedgerEntry:
    return LedgerEntry(
        "message", time, kind, vm, event_id, event_type, sequence, message_id, json.loads(body)
    )


def _decision_entry(
    time: datetime, event_id: str, event_type: str | None, target: str | None, body: str
) -> LedgerEntry:
    data = json.loads(body)
    return LedgerEntry(
        "decision",
        time,
        f"decision.{data['action']}",
        data.get("decided_by", ""),
        event_id,
        event_type,
        0,
        "",
        data,
    )


def _ordered(entries: Sequence[tuple[LedgerEntry, int, int]]) -> list[LedgerEntry]:
    ranked = sorted(entries, key=lambda e: (e[0].time, e[1], e[0].sequence, e[2]))
    return [entry for entry, _, _ in ranked]


# -------------------------------------------------------------------------------- PostgreSQL

_POSTGRES_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger_messages (
    position    BIGSERIAL PRIMARY KEY,
    message_id  TEXT NOT NULL UNIQUE,
    time        TIMESTAMPTZ NOT NULL,
    kind        TEXT NOT NULL,
    source      TEXT NOT NULL,
    vm          TEXT NOT NULL,
    event_id    TEXT,
    event_type  TEXT,
    sequence    BIGINT NOT NULL,
    body        JSONB NOT NULL,
    received_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS ledger_messages_vm ON ledger_messages (lower(vm), time);
CREATE INDEX IF NOT EXISTS ledger_messages_event ON ledger_messages (event_id, time);
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
END $$;
"""


class PostgresLedger(AsyncResource):
    """The ledger in PostgreSQL, for a central deployment (several audit processes may share
    it: appends are idempotent on the message id)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._pool: Any = None

    async def connect(self) -> None:
        try:
            import asyncpg
        except ImportError as exc:
            raise ConfigError(
                "PostgreSQL needs asyncpg: pip install 'scheduled-events-relay[postgres]'"
            ) from exc
        if self._pool is not None:
            return
        try:
            pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=4, timeout=10)
            # Two audit processes starting at once must not race on the DDL.
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock(7061)")
                await conn.execute(_POSTGRES_SCHEMA)
        except (OSError, asyncpg.PostgresError) as exc:
            raise TransportError(f"cannot open the audit ledger {redact(self.dsn)}: {exc}") from exc
        self._pool = pool

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    def _conn(self) -> Any:
        if self._pool is None:
            raise RuntimeError("open the ledger first (async with open_ledger(...))")
        return self._pool

    async def append(self, message: LifecycleMessage) -> bool:
        status: str = await self._conn().execute(
            "INSERT INTO ledger_messages (message_id, time, kind, source, vm, event_id, "
            "event_type, sequence, body) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb) "
            "ON CONFLICT (message_id) DO NOTHING",
            *_row_of(message),
        )
        return status.endswith(" 1")

    async def append_decision(
        self,
        event_id: str,
        verdict: Verdict,
        *,
        decided_by: str,
        target: str | None = None,
        event_type: str | None = None,
        at: datetime | None = None,
    ) -> None:
        await self._conn().execute(
            "INSERT INTO ledger_decisions (time, event_id, event_type, target, body) "
            "VALUES ($1, $2, $3, $4, $5::jsonb)",
            at or datetime.now(UTC),
            event_id,
            event_type,
            target,
            json.dumps(_decision_body(verdict, decided_by, target)),
        )

    async def history(
        self, *, vm: str | None = None, event_id: str | None = None
    ) -> list[LedgerEntry]:
        where, args = _where(vm, event_id, "$1")
        where = where.replace("vm = $1", "lower(vm) = lower($1)")
        pool = self._conn()
        messages = await pool.fetch(
            "SELECT time, kind, vm, event_id, event_type, sequence, message_id, body::text, "
            f"position FROM ledger_messages WHERE {where}",
            *args,
        )
        target_where = where.replace("lower(vm)", "lower(target)")
        decisions = await pool.fetch(
            "SELECT time, event_id, event_type, target, body::text, position "
            f"FROM ledger_decisions WHERE {target_where}",
            *args,
        )
        entries = [(_message_entry(*tuple(r)[:8]), 0, r[8]) for r in messages] + [
            (_decision_entry(*tuple(r)[:5]), 1, r[5]) for r in decisions
        ]
        return _ordered(entries)

    async def count(self) -> int:
        value = await self._conn().fetchval("SELECT count(*) FROM ledger_messages")
        return int(value)


def open_ledger(url: str) -> Ledger:
    """The ledger for ``url`` (not opened yet: use ``async with``)."""
    text = url.strip()
    scheme = urlsplit(text).scheme.lower()
    if scheme in ("postgresql", "postgres"):
        return PostgresLedger(text)
    if scheme == "sqlite":
        # SQLAlchemy's convention: sqlite:///relative.db, sqlite:////absolute/path.db
        path = text.removeprefix("sqlite:").removeprefix("//").removeprefix("/")
        if not path:
            raise ConfigError(f"{url!r}: give the SQLite file, sqlite:///audit.db")
        return SqliteLedger(Path(path))
    if scheme and len(scheme) > 1:  # a one-letter "scheme" is a Windows drive
        raise ConfigError(
            f"audit database {redact(url)!r} is not understood: use a file path, "
            "sqlite:///PATH or postgresql://USER@HOST/DB"
        )
    return SqliteLedger(Path(text))
