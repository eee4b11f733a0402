"""The approver's durable state: what the standby that takes over must know.

Guarantee: when a message is acked, everything its handling changed is committed, in one
transaction with the other messages of its batch — the message itself (what the fleet view is
made of), the decisions it led to, and the approvals it signed (as ``sending``, before they go
to the broker; ``sent`` in a later commit, once the broker took them). So an approver killed at
any point (kill -9 included) leaves a state from which another one rebuilds the same fleet view
(:meth:`ApproverState.load` replays the messages) and sends again, with the same id, any
approval it cannot be sure went out.

Two approvers of one group share the database; one is active at a time. Every commit moves the
group's state version; a process that finds a version it did not write loads the state again
before it decides anything (the approver's ``_sync``), so a standby that takes over never
acts on what it knew when it started. A commit moves the version only from the one its process
read or wrote last (a compare and set), or commits nothing: the process the broker took the
queue from (its link died; it may not know yet) cannot commit over the one that took over, and
of two processes that handled one redelivered message, only one commits it.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from schemas import (
    AgentMessage,
    Approval,
    LifecycleMessage,
    ReplyAddress,
    SchemaError,
    decode,
)

from ._audit import INSERT_DECISIONS, decision_body
from ._db import Database, Statement, WriteConflict, as_time
from ._fleet import FleetView, SentApproval

__all__ = ["ApproverState", "Hold", "PendingApproval", "PlannedDecision"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PendingApproval:
    """A signed approval and where it goes; ``sending`` until the broker took it."""

    approval: Approval
    address: ReplyAddress


@dataclass(frozen=True, slots=True)
class PlannedDecision:
    """A decision for the ledger: the approver's (with the message that led to it) or an
    operator's hold or release (with the change of the holds)."""

    event_id: str
    event_type: str | None
    action: str
    reason: str
    policy: str
    decided_by: str
    event_version: str | None
    at: datetime
    target: str | None = None
    approval_id: str | None = None


@dataclass(frozen=True, slots=True)
class Hold:
    """An operator's hold: the approver leaves the event to NotBefore."""

    event_id: str
    held_by: str
    reason: str
    #: None when the stored time cannot be read (the hold holds all the same).
    at: datetime | None


@dataclass(slots=True)
class Loaded:
    """What :meth:`ApproverState.load` found besides the fleet view."""

    #: Approvals signed but not known to be sent: send them again (same id).
    unsent: list[PendingApproval] = field(default_factory=list)
    #: The last decision recorded for each open event: (action, reason).
    last_decisions: dict[str, tuple[str, str]] = field(default_factory=dict)
    messages: int = 0


_VERSION_KEY = "approver_state_version:{group}"


class ApproverState:
    """The state of approver group ``group`` in ``db``; ``writer`` names this process."""

    def __init__(self, db: Database, group: str, *, writer: str | None = None) -> None:
        self.db = db
        self.group = group
        self.writer = writer or uuid.uuid4().hex
        self._key = _VERSION_KEY.format(group=group)
        #: The version this process last wrote or read; None before the first load.
        self.version: str | None = None

    # ------------------------------------------------------------------------------ loading

    async def current_version(self) -> str | None:
        row = await self.db.fetchone("SELECT value FROM central_meta WHERE key = ?", self._key)
        return None if row is None else str(row[0])

    async def stale(self) -> bool:
        """Whether another process wrote since this one last wrote or loaded."""
        return await self.current_version() != self.version

    async def load(self, fleet: FleetView) -> Loaded:
        """Rebuild ``fleet`` from the stored messages (oldest first) and the approvals sent.

        A row that cannot be read (a downgrade, a hand edit, anyone with INSERT on the
        append-only ledger) is skipped with a warning that names it: it costs what that row
        said, never the load (which every standby taking over and every process after a
        refused commit needs before it decides anything)."""
        version = await self.current_version()
        loaded = Loaded()
        rows = await self.db.fetch(
            "SELECT position, raw FROM approver_messages WHERE grp = ? ORDER BY position",
            self.group,
        )
        with fleet.replaying():
            for position, raw in rows:
                try:
                    message = decode(_blob(raw))
                except SchemaError as exc:
                    log.warning(
                        "approver state: stored message %s of group %s cannot be read (%s): "
                        "skipped; the fleet view is rebuilt without it",
                        position,
                        self.group,
                        exc,
                    )
                    continue
                fleet.apply(message)
                loaded.messages += 1
        approvals = await self.db.fetch(
            "SELECT approval_id, event_id, event_version, target, reply_channel, reply_key, "
            "body, state, at FROM approver_approvals WHERE grp = ? ORDER BY at",
            self.group,
        )
        for row in approvals:
            approval_id, event_id, version_sent, target, channel, key, body, status, at = row
            state = fleet.event(event_id)
            if state is None:
                continue
            try:
                approval = Approval.from_bytes(_blob(body))
                sent_at = as_time(at)
                address = ReplyAddress(channel=channel, key=key)
            except (SchemaError, ValueError, TypeError, OverflowError) as exc:
                log.warning(
                    "approver state: stored approval %s of event %s cannot be read (%s): "
                    "skipped; the event is decided as if it had not been signed",
                    approval_id,
                    event_id,
                    exc,
                )
                continue
            state.send(SentApproval(approval.approval_id, version_sent, target, sent_at))
            # One its VM refused is void (the outcome is among the messages replayed above).
            for outcome in state.outcomes.values():
                if not outcome.data.applied:
                    state.settle(outcome.data.approval_id, outcome.vm.name)
            fleet.refresh(state)
            if status == "sending":
                loaded.unsent.append(PendingApproval(approval, address))
        open_ids = [s.event_id for s in fleet.events(open_only=True)]
        for event_id in open_ids:
            last = await self._last_decision(event_id)
            if last is not None:
                loaded.last_decisions[event_id] = last
        self.version = version
        return loaded

    async def _last_decision(self, event_id: str) -> tuple[str, str] | None:
        """The newest readable decision on ``event_id`` in the ledger: (action, reason).

        Usually one row is read. One that cannot be read is skipped with a warning, and the
        one before it counts; past the newest :data:`_DECISIONS_LOOKED_AT`, the event is
        decided as if none had been recorded (its next decision is recorded again)."""
        skipped = 0
        for limit in (1, _DECISIONS_LOOKED_AT - 1):
            rows = await self.db.fetch(
                "SELECT position, body FROM ledger_decisions WHERE event_id = ? "
                "ORDER BY time DESC, position DESC LIMIT ? OFFSET ?",
                event_id,
                limit,
                skipped,
            )
            for position, body in rows:
                try:
                    return _decision_of(body)
                except ValueError as exc:
                    skipped += 1
                    log.warning(
                        "approver state: decision %s of event %s in the ledger cannot be read "
                        "(%s): skipped; the one recorded before it counts",
                        position,
                        event_id,
                        exc,
                    )
            if len(rows) < limit:
                break
        return None

    async def stored(self, vm: str, message_id: str) -> bytes | None:
        """The message VM ``vm`` sent under ``message_id``, as received, or None. Ids are the
        senders' own: another VM's message under the same id is not this one."""
        row = await self.db.fetchone(
            "SELECT raw FROM approver_messages WHERE grp = ? AND message_id = ? AND vm = ?",
            self.group,
            message_id,
            vm.casefold(),
        )
        if row is None:
            return None
        try:
            raw = _blob(row[0])
        except SchemaError as exc:
            log.warning(
                "approver state: stored message %s of %s cannot be read (%s): taken as not "
                "stored; the message is handled as new",
                message_id,
                vm,
                exc,
            )
            return None
        return raw.encode() if isinstance(raw, str) else raw

    # ------------------------------------------------------------------------------ writing

    def commit(
        self,
        messages: Sequence[LifecycleMessage],
        decisions: Sequence[PlannedDecision],
        approvals: Sequence[PendingApproval],
        *,
        sent: Sequence[str] = (),
        forget: Sequence[str] = (),
    ) -> Coroutine[object, object, None]:
        """In one transaction: the messages (an agent's own message replaces its previous
        one), the decisions, the approvals as ``sending``, the approvals the broker took since
        (``sent``), what pruned events were made of (``forget``), and a new state version.
        Rows go in a few multi-row statements, whatever the number of messages.

        Its statements are made now; await what this returns for the write. A commit made after
        this one expects the version this one writes: it lands after it, or fails with it.
        The write raises :class:`~consumers._db.WriteConflict`, committing nothing, when another
        process wrote since this one last loaded or wrote (its view is out of date: load it
        again)."""
        version = f"{self.writer}:{uuid.uuid4().hex[:12]}"
        statements = [
            *self._store_messages(messages),
            *_insert_decisions(decisions),
            *_insert(
                "INSERT INTO approver_approvals (grp, approval_id, event_id, event_version, "
                "target, reply_channel, reply_key, body, state, at)",
                [
                    (
                        self.group,
                        p.approval.approval_id,
                        p.approval.event_id,
                        p.approval.event_version or "",
                        p.approval.vm,
                        p.address.channel,
                        p.address.key,
                        p.approval.to_bytes(),
                        "sending",
                        p.approval.issued_at,
                    )
                    for p in approvals
                ],
                "ON CONFLICT (grp, approval_id) DO NOTHING",
            ),
            *_where_in(
                "UPDATE approver_approvals SET state = 'sent' WHERE grp = ? AND approval_id",
                self.group,
                sent,
            ),
            *(
                statement
                for table in ("approver_messages", "approver_approvals")
                for statement in _where_in(
                    f"DELETE FROM {table} WHERE grp = ? AND event_id", self.group, forget
                )
            ),
        ]
        # The new version replaces the one this process read or wrote last, or nothing is
        # written: a process that another one took over from (it did not see its link die)
        # never commits over what that one did.
        guard: Statement = (
            (
                "INSERT INTO central_meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING",
                (self._key, version),
            )
            if self.version is None
            else (
                "UPDATE central_meta SET value = ? WHERE key = ? AND value = ?",
                (version, self._key, self.version),
            )
        )
        self.version = version
        return self._write(statements, guard)

    async def _write(self, statements: list[Statement], guard: Statement) -> None:
        # In one go (on SQLite, one trip to the database's thread): nothing here needs the
        # result of another statement, and an approver under load commits several times a
        # second.
        try:
            await self.db.write(statements, guard=guard)
        except WriteConflict as exc:
            raise WriteConflict(
                f"approver group {self.group}: another process wrote the group's state since "
                "this one read it (it took over the queue), or a commit before this one "
                "failed: this batch is not committed, and the state is loaded again before "
                "the next decision"
            ) from exc

    def _store_messages(self, messages: Sequence[LifecycleMessage]) -> list[Statement]:
        """The messages, in order; of an agent's own messages (its identity and liveness) only
        its last one is kept."""
        last_own: dict[str, int] = {}
        for index, message in enumerate(messages):
            if isinstance(message, AgentMessage):
                last_own[message.vm.name.casefold()] = index
        rows = []
        for index, message in enumerate(messages):
            vm = message.vm.name.casefold()
            own = isinstance(message, AgentMessage)
            if own and last_own[vm] != index:
                continue
            raw = message.received_bytes or message.to_bytes()
            rows.append((self.group, message.id, None if own else message.subject, vm, raw))
        return [
            *_where_in(
                "DELETE FROM approver_messages WHERE grp = ? AND event_id IS NULL AND vm",
                self.group,
                list(last_own),
            ),
            *_insert(
                "INSERT INTO approver_messages (grp, message_id, event_id, vm, raw)",
                rows,
                "ON CONFLICT (grp, vm, message_id) DO NOTHING",
            ),
        ]

    # -------------------------------------------------------------------------------- holds

    async def holds(self) -> dict[str, Hold]:
        """The operators' holds. A hold whose time cannot be read still holds (an operator
        asked for it; the approver leaves the event to NotBefore), its time unknown: read
        before the first approval of every batch, one bad row must not stop every approval."""
        rows = await self.db.fetch("SELECT event_id, held_by, reason, at FROM approver_holds")
        holds = {}
        for event_id, held_by, reason, at in rows:
            when: datetime | None
            try:
                when = as_time(at)
            except (ValueError, TypeError, OverflowError) as exc:
                log.warning(
                    "approver state: the time of the hold on %s cannot be read (%s): the hold "
                    "stays, its time unknown",
                    event_id,
                    exc,
                )
                when = None
            holds[str(event_id)] = Hold(str(event_id), str(held_by), str(reason), when)
        return holds

    async def hold(self, record: PlannedDecision) -> None:
        """An operator's hold of ``record.event_id``, and ``record`` (the operator's decision,
        ``hold``) in the ledger, in one transaction: the approver, which reads only the holds,
        never acts on a hold the audit does not show."""
        await self.db.write(
            [
                (
                    "INSERT INTO approver_holds (event_id, held_by, reason, at) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT (event_id) DO UPDATE SET "
                    "held_by = excluded.held_by, reason = excluded.reason, at = excluded.at",
                    (record.event_id, record.decided_by, record.reason, record.at),
                ),
                *_insert_decisions([record]),
            ]
        )

    async def release(self, record: PlannedDecision) -> bool:
        """Release the hold of ``record.event_id`` and put ``record`` (``release``) in the
        ledger, in one transaction; False, recording nothing, when it was not held."""
        async with self.db.transaction() as tx:
            if not await tx.execute(
                "DELETE FROM approver_holds WHERE event_id = ?", record.event_id
            ):
                return False
            for sql, args in _insert_decisions([record]):
                await tx.execute(sql, *args)
        return True


#: Rows per multi-row statement (far under either database's limit on parameters).
_CHUNK = 100


def _insert(head: str, rows: Sequence[tuple[object, ...]], tail: str = "") -> list[Statement]:
    """``head VALUES (...), (...) tail`` for every row, in order, a chunk at a time."""
    statements: list[Statement] = []
    for start in range(0, len(rows), _CHUNK):
        chunk = rows[start : start + _CHUNK]
        row = "(" + ", ".join("?" * len(chunk[0])) + ")"
        values = ", ".join([row] * len(chunk))
        statements.append((f"{head} VALUES {values} {tail}", [v for r in chunk for v in r]))
    return statements


def _insert_decisions(decisions: Sequence[PlannedDecision]) -> list[Statement]:
    return _insert(
        INSERT_DECISIONS,
        [(d.at, d.event_id, d.event_type, d.target, _decision_body(d)) for d in decisions],
    )


#: How many of an event's newest decisions a load looks at for one it can read.
_DECISIONS_LOOKED_AT = 10


def _blob(value: object) -> bytes | str:
    """A stored body as the parsers take it; :class:`SchemaError` for a value of another kind
    (SQLite keeps whatever was inserted: ``bytes(12)`` would be twelve zero bytes, and
    ``bytes(2**40)`` a terabyte)."""
    if isinstance(value, bytes | str):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise SchemaError(f"a stored {type(value).__name__}, not bytes")


def _decision_of(body: object) -> tuple[str, str]:
    """(action, reason) of a ``ledger_decisions`` body (JSON text on SQLite; asyncpg gives
    JSONB as text too); :class:`ValueError` for anything else."""
    try:
        fields = json.loads(body) if isinstance(body, str | bytes) else body
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc
    if not isinstance(fields, dict):
        raise ValueError("not a JSON object")
    action, reason = fields.get("action"), fields.get("reason")
    if not isinstance(action, str) or not isinstance(reason, str):
        raise ValueError("no action and reason as text")
    return action, reason


def _where_in(head: str, first: object, keys: Sequence[str]) -> list[Statement]:
    """``head IN (...)`` (``head`` ends with the column), ``first`` its first parameter."""
    return [
        (f"{head} IN ({', '.join('?' * len(chunk))})", [first, *chunk])
        for chunk in (keys[start : start + _CHUNK] for start in range(0, len(keys), _CHUNK))
    ]


def _decision_body(decision: PlannedDecision) -> str:
    return decision_body(
        decision.action,
        decision.reason,
        policy=decision.policy,
        decided_by=decision.decided_by,
        target=decision.target,
        event_version=decision.event_version,
        approval_id=decision.approval_id,
    )
