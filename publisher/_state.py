"""The agent's durable state: SQLite in WAL mode, in ``--state-dir``.

It holds the last IMDS document (the whole one, every VM's events), the per-agent sequence, the
outbox of messages not yet confirmed by the broker, and the outcome of each approval handled.
A new document, the messages it causes and the sequence numbers they take are written in one
transaction: after a crash (kill -9 included) the agent finds either the old document and none
of its messages, or the new one and all of them, so a transition is neither lost nor repeated
with a different id. Rows leave the outbox only after the broker confirmed them.

SQLite runs on one worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from schemas import LifecycleMessage, MessageType, ScheduledEventsDocument

__all__ = ["STATE_FILE", "Committed", "OutboxRow", "StateStore", "StoredState"]

log = logging.getLogger(__name__)

T = TypeVar("T")

STATE_FILE = "agent-state.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS outbox (
    sequence   INTEGER PRIMARY KEY,
    message_id TEXT NOT NULL,
    kind       TEXT NOT NULL,
    droppable  INTEGER NOT NULL,
    body       BLOB NOT NULL,
    created    REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS outbox_droppable ON outbox (droppable, sequence);
CREATE TABLE IF NOT EXISTS approvals (
    approval_id TEXT PRIMARY KEY,
    message     BLOB NOT NULL,
    decided     REAL NOT NULL
);
"""

#: Messages the bound may drop (oldest first); every other kind is kept whatever the bound.
DROPPABLE = frozenset({MessageType.AGENT_HEARTBEAT})


@dataclass(frozen=True, slots=True)
class OutboxRow:
    sequence: int
    message_id: str
    kind: str
    body: bytes
    #: Wall-clock time the row entered the outbox (publish latency is measured from it).
    created: float


@dataclass(frozen=True, slots=True)
class StoredState:
    document: ScheduledEventsDocument | None
    #: Which events the last run published: ``all`` or ``vm:<name>``; None on a first start.
    scope: str | None
    next_sequence: int
    depth: int


@dataclass(frozen=True, slots=True)
class Committed:
    rows: list[OutboxRow]
    dropped: int
    depth: int


class StateStore:
    """Open with :meth:`open`; ``path`` None keeps everything in memory (demo, tests)."""

    def __init__(self, connection: sqlite3.Connection, executor: ThreadPoolExecutor, limit: int):
        self._db = connection
        self._executor = executor
        self.limit = limit
        self.path: Path | None = None

    @classmethod
    async def open(cls, directory: Path | None, *, limit: int = 10_000) -> StateStore:
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-state")
        loop = asyncio.get_running_loop()
        path = None if directory is None else directory / STATE_FILE
        try:
            connection = await loop.run_in_executor(executor, _connect, path)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        store = cls(connection, executor, limit)
        store.path = path
        return store

    async def _run(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(fn, self._db, *args))

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._db.close)
        self._executor.shutdown(wait=True)

    async def load(self) -> StoredState:
        result: StoredState = await self._run(_load)
        return result

    async def commit(
        self,
        messages: Sequence[LifecycleMessage],
        *,
        document: ScheduledEventsDocument | None = None,
        scope: str | None = None,
        approval_id: str | None = None,
    ) -> Committed:
        """In one transaction: store ``document`` (and ``scope``) when given, give each message
        the next sequence number and put it in the outbox, remember the approval's outcome."""
        result: Committed = await self._run(
            _commit, list(messages), document, scope, approval_id, self.limit
        )
        if result.dropped:
            log.warning(
                "outbox full (%d rows, bound %d): dropped %d heartbeat(s)",
                result.depth,
                self.limit,
                result.dropped,
            )
        if result.depth > self.limit:
            log.error(
                "outbox holds %d messages, above its bound of %d: transitions are never dropped;"
                " is the broker reachable?",
                result.depth,
                self.limit,
            )
        return result

    async def pending(self, limit: int = 100) -> list[OutboxRow]:
        """The oldest rows not yet confirmed, in sequence order."""
        rows: list[OutboxRow] = await self._run(_pending, limit)
        return rows

    async def delete(self, sequence: int) -> int:
        """Remove a confirmed row; returns the depth left."""
        depth: int = await self._run(_delete, sequence)
        return depth

    async def depth(self) -> int:
        depth: int = await self._run(_depth)
        return depth

    async def approval_outcome(self, approval_id: str) -> bytes | None:
        """The outcome message of an approval already handled, if any."""
        found: bytes | None = await self._run(_approval_outcome, approval_id)
        return found


# ----------------------------------------------------------------- on the worker thread only


def _connect(path: Path | None) -> sqlite3.Connection:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(
        ":memory:" if path is None else str(path), check_same_thread=False, isolation_level=None
    )
    if path is not None:
        db.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed transition survives a power loss too; writes happen only on change.
        db.execute("PRAGMA synchronous=FULL")
    db.executescript(_SCHEMA)
    return db


def _meta(db: sqlite3.Connection, key: str) -> str | None:
    row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else str(row[0])


def _set_meta(db: sqlite3.Connection, key: str, value: str) -> None:
    db.execute(
        "INSERT INTO meta (key, value) VALUES (?, ?) "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (key, value),
    )


def _depth(db: sqlite3.Connection) -> int:
    return int(db.execute("SELECT count(*) FROM outbox").fetchone()[0])


def _load(db: sqlite3.Connection) -> StoredState:
    raw = _meta(db, "document")
    document = None if raw is None else ScheduledEventsDocument.from_imds(json.loads(raw))
    return StoredState(
        document=document,
        scope=_meta(db, "scope"),
        next_sequence=int(_meta(db, "next_sequence") or 1),
        depth=_depth(db),
    )


def _commit(
    db: sqlite3.Connection,
    messages: list[LifecycleMessage],
    document: ScheduledEventsDocument | None,
    scope: str | None,
    approval_id: str | None,
    limit: int,
) -> Committed:
    rows: list[OutboxRow] = []
    now = time.time()
    db.execute("BEGIN IMMEDIATE")
    try:
        sequence = int(_meta(db, "next_sequence") or 1)
        for message in messages:
            numbered = message.with_sequence(sequence)
            body = numbered.to_bytes()
            kind = numbered.kind
            db.execute(
                "INSERT INTO outbox (sequence, message_id, kind, droppable, body, created) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (sequence, numbered.id, kind.value, int(kind in DROPPABLE), body, now),
            )
            rows.append(OutboxRow(sequence, numbered.id, kind.value, body, now))
            if approval_id is not None:
                db.execute(
                    "INSERT OR REPLACE INTO approvals (approval_id, message, decided) "
                    "VALUES (?, ?, ?)",
                    (approval_id, body, now),
                )
            sequence += 1
        if approval_id is not None:  # outcomes are kept a day: long enough for any redelivery
            db.execute("DELETE FROM approvals WHERE decided < ?", (now - 86_400,))
        _set_meta(db, "next_sequence", str(sequence))
        if document is not None:
            _set_meta(db, "document", json.dumps(document.to_imds(), separators=(",", ":")))
        if scope is not None:
            _set_meta(db, "scope", scope)
        depth = _depth(db)
        dropped = 0
        if depth > limit:
            dropped = db.execute(
                "DELETE FROM outbox WHERE sequence IN (SELECT sequence FROM outbox "
                "WHERE droppable = 1 ORDER BY sequence LIMIT ?)",
                (depth - limit,),
            ).rowcount
            depth -= dropped
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    kept = {row.sequence for row in rows} if not dropped else _present(db, rows)
    return Committed([r for r in rows if r.sequence in kept], dropped, depth)


def _present(db: sqlite3.Connection, rows: list[OutboxRow]) -> set[int]:
    found: set[int] = set()
    for row in rows:
        if db.execute("SELECT 1 FROM outbox WHERE sequence = ?", (row.sequence,)).fetchone():
            found.add(row.sequence)
    return found


def _pending(db: sqlite3.Connection, limit: int) -> list[OutboxRow]:
    cursor = db.execute(
        "SELECT sequence, message_id, kind, body, created FROM outbox ORDER BY sequence LIMIT ?",
        (limit,),
    )
    return [OutboxRow(int(s), str(i), str(k), bytes(b), float(c)) for s, i, k, b, c in cursor]


def _delete(db: sqlite3.Connection, sequence: int) -> int:
    db.execute("DELETE FROM outbox WHERE sequence = ?", (sequence,))
    return _depth(db)


def _approval_outcome(db: sqlite3.Connection, approval_id: str) -> bytes | None:
    row = db.execute(
        "SELECT message FROM approvals WHERE approval_id = ?", (approval_id,)
    ).fetchone()
    return None if row is None else bytes(row[0])
