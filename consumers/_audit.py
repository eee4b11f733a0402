"""The audit ledger: every lifecycle message, and every decision and operator action, appended
once.

Append-only by construction: the tables refuse UPDATE, DELETE (triggers), TRUNCATE
(PostgreSQL) and a REPLACE of a row (SQLite), and an append is idempotent on the message id, so
a redelivery or a second audit process changes nothing. Each message is kept as the bytes that
were received (fields of a newer minor version survive) beside its parsed columns; a message of
a type this version does not know (a newer minor version added it) is recorded too. A second
message with an id already recorded but other bytes is not dropped silently: :meth:`append`
says :attr:`Appended.CONFLICT`. :meth:`append_many` records a batch in one statement (the
audit service commits what it handled once per ack batch).

SQLite by default; PostgreSQL (the ``postgres`` extra) for central deployments. The URL picks
the backend (see :func:`consumers._db.open_database`); the statements are written once.

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
from enum import Enum
from typing import Any

from schemas import (
    LifecycleMessage,
    NewerMessage,
    SchemaError,
    UnknownMessageType,
    decode,
    decode_newer,
)
from schemas.messages import content_digest
from schemas.transport import AsyncResource

from ._db import Database, DatabaseError, as_time, open_database
from ._schema import ensure_schema
from ._stream import vm_of

__all__ = ["Appended", "Ledger", "LedgerEntry", "open_ledger"]

log = logging.getLogger(__name__)

#: The most entries one history or search returns.
MAX_ENTRIES = 10_000


class Appended(Enum):
    """What :meth:`Ledger.append` did."""

    NEW = "new"
    #: The same bytes under an id recorded already (a redelivery, an agent's replay): ignored.
    DUPLICATE = "duplicate"
    #: Other bytes under an id recorded already: not recorded; the caller reports it.
    CONFLICT = "conflict"


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One line of a timeline: a lifecycle message (``record == "message"``) or a decision or
    operator action (``record == "decision"``; ``kind`` is then ``decision.<action>``)."""

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


_INSERT_MESSAGES = (
    "INSERT INTO ledger_messages (message_id, time, kind, source, vm, event_id, event_type, "
    "sequence, body, received_at, sender, schemaversion, raw) VALUES {rows} "
    "ON CONFLICT (lower(vm), message_id) DO NOTHING RETURNING vm, message_id"
)
_ROW = "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
#: Rows per INSERT statement (13 values each: well under either database's parameter limit).
_ROWS_PER_INSERT = 256
#: A decision's row: ``(time, event_id, event_type, target, decision_body(...))``.
INSERT_DECISIONS = "INSERT INTO ledger_decisions (time, event_id, event_type, target, body)"
_INSERT_DECISION = INSERT_DECISIONS + " VALUES (?, ?, ?, ?, ?)"
_MESSAGE_COLUMNS = "time, kind, vm, event_id, event_type, sequence, message_id, body, position"
_DECISION_COLUMNS = "time, event_id, event_type, target, body, position"


def decision_body(
    action: str,
    reason: str,
    *,
    policy: str,
    decided_by: str,
    target: str | None,
    event_version: str | None,
    approval_id: str | None,
) -> str:
    """The ``body`` of a decision's row, whoever records it (the approver, the console)."""
    return json.dumps(
        {
            "action": action,
            "reason": reason,
            "policy": policy,
            "decided_by": decided_by,
            "target": target,
            "event_version": event_version,
            "approval_id": approval_id,
        }
    )


def _event_type(data: dict[str, Any]) -> str | None:
    event = data.get("event")
    value = event.get("EventType") if isinstance(event, dict) else None
    return value if isinstance(value, str) else None


class Ledger(AsyncResource):
    """The ledger in one database (see the module docstring)."""

    def __init__(self, db: Database, *, create: bool = True) -> None:
        self.db = db
        self._create = create

    async def connect(self) -> None:
        await self.db.connect()
        try:
            await ensure_schema(self.db, create=self._create)
        except BaseException:
            await self.db.close()
            raise

    async def close(self) -> None:
        await self.db.close()

    # ------------------------------------------------------------------------------- writing

    async def append(
        self, message: LifecycleMessage | NewerMessage, *, sender: str | None = None
    ) -> Appended:
        """Record a message (its bytes as received when it was received); ``sender`` is who
        the broker says published it."""
        (appended,) = await self.append_many([(message, sender)])
        return appended

    async def append_many(
        self, messages: Sequence[tuple[LifecycleMessage | NewerMessage, str | None]]
    ) -> list[Appended]:
        """Record messages (each with its ``sender``) in one statement per
        ``_ROWS_PER_INSERT``, so a burst costs the database one commit per statement rather
        than one per message; what became of each, in order."""
        # A message is known by its VM and its id: ids are the senders' own, and one VM's
        # message under another's id must not keep that one's out.
        inserted: set[tuple[str, str]] = set()
        for start in range(0, len(messages), _ROWS_PER_INSERT):
            chunk = messages[start : start + _ROWS_PER_INSERT]
            values = [value for message, sender in chunk for value in _row(message, sender)]
            sql = _INSERT_MESSAGES.format(rows=", ".join([_ROW] * len(chunk)))
            # RETURNING names the rows that are new, in the same trip as the insert.
            inserted.update((row[0], row[1]) for row in await self.db.fetch(sql, *values))
        results: list[Appended] = []
        first: set[tuple[str, str]] = set()
        for message, _ in messages:
            key = (vm_of(message), message.id)
            if key in inserted and key not in first:
                first.add(key)
                results.append(Appended.NEW)
                continue
            found = await self.recorded(message)
            if found is Appended.NEW:  # refused, yet not there: never acked as stored
                raise DatabaseError(
                    f"{self.db.display}: message {message.id} was neither inserted nor found"
                )
            results.append(found)
        return results

    async def recorded(self, message: LifecycleMessage | NewerMessage) -> Appended:
        """How ``message`` compares with what the ledger holds under its VM and id: NEW
        (nothing), DUPLICATE (the same content) or CONFLICT (other content)."""
        found = await self.db.fetchone(
            "SELECT raw, body FROM ledger_messages WHERE lower(vm) = lower(?) AND message_id = ?",
            vm_of(message),
            message.id,
        )
        if found is None:
            return Appended.NEW
        if _digest(found) == content_digest(message):
            return Appended.DUPLICATE
        return Appended.CONFLICT

    async def append_decision(
        self,
        event_id: str,
        action: str,
        reason: str,
        *,
        decided_by: str,
        policy: str = "",
        target: str | None = None,
        event_type: str | None = None,
        event_version: str | None = None,
        approval_id: str | None = None,
        at: datetime | None = None,
    ) -> None:
        """Record a decision of an approver (approve, wait, never) or an operator's action
        (hold, release, approve), with the event version it judged."""
        body = decision_body(
            action,
            reason,
            policy=policy,
            decided_by=decided_by,
            target=target,
            event_version=event_version,
            approval_id=approval_id,
        )
        await self.db.execute(
            _INSERT_DECISION, at or datetime.now(UTC), event_id, event_type, target, body
        )

    # ------------------------------------------------------------------------------- reading

    async def history(
        self, *, vm: str | None = None, event_id: str | None = None
    ) -> list[LedgerEntry]:
        """The timeline of a VM or an event, oldest first."""
        if (vm is None) == (event_id is None):
            raise ValueError("ask for the history of one VM or of one event")
        return await self.search(vm=vm, event_id=event_id)

    async def search(
        self,
        *,
        vm: str | None = None,
        event_id: str | None = None,
        event_type: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = MAX_ENTRIES,
    ) -> list[LedgerEntry]:
        """Messages and decisions matching every criterion given, oldest first (at most
        ``limit``, the newest ones when there are more)."""
        # Criteria both tables share, then the VM's: a message is the VM's when the VM sent
        # it; a decision when that VM was its target, or when it is about an event the VM
        # reported (a wait or a never has no target).
        shared: list[tuple[str, object]] = [
            (test, value)
            for test, value in (
                ("event_id = ?", event_id),
                ("lower(event_type) = lower(?)", event_type),
                ("time >= ?", since),
                ("time < ?", until),
            )
            if value is not None
        ]
        by_message, by_decision = list(shared), list(shared)
        if vm is not None:
            by_message.append(("lower(vm) = lower(?)", vm))
            by_decision.append(
                (
                    "(lower(target) = lower(?) OR event_id IN (SELECT event_id FROM "
                    "ledger_messages WHERE lower(vm) = lower(?) AND event_id IS NOT NULL))",
                    vm,
                )
            )
        bound = max(1, min(limit, MAX_ENTRIES))

        async def rows(table: str, columns: str, criteria: list[tuple[str, object]]) -> Any:
            clause = " AND ".join(test for test, _ in criteria) or "1 = 1"
            args = [value for test, value in criteria for _ in range(test.count("?"))]
            return await self.db.fetch(
                f"SELECT {columns} FROM {table} WHERE {clause} "
                f"ORDER BY time DESC, position DESC LIMIT {bound}",
                *args,
            )

        messages = await rows("ledger_messages", _MESSAGE_COLUMNS, by_message)
        decisions = await rows("ledger_decisions", _DECISION_COLUMNS, by_decision)
        entries = [(_message_entry(row), 0, int(row[8])) for row in messages] + [
            (_decision_entry(row), 1, int(row[5])) for row in decisions
        ]
        return _ordered(entries)[-bound:]

    async def latest_event(self, event_id: str) -> dict[str, Any] | None:
        """The event as the newest transition message about it shows it (IMDS field names),
        or None when none was recorded."""
        row = await self.db.fetchone(
            "SELECT body FROM ledger_messages WHERE event_id = ? AND kind IN "
            "('scheduled', 'started', 'updated', 'completed', 'canceled') "
            "ORDER BY time DESC, position DESC LIMIT 1",
            event_id,
        )
        if row is None:
            return None
        event = _json(row[0]).get("data", {}).get("event")
        return event if isinstance(event, dict) else None

    async def count(self) -> int:
        row = await self.db.fetchone("SELECT count(*) FROM ledger_messages")
        return 0 if row is None else int(row[0])


def _row(message: LifecycleMessage | NewerMessage, sender: str | None) -> tuple[object, ...]:
    """A message's ``ledger_messages`` values, in ``_INSERT_MESSAGES``'s order."""
    if isinstance(message, NewerMessage):
        raw = message.received_bytes
        kind, vm = message.kind_name, message.vm_name
        event_type = _event_type(message.data)
        body = raw.decode()
    else:
        serialized = message.to_bytes()
        raw = message.received_bytes or serialized
        kind, vm, event_type = message.kind.value, message.vm.name, message.event_type
        body = serialized.decode()
    return (
        message.id,
        message.time,
        kind,
        message.source,
        vm,
        message.subject,
        event_type,
        message.sequence,
        body,
        datetime.now(UTC),
        sender,
        message.schemaversion,
        raw,
    )


def _digest(row: Sequence[Any]) -> str | None:
    """What a stored message says (its raw bytes, or its body for a 0.1 ledger)."""
    raw, body = row
    data = bytes(raw) if raw is not None else json.dumps(_json(body)).encode()
    try:
        return content_digest(decode(data))
    except UnknownMessageType:
        return content_digest(decode_newer(data))
    except SchemaError:
        return None


def _json(value: object) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    data = json.loads(value if isinstance(value, str | bytes) else str(value))
    return data if isinstance(data, dict) else {}


def _message_entry(row: Sequence[Any]) -> LedgerEntry:
    time, kind, vm, event_id, event_type, sequence, message_id, body = row[:8]
    return LedgerEntry(
        "message", as_time(time), kind, vm, event_id, event_type, sequence, message_id, _json(body)
    )


def _decision_entry(row: Sequence[Any]) -> LedgerEntry:
    time, event_id, event_type, target, body = row[:5]
    data = _json(body)
    return LedgerEntry(
        "decision",
        as_time(time),
        f"decision.{data['action']}",
        data.get("decided_by", "") or target or "",
        event_id,
        event_type,
        0,
        "",
        data,
    )


def _ordered(entries: Sequence[tuple[LedgerEntry, int, int]]) -> list[LedgerEntry]:
    ranked = sorted(entries, key=lambda e: (e[0].time, e[1], e[0].sequence, e[2]))
    return [entry for entry, _, _ in ranked]


def open_ledger(url: str, *, create: bool = True) -> Ledger:
    """The ledger at ``url`` (not opened yet: use ``async with``). ``create`` False: only an
    existing ledger (``audit history`` must not create a database)."""
    return Ledger(open_database(url, create=create), create=create)
