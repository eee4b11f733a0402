"""The agent's durable state: SQLite in WAL mode, in ``--state-dir``.

It holds the last IMDS document (the whole one, every VM's events) with each event's revision,
the per-agent sequence, the outbox of messages not yet confirmed by the broker, the outcome of
each approval handled, the intent to apply an approval (written before the POST), and the hook
runs to do. Guarantee: a new document, the messages it causes, the sequence numbers they take
and the hook runs they ask for are written in one transaction, so after a crash (kill -9
included) the agent finds either the old document and none of its messages, or the new one and
all of them; an approval's intent is durable before its POST, so a crash between the POST and
its outcome is reconciled, not misreported; a hook run is durable before it starts, so one cut
off is reported or run again, never forgotten. Rows leave the outbox only after the broker
confirmed them; a row that cannot be sent (unreadable, or refused by the broker for good) is
set aside in its own table, never deleted.

A store belongs to one VM: it records the VM (its vmId, and its name) the first time an agent
that knows its identity uses it, and an agent that finds another VM's store (a golden image
captured from a VM that ran the agent, a cloned or attached disk, a restored snapshot) moves it
aside whole and starts a new one (:meth:`StateStore.claim`): the other VM's unsent messages,
IMDS document, approval intents, hook runs and epoch are that VM's, never this one's. The model
is cloud-init's instance-id check.

SQLite runs on one worker thread, never on the event loop: the store's own, or one it is given
(many agents in one process, as in the fleet benchmark, share one thread instead of holding one
each).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import sqlite3
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from schemas import (
    ConfigError,
    LifecycleMessage,
    MessageType,
    ScheduledEventsDocument,
    VmIdentity,
)
from schemas.messages import MAX_SEQUENCE

__all__ = [
    "STATE_FILE",
    "ApprovalRecord",
    "Claim",
    "Committed",
    "HookRun",
    "Intent",
    "OutboxRow",
    "Owner",
    "StateStore",
    "StoredState",
]

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
CREATE TABLE IF NOT EXISTS outbox_set_aside (
    sequence   INTEGER PRIMARY KEY,
    message_id TEXT NOT NULL,
    kind       TEXT NOT NULL,
    body       BLOB NOT NULL,
    created    REAL NOT NULL,
    why        TEXT NOT NULL,
    reason     TEXT NOT NULL,
    at         REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS approvals (
    approval_id TEXT PRIMARY KEY,
    message     BLOB NOT NULL,
    decided     REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS approval_intents (
    approval_id   TEXT PRIMARY KEY,
    event_id      TEXT NOT NULL,
    event_version TEXT NOT NULL,
    body          BLOB NOT NULL,
    at            REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS approval_attempts (
    approval_id TEXT PRIMARY KEY,
    count       INTEGER NOT NULL,
    first       REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS applied_events (
    event_id    TEXT PRIMARY KEY,
    approval_id TEXT NOT NULL,
    at          REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS hook_runs (
    run_id        TEXT PRIMARY KEY,
    position      INTEGER NOT NULL,
    hook          TEXT NOT NULL,
    transition_id TEXT NOT NULL,
    body          BLOB NOT NULL,
    state         TEXT NOT NULL,
    attempt       INTEGER NOT NULL,
    started       REAL
);
"""

#: Messages the bound may drop (oldest first); every other kind is kept whatever the bound.
DROPPABLE = frozenset({MessageType.AGENT_HEARTBEAT})
#: How long outcomes, attempts and applied events are remembered (any redelivery comes sooner).
REMEMBERED_SECONDS = 86_400.0
#: What a text cell that cannot be read is shown as, in a row that is kept for its other cells.
UNREADABLE = "(unreadable)"


@dataclass(frozen=True, slots=True)
class OutboxRow:
    sequence: int
    message_id: str
    kind: str
    body: bytes
    #: Wall-clock time the row entered the outbox (publish latency is measured from it); NaN
    #: when the stored one cannot be read.
    created: float
    #: Why the row as stored cannot be read (a cell of the wrong type: a hand edit, a damaged
    #: disk, another version's table); None for a row this agent can send. Such a row is set
    #: aside, never sent: its ``body`` is empty, and unreadable text cells are shown as
    #: :data:`UNREADABLE`.
    unreadable: str | None = None


@dataclass(frozen=True, slots=True)
class StoredState:
    document: ScheduledEventsDocument | None
    #: Which events the last run published: ``all`` or ``vm:<name>``; None on a first start.
    scope: str | None
    next_sequence: int
    depth: int
    #: Each event's last revision (:func:`schemas.revisions_after`), stored with the document.
    revisions: dict[str, int]
    #: Names this store: a new one (a wiped state dir) is a new epoch.
    epoch: str
    #: Wall-clock time the store was created.
    created: float
    #: Rows set aside (unreadable, or refused by the broker for good).
    set_aside: int


@dataclass(frozen=True, slots=True)
class Committed:
    rows: list[OutboxRow]
    dropped: int
    depth: int


@dataclass(frozen=True, slots=True)
class HookRun:
    """One run of one hook for one transition, durable before it starts."""

    run_id: str
    hook: str
    transition_id: str
    #: The transition message as published (the hook reads it on stdin).
    body: bytes
    #: ``queued``, ``running`` (started, no result yet) or ``done``.
    state: str
    attempt: int


@dataclass(frozen=True, slots=True)
class Intent:
    """An approval about to be (or maybe) POSTed: written before the POST."""

    approval_id: str
    event_id: str
    event_version: str
    body: bytes
    at: float


@dataclass(frozen=True, slots=True)
class ApprovalRecord:
    """What the store knows of an approval as it arrives, read in one trip to the store."""

    #: The outcome message already reported for it (handled before: ack it again).
    outcome: bytes | None
    #: Its intent, written before a POST that may have happened (reconcile it).
    intent: Intent | None
    #: The attempts at it so far, this one counted (0 when ``outcome`` or ``intent`` is set).
    attempt: int
    #: The approval applied for the same event here before, if any.
    applied_by: str | None


@dataclass(frozen=True, slots=True)
class Owner:
    """The VM a store belongs to, as IMDS named it to the agent that recorded it."""

    name: str
    #: Azure's vmId; empty when IMDS gave none.
    vm_id: str = ""

    @classmethod
    def of(cls, identity: VmIdentity) -> Owner:
        return cls(identity.name, _guid(identity.vm_id))

    def is_same_vm(self, other: Owner) -> bool:
        """As Azure compares them: by vmId when both are known (a VM deleted and made again
        under its name is another VM), else by name; a vmId is a GUID, compared by value (case
        and form do not count), a name is a resource name, whose case does not count. A vmId
        missing (or not a GUID) on one side is no reason to call it another VM."""
        mine, theirs = _guid(self.vm_id), _guid(other.vm_id)
        if mine and theirs:
            return mine == theirs
        return self.name.casefold() == other.name.casefold()

    @property
    def shown_name(self) -> str:
        """The name for a log line: as it is, or quoted when it holds anything else."""
        return self.name if _PLAIN.fullmatch(self.name) else _shown(self.name, 80)

    def __str__(self) -> str:
        name = self.shown_name
        if not self.vm_id:
            return name
        vm_id = self.vm_id if _PLAIN.fullmatch(self.vm_id) else _shown(self.vm_id, 80)
        return f"{name} (vmId {vm_id})"


@dataclass(frozen=True, slots=True)
class Claim:
    """What :meth:`StateStore.claim` found and did."""

    #: ``own`` (this VM's), ``new`` (no agent had used it), ``adopted`` (written by an earlier
    #: version, which recorded no VM), ``unreadable`` (the VM it records cannot be read: kept)
    #: or ``moved`` (another VM's: moved aside, and a new store begun).
    outcome: str
    #: The VM the store recorded (``moved``: the other VM).
    previous: Owner | None = None
    #: Where another VM's store was moved (``moved``).
    moved_to: Path | None = None
    #: The store's messages not yet sent (``moved``: the other VM's, now never sent from here).
    unsent: int = 0
    #: ``moved``: the other VM's approval intents and hook runs, not reconciled nor run here.
    intents: int = 0
    hook_runs: int = 0
    #: ``unreadable``: why the recorded VM cannot be read.
    why: str = ""
    #: ``moved``: the other files of the VM's moved with the store (names in the state dir),
    #: each renamed by adding ``aside_suffix`` (``.from-<vm>-<UTC time>``).
    files_moved: tuple[str, ...] = ()
    aside_suffix: str = ""


class StateStore:
    """Open with :meth:`open`; ``path`` None keeps everything in memory (demo, tests, the fleet
    benchmark's agents). A store on disk runs SQLite on a thread (a commit waits for the disk);
    one in memory runs each operation at once in the caller's loop: there is nothing to wait
    for, and a thread would cost every operation two turns of the loop and a wake-up."""

    def __init__(
        self,
        connection: sqlite3.Connection,
        executor: ThreadPoolExecutor | None,
        limit: int,
        *,
        owns_executor: bool = True,
    ):
        self._db = connection
        self._executor = executor
        self._owns_executor = owns_executor
        self.limit = limit
        self.path: Path | None = None
        #: The hook runs (rowids) found unreadable and logged so: once each, not at each read.
        self._hook_rows_reported: set[int] = set()
        #: When a message was last put in the outbox (monotonic; the store's opening before
        #: any): the heartbeat goes only after ``heartbeat_interval`` with none.
        self.last_queued = time.monotonic()

    @classmethod
    async def open(
        cls,
        directory: Path | None,
        *,
        limit: int = 10_000,
        executor: ThreadPoolExecutor | None = None,
    ) -> StateStore:
        """Open (creating) the store in ``directory``; :class:`ConfigError` saying what is
        wrong with a directory that cannot hold it. ``executor``: a single-thread executor to
        share (its owner shuts it down) for a store on disk; by default it has a thread of its
        own. A store in memory (``directory`` None) and no executor runs inline."""
        if directory is None and executor is None:
            return cls(_connect(None, None), None, limit, owns_executor=False)
        owns = executor is None
        if executor is None:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-state")
        loop = asyncio.get_running_loop()
        path = None if directory is None else directory / STATE_FILE
        try:
            connection = await loop.run_in_executor(executor, _connect, directory, path)
        except BaseException:
            if owns:
                executor.shutdown(wait=False)
            raise
        store = cls(connection, executor, limit, owns_executor=owns)
        store.path = path
        return store

    async def claim(self, identity: VmIdentity, *, with_files: Sequence[str] = ()) -> Claim | None:
        """Make the store this VM's, once the agent knows its identity and before anything of
        the store is used: record the VM in a store that names none (a new one, or one an
        earlier version wrote: adopted, kept whole), keep a store that names this VM, and move
        a store that names another VM aside (the database and its -wal/-shm files, renamed in
        the same directory: :func:`_aside_suffix`), starting a new one in its place. Only a
        recorded VM that differs from ``identity`` moves a store; one that cannot be read does
        not. ``with_files``: other files of the state dir that are the VM's as the store is
        (the origin key), moved aside with it when they are there. None for a store in
        memory: it is this process's alone."""
        if self.path is None:
            return None
        owner = Owner.of(identity)
        claim: Claim
        self._db, claim = await self._run(_claim, self.path, owner, tuple(with_files))
        if claim.outcome == "moved":
            self._hook_rows_reported = set()
            log.warning(
                "state %s belongs to another VM, %s, not to this one, %s: it came from that VM "
                "(an image made from it, a copied or attached disk, a restored snapshot). "
                "Moved aside whole to %s%s (kept, not deleted): %s's %d unsent message(s) are not "
                "published from here, nor are its %d approval intent(s) reconciled or its %d "
                "hook run(s) run. This agent starts with a new store (a new epoch) and "
                "announces this VM's events afresh",
                self.path,
                claim.previous,
                owner,
                claim.moved_to,
                "".join(f", and {f} to {f}{claim.aside_suffix}" for f in claim.files_moved),
                "the other VM" if claim.previous is None else claim.previous.shown_name,
                claim.unsent,
                claim.intents,
                claim.hook_runs,
            )
        elif claim.outcome == "adopted":
            log.info(
                "state %s recorded no VM (an earlier version wrote it): kept whole as this VM's, "
                "%s, its %d unsent message(s) included; from now on an agent on another VM "
                "moves it aside",
                self.path,
                owner,
                claim.unsent,
            )
        elif claim.outcome == "unreadable":
            log.warning(
                "state %s: the VM it belongs to cannot be read (%s): kept as this VM's, %s, and "
                "recorded so (a store is moved aside only when it names another VM)",
                self.path,
                claim.why,
                owner,
            )
        return claim

    async def _run(self, fn: Any, *args: Any) -> Any:
        if self._executor is None:
            return fn(self._db, *args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(fn, self._db, *args))

    async def close(self) -> None:
        if self._executor is None:
            self._db.close()
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._db.close)
        if self._owns_executor:
            self._executor.shutdown(wait=True)

    async def load(self) -> StoredState:
        """What the last run left. A row that cannot be read costs that row, with a warning
        (see :func:`_load`). Called after :meth:`claim`: another VM's store is moved aside
        unread, whatever its rows hold."""
        result: StoredState = await self._run(_load, self.path)
        return result

    async def commit(
        self,
        messages: Sequence[LifecycleMessage],
        *,
        document: ScheduledEventsDocument | None = None,
        revisions: dict[str, int] | None = None,
        scope: str | None = None,
        outcome_of: str | None = None,
        applied_event: str | None = None,
        hooks: Sequence[tuple[int, str]] = (),
        hook_done: str | None = None,
    ) -> Committed:
        """In one transaction: store ``document`` with its event ``revisions`` (and ``scope``)
        when given; give each message the next sequence number and put it in the outbox;
        ``outcome_of``: the first message is that approval's outcome (its intent is settled);
        ``applied_event``: that event was approved here (or its POST went out unanswered);
        ``hooks``: (index of a message in ``messages``, hook) runs to queue for it;
        ``hook_done``: that hook run has reported."""
        result: Committed = await self._run(
            _commit,
            list(messages),
            document,
            revisions,
            scope,
            outcome_of,
            applied_event,
            list(hooks),
            hook_done,
            self.limit,
        )
        if messages:
            self.last_queued = time.monotonic()
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

    async def set_scope(self, scope: str) -> None:
        await self._run(_set_scope, scope)

    async def pending(self, limit: int = 100) -> list[OutboxRow]:
        """The oldest rows not yet confirmed, in sequence order."""
        rows: list[OutboxRow] = await self._run(_pending, limit)
        return rows

    async def delete(self, sequence: int) -> int:
        """Remove a confirmed row; returns the depth left."""
        depth: int = await self._run(_delete, sequence)
        return depth

    async def set_aside(self, row: OutboxRow, why: str, reason: str) -> int:
        """Move a row that cannot be sent out of the outbox, keeping it (``why``:
        ``unreadable`` or ``refused``); returns the depth left."""
        depth: int = await self._run(_set_aside, row, why, reason)
        return depth

    async def depth(self) -> int:
        depth: int = await self._run(_depth)
        return depth

    async def oldest(self) -> float | None:
        """When the oldest row still in the outbox was written (wall clock)."""
        found: float | None = await self._run(_oldest)
        return found

    async def set_aside_count(self) -> int:
        count: int = await self._run(_count, "outbox_set_aside")
        return count

    # ----------------------------------------------------------------------- approvals

    async def approval_outcome(self, approval_id: str) -> bytes | None:
        """The outcome message of an approval already handled, if any."""
        found: bytes | None = await self._run(_approval_outcome, approval_id)
        return found

    async def approval_record(self, approval_id: str, event_id: str) -> ApprovalRecord:
        """Outcome, intent and earlier application of an approval, and (when it has neither an
        outcome nor an intent) one more attempt counted durably: the checks an arriving
        approval needs, in one trip to the store."""
        found: ApprovalRecord = await self._run(_approval_record, approval_id, event_id)
        return found

    async def applied_among(self, event_ids: Sequence[str]) -> set[str]:
        """Those of ``event_ids`` this store applied an approval for: its POST succeeded, or
        went out unanswered, or may be out and not answered yet (its intent is stored): IMDS
        may have taken it."""
        found: set[str] = await self._run(_applied_among, list(event_ids))
        return found

    async def record_intent(
        self, approval_id: str, event_id: str, event_version: str, body: bytes
    ) -> None:
        """Before the POST: this approval is about to be applied."""
        await self._run(_record_intent, approval_id, event_id, event_version, body)

    async def intents(self) -> list[Intent]:
        """Approvals whose POST may have happened with no outcome recorded (a crash)."""
        found: list[Intent] = await self._run(_intents)
        return found

    # --------------------------------------------------------------------------- hooks

    async def hook_runs(self) -> list[HookRun]:
        """Runs not done, in the order they were queued. A run that cannot be read is left
        out (and left in the store), with an error naming it the first time it is met."""
        found: list[HookRun] = await self._run(_hook_runs, self._hook_rows_reported)
        return found

    async def hook_started(self, run_id: str, attempt: int) -> None:
        await self._run(_hook_started, run_id, attempt)


# ----------------------------------------------------------------- on the worker thread only


def _connect(directory: Path | None, path: Path | None) -> sqlite3.Connection:
    if directory is not None and path is not None:
        _check_directory(directory)
    try:
        db = sqlite3.connect(
            ":memory:" if path is None else str(path), check_same_thread=False, isolation_level=None
        )
        if path is not None:
            db.execute("PRAGMA journal_mode=WAL")
            # FULL: a committed transition survives a power loss too; writes happen on change.
            db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
    except sqlite3.DatabaseError as exc:
        raise ConfigError(f"state_dir: {path} is not a usable agent state ({exc})") from exc
    try:
        if _meta(db, "epoch") is None:
            _set_meta(db, "epoch", uuid.uuid4().hex)
            _set_meta(db, "created", repr(time.time()))
        # Nothing else of the store is read yet: until the agent knows its VM, the store may be
        # another VM's, moved aside whole by claim() (a row of it that could not be read
        # stopped the agent here, on every VM made from an image of that VM).
    except BaseException:
        db.close()
        raise
    return db


def _check_directory(directory: Path) -> None:
    resolved = directory.resolve()
    if resolved.parts[:2] in (("/", "proc"), ("/", "sys"), ("/", "dev")):
        raise ConfigError(
            f"state_dir: {directory} is in a kernel file system; give a directory on a disk, "
            "such as /var/lib/scheduled-events-agent"
        )
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"state_dir: {directory} is a file, not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"state_dir: cannot create {directory}: {exc.strerror}") from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(
            f"state_dir: {directory} is not writable by this user (uid {os.getuid()})"
        )


#: What :func:`_meta` gives for a row whose text is not UTF-8: no row's check takes it.
_NOT_UTF8 = "(text that is not UTF-8)"


def _meta(db: sqlite3.Connection, key: str) -> str | None:
    # Text that is not UTF-8 made the cursor raise: a traceback at every start, where each
    # row's own check says what an unreadable row costs (see "the rows of meta" below).
    row = db.execute(f"SELECT {_cells('value')} FROM meta WHERE key = ?", (key,)).fetchone()
    if row is None:
        return None
    if row[0] != "text":
        return str(row[1])
    try:
        return _text_cell(key, row[0], row[1])
    except _Unreadable:
        return _NOT_UTF8


def _set_meta(db: sqlite3.Connection, key: str, value: str) -> None:
    db.execute(
        "INSERT INTO meta (key, value) VALUES (?, ?) "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (key, value),
    )


def _depth(db: sqlite3.Connection) -> int:
    return int(db.execute("SELECT count(*) FROM outbox").fetchone()[0])


def _count(db: sqlite3.Connection, table: str) -> int:
    return int(db.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


def _oldest(db: sqlite3.Connection) -> float | None:
    # Of the rows whose time can be read (a finite number, as _time_cell takes it): one of
    # another type made this raise, and the publisher with it, before it read a row.
    row = db.execute(
        "SELECT min(created) FROM outbox "
        "WHERE typeof(created) IN ('integer', 'real') AND abs(created) <= ?",
        (sys.float_info.max,),
    ).fetchone()
    return None if row is None or row[0] is None else float(row[0])


# ------------------------------------------------------------ rows read back, cell by cell
#
# The agent writes its rows with known types, but the file may have been edited by hand,
# damaged, or written by another version: a cell may hold another type, or text that is not
# UTF-8 (on which the sqlite3 cursor raises, for the read of every row after it too). So each
# cell is selected with its storage class, text as its bytes, and checked here: a row that fails
# the check is that row's problem, not the reader's.


class _Unreadable(ValueError):
    """A cell of a stored row is not what this agent writes there."""


def _cells(*columns: str) -> str:
    """SQL for each column: its storage class, then its value (text as its bytes)."""
    return ", ".join(
        f"typeof({c}), CASE typeof({c}) WHEN 'text' THEN CAST({c} AS BLOB) ELSE {c} END"
        for c in columns
    )


def _described(kind: str, value: Any) -> str:
    if kind == "null":
        return "null"
    if kind == "blob":
        return f"{len(value)} bytes"
    if kind == "text":
        return f"text {_shown(bytes(value).decode('utf-8', 'replace'))}"
    return f"{'an integer' if kind == 'integer' else 'a number'} ({value!r})"


def _text_cell(name: str, kind: str, value: Any) -> str:
    if kind == "text":
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise _Unreadable(f"{name} is text that is not UTF-8") from None
    raise _Unreadable(f"{name} is {_described(kind, value)}, not text")


def _bytes_cell(name: str, kind: str, value: Any) -> bytes:
    if kind == "blob":
        return bytes(value)
    raise _Unreadable(f"{name} is {_described(kind, value)}, not bytes")


def _time_cell(name: str, kind: str, value: Any) -> float:
    if kind in ("integer", "real") and math.isfinite(value):
        return float(value)
    raise _Unreadable(f"{name} is {_described(kind, value)}, not a time")


def _name(kind: str, value: Any, column: str) -> str:
    """A stored row named by its ``column`` cell, for a log line; that cell may be unreadable
    too."""
    try:
        return _shown(_text_cell(column, kind, value), 200)
    except _Unreadable:
        return f"with no readable {column}"


# ------------------------------------------------------------------- the rows of ``meta``
#
# A row may be torn or hand-edited, or written by another version. Each is read here, once the
# store is known to be this VM's (:func:`_load`, after the claim), and what cannot be read costs
# that row, with a warning saying what was done: dropped when the agent can do without it (the
# document), replaced when it cannot (the epoch and the creation time by new ones; the sequence
# and the revisions by numbers above any this store can have given, so that no message takes
# the sequence, nor the id, of one given before).

#: An epoch as :func:`_connect` makes it (uuid4 hex), with room for another version's form.
_EPOCH = re.compile(r"[0-9A-Za-z-]{1,64}")


def _why(exc: BaseException) -> str:
    """An error in one short line (pydantic's run to many)."""
    if isinstance(exc, RecursionError):
        return "nested too deep"
    lines = str(exc).splitlines() or [type(exc).__name__]
    return lines[0][:160]


def _shown(raw: str, limit: int = 40) -> str:
    return repr(raw) if len(raw) <= limit else f"{raw[:limit]!r}... ({len(raw)} characters)"


def _where(path: Path | None) -> str:
    return "the agent state" if path is None else str(path)


def _next_sequence(db: sqlite3.Connection, path: Path | None) -> int:
    """The next message's sequence. It never goes back nor repeats (the contract's counter
    "that never goes backwards"; the outbox keeps rows under it): one that cannot be read is
    replaced, see :func:`_recovered_sequence`."""
    raw = _meta(db, "next_sequence")
    if raw is None:
        return 1
    if re.fullmatch(r"[0-9]{1,19}", raw) and int(raw) <= MAX_SEQUENCE:
        return int(raw)
    return _recovered_sequence(db, path, raw)


def _unreached() -> int:
    """A count no sequence of a store can have reached, nor any revision (which counts an
    event's transitions, each of which took a sequence): the clock's microseconds since 1970.
    Sequences count messages one at a time from 1, and an agent gives far fewer than one a
    microsecond (each commit waits for the disk); one taken from the clock before (an earlier
    repair) has grown since by the messages given after it, fewer than the microseconds gone
    by. (A clock set back, or a sequence set by hand above the clock, defeats it.)"""
    return min(time.time_ns() // 1000, MAX_SEQUENCE)


def _recovered_sequence(db: sqlite3.Connection, path: Path | None, raw: str) -> int:
    """The next sequence when the stored one cannot be read: above the rows the store still
    holds, and :func:`_unreached`. The rows held alone are not enough: a message the broker
    confirmed has left the outbox, so after a clean stop (the outbox drained) no row records
    the sequences published; counting from the rows held would give a sequence again. It is
    stored, so the warning is said once."""
    floor = _floor(db)
    sequence = max(floor, _unreached())
    _set_meta(db, "next_sequence", str(sequence))
    log.warning(
        "state %s: the row next_sequence (%s) is not a sequence number: replaced by %d, above "
        "every sequence this store can have given (the messages it still holds: %s; the ones "
        "published before were counted one at a time from 1, and cannot have reached the "
        "clock's microseconds since 1970). New messages never take a sequence given before; "
        "consumers see a gap",
        _where(path),
        _shown(raw),
        sequence,
        "none" if floor == 1 else f"up to {floor - 1}",
    )
    return sequence


def _floor(db: sqlite3.Connection) -> int:
    """One above the highest sequence the store still holds (in the outbox or set aside)."""
    kept = db.execute(
        "SELECT max(s) FROM (SELECT max(sequence) AS s FROM outbox "
        "UNION ALL SELECT max(sequence) FROM outbox_set_aside)"
    ).fetchone()[0]
    return 1 if kept is None else int(kept) + 1


def _settled_sequence(db: sqlite3.Connection, path: Path | None) -> int:
    """At load: the next sequence (replaced when it cannot be read, see
    :func:`_next_sequence`), above every row the store holds. One set (or deleted) by hand
    below them gave the first new message the sequence of a message still in the outbox,
    which SQLite refused (a traceback at every start), or of one set aside, which the next row
    set aside under it would have replaced. It is raised above them: a gap consumers see,
    never a step back from a message kept."""
    sequence = _next_sequence(db, path)
    floor = _floor(db)
    if sequence >= floor:
        return sequence
    raw = _meta(db, "next_sequence")
    _set_meta(db, "next_sequence", str(floor))
    log.warning(
        "state %s: the row next_sequence (%s) is below messages the store still holds (up to "
        "%d): raised to %d, so new messages do not take their sequences (consumers see a gap)",
        _where(path),
        "missing" if raw is None else _shown(raw),
        floor - 1,
        floor,
    )
    return floor


# --------------------------------------------------------------------- whose store it is

#: A name or vmId shown in a log line as it is; anything else is quoted (:func:`_shown`), so a
#: stored value cannot write lines of its own into the log.
_PLAIN = re.compile(r"[A-Za-z0-9_.-]{1,80}")
#: The meta rows that record the VM a store belongs to.
_OWNER_NAME, _OWNER_VM_ID = "owner_name", "owner_vm_id"


def _guid(vm_id: str) -> str:
    """A vmId in its one canonical form, or "" when it is not a GUID (IMDS gave none, or a
    ``null`` that was read as the text ``None``): such a value names no VM."""
    try:
        return str(uuid.UUID(vm_id))
    except ValueError:
        return ""


def _owner_cell(db: sqlite3.Connection, key: str) -> str | None:
    """A row of the owner, text as this agent writes it; :class:`_Unreadable` otherwise."""
    row = db.execute(f"SELECT {_cells('value')} FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else _text_cell(key, row[0], row[1])


def _recorded_owner(db: sqlite3.Connection) -> Owner | None:
    """The VM the store records, None when it records none (new, or an earlier version's);
    :class:`_Unreadable` for rows this agent does not write (a hand edit, a damaged disk)."""
    name = _owner_cell(db, _OWNER_NAME)
    vm_id = _owner_cell(db, _OWNER_VM_ID)
    if name is None and vm_id is None:
        return None
    if not name:
        raise _Unreadable(f"{_OWNER_NAME} is {'missing' if name is None else 'empty'}")
    return Owner(name, vm_id or "")


def _set_owner(db: sqlite3.Connection, owner: Owner) -> None:
    db.execute("BEGIN IMMEDIATE")
    try:
        _set_meta(db, _OWNER_NAME, owner.name)
        _set_meta(db, _OWNER_VM_ID, owner.vm_id)
        db.execute("COMMIT")
    except BaseException:
        _rollback(db)
        raise


def _claim(
    db: sqlite3.Connection, path: Path, owner: Owner, with_files: tuple[str, ...]
) -> tuple[sqlite3.Connection, Claim]:
    """See :meth:`StateStore.claim`: the connection to use from now on, and what was done."""
    try:
        recorded = _recorded_owner(db)
    except _Unreadable as exc:
        _set_owner(db, owner)
        return db, Claim("unreadable", why=str(exc))
    if recorded is None:
        # A store no agent has committed to yet is new; one with a sequence, a document or
        # messages was written by an earlier version, which recorded no VM.
        new = _meta(db, "next_sequence") is None and _meta(db, "document") is None
        new = new and _depth(db) == 0
        _set_owner(db, owner)
        return db, Claim("new" if new else "adopted", unsent=_depth(db))
    if recorded.is_same_vm(owner):
        # As IMDS names it now; a vmId recorded is kept when IMDS gave none this time.
        current = Owner(owner.name, owner.vm_id or recorded.vm_id)
        if current != recorded:
            _set_owner(db, current)
        return db, Claim("own", previous=recorded)
    # Another VM's: counted for the operator before it is moved, never used here.
    claim = Claim(
        "moved",
        previous=recorded,
        unsent=_depth(db),
        intents=_count(db, "approval_intents"),
        hook_runs=_count(db, "hook_runs"),
    )
    # Everything into the database file itself, so that file alone holds the store (its -wal
    # is then empty, or gone with the close), before it is renamed.
    with contextlib.suppress(sqlite3.Error):
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    moved, files = _move_aside(path, recorded, with_files)
    fresh = _connect(path.parent, path)
    try:
        _set_owner(fresh, owner)
    except BaseException:
        fresh.close()
        raise
    suffix = moved.name.removeprefix(path.name)
    return fresh, replace(claim, moved_to=moved, files_moved=files, aside_suffix=suffix)


#: What SQLite keeps beside a database in WAL mode, named after it.
_COMPANIONS = ("-wal", "-shm")


def _aside_suffix(path: Path, owner: Owner, with_files: tuple[str, ...]) -> str:
    """``.from-<the VM>-<UTC time>`` (``.2``, ``.3``... after it when a name it makes is
    taken), added to the name of each file moved aside: it says whose the files were and when
    they were moved. The VM's name is reduced to the characters an Azure name may hold, as the
    stored one may be anything."""
    word = re.sub(r"[^a-z0-9_.-]+", "_", owner.name.casefold())[:64] or "unnamed"
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    base = f".from-{word}-{stamp}"
    names = [path.name + companion for companion in ("", *_COMPANIONS)] + list(with_files)
    n = 1
    while True:
        suffix = base if n == 1 else f"{base}.{n}"
        taken = (path.with_name(_suffixed(name, suffix)) for name in names)
        if not any(os.path.lexists(p) for p in taken):
            return suffix
        n += 1


def _suffixed(name: str, suffix: str) -> str:
    """A file's name moved aside; the -wal and -shm keep their ending, so SQLite opening the
    moved database finds its -wal."""
    for companion in _COMPANIONS:
        if name.endswith(companion):
            return f"{name.removesuffix(companion)}{suffix}{companion}"
    return f"{name}{suffix}"


def _move_aside(
    path: Path, owner: Owner, with_files: tuple[str, ...]
) -> tuple[Path, tuple[str, ...]]:
    """Rename the store at ``path``, its -wal/-shm files and those of ``with_files`` that are
    there, adding :func:`_aside_suffix`; the store's new path and the other files moved. The
    -wal and -shm go before the database: a new store must never find another database's -wal
    under its name (SQLite would replay that database's pages into it). A rename that fails
    puts back what was moved and stops the start: this VM must not use the other VM's
    state."""
    suffix = _aside_suffix(path, owner, with_files)
    names = [path.name + companion for companion in (*_COMPANIONS, "")] + list(with_files)
    done: list[tuple[Path, Path]] = []
    try:
        for name in names:
            source, target = path.with_name(name), path.with_name(_suffixed(name, suffix))
            if os.path.lexists(source):
                os.rename(source, target)
                done.append((source, target))
    except OSError as exc:
        for source, target in reversed(done):
            with contextlib.suppress(OSError):
                os.rename(target, source)
        raise ConfigError(
            f"state_dir: {path} is the state of another VM, {owner}, and cannot be moved aside "
            f"({exc.strerror or exc}): move it (and its -wal and -shm files"
            f"{''.join(f', {name}' for name in with_files)}) out of the way, and start the "
            "agent again"
        ) from exc
    _sync_directory(path.parent)
    moved = tuple(source.name for source, _ in done if source.name in with_files)
    return path.with_name(_suffixed(path.name, suffix)), moved


def _sync_directory(directory: Path) -> None:
    """Make the renames durable before the new store is written beside them."""
    try:
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _revisions(
    db: sqlite3.Connection,
    path: Path | None,
    document: ScheduledEventsDocument | None,
    next_sequence: int,
) -> dict[str, int]:
    """Each event's last revision. A transition's message id is made of its event's revision:
    counting an event from 0 again gives a new message the id of one already published, with
    other content, which consumers drop as an id conflict. So when they cannot be read, each
    event of the stored ``document`` (the ones the next poll is compared with) goes on above
    every revision this store can have given: a revision counts an event's transitions, each
    of which took a sequence, so it is below ``next_sequence`` and :func:`_unreached`. They are
    stored, so the warning is said once."""
    raw = _meta(db, "revisions")
    if raw is None:
        return {}
    why = None
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        why = "text that is not UTF-8" if raw == _NOT_UTF8 else _why(exc)
    else:
        if not isinstance(parsed, dict):
            why = f"a JSON {type(parsed).__name__}, not an object"
        elif not all(type(v) is int and 0 <= v <= MAX_SEQUENCE for v in parsed.values()):
            why = "a revision is not a whole number from 0"
    if why is None:
        return {str(k): int(v) for k, v in parsed.items()}
    above = max(next_sequence, _unreached())
    events = [] if document is None else [e.event_id for e in document.events]
    events += sorted(set() if document is None else document.unreadable_ids)
    revisions = dict.fromkeys(events, above - 1)
    _set_meta(db, "revisions", json.dumps(revisions, separators=(",", ":")))
    log.warning(
        "state %s: the row revisions cannot be read (%s): replaced. The %d event(s) of the last "
        "IMDS document stored go on from revision %d, above every revision this store can have "
        "given, so none of their messages takes the id of one published before; an event it "
        "does not hold is counted from 0 (a new one; one that ended and is listed again may "
        "then repeat the id of its first report, which consumers drop as an id conflict)",
        _where(path),
        why,
        len(revisions),
        above,
    )
    return revisions


def _document(db: sqlite3.Connection, path: Path | None) -> ScheduledEventsDocument | None:
    """The last IMDS document, or None when it cannot be read: the next poll's document takes
    its place."""
    raw = _meta(db, "document")
    if raw is None:
        return None
    try:
        document = ScheduledEventsDocument.from_imds(json.loads(raw))
    except (ValueError, RecursionError) as exc:  # SchemaError is a ValueError
        log.warning(
            "state %s: the last IMDS document stored cannot be read (%s): dropped. The next "
            "poll's document takes its place: each of its events is announced again, under a "
            "new revision; an event that ended since the last run is not reported ended",
            _where(path),
            "text that is not UTF-8" if raw == _NOT_UTF8 else _why(exc),
        )
        return None
    if document.unreadable:
        # The agent stores only events it could read: these were damaged on disk since.
        log.warning(
            "state %s: %d event(s) of the last IMDS document stored cannot be read (%s): left "
            "out. If IMDS still lists one, it is announced again under a new revision; one that "
            "ended since the last run is not reported ended",
            _where(path),
            len(document.unreadable),
            document.unreadable[0].reason,
        )
    return document


def _epoch(db: sqlite3.Connection, path: Path | None) -> str:
    """The store's epoch; one that cannot be read is replaced by a new one, as a new store
    would have: outcomes already reported keep their ids, later ones are of the new epoch."""
    raw = _meta(db, "epoch")
    if raw is not None and _EPOCH.fullmatch(raw):
        return raw
    epoch = uuid.uuid4().hex
    _set_meta(db, "epoch", epoch)
    log.warning(
        "state %s: the store's epoch (%s) cannot be read: replaced by a new one, %s; approval "
        "outcomes from now on are of the new epoch",
        _where(path),
        "none" if raw is None else _shown(raw),
        epoch,
    )
    return epoch


def _created(db: sqlite3.Connection, path: Path | None) -> float:
    """When the store was created; one that cannot be read (or is no date) is taken as now
    and stored so: an approval issued before it is reported as a possible repeat, the safe
    side."""
    raw = _meta(db, "created")
    try:
        created = float(raw) if raw is not None else math.nan
        datetime.fromtimestamp(created, UTC)  # a date, between years 1 and 9999
        if math.isfinite(created):
            return created
    except (ValueError, OverflowError, OSError):
        pass
    now = time.time()
    _set_meta(db, "created", repr(now))
    log.warning(
        "state %s: the store's creation time (%s) cannot be read: taken as now; an approval "
        "issued before now is reported as a possible repeat",
        _where(path),
        "none" if raw is None else _shown(raw),
    )
    return now


def _load(db: sqlite3.Connection, path: Path | None) -> StoredState:
    next_sequence = _settled_sequence(db, path)
    document = _document(db, path)
    return StoredState(
        document=document,
        scope=_meta(db, "scope"),
        next_sequence=next_sequence,
        depth=_depth(db),
        revisions=_revisions(db, path, document, next_sequence),
        epoch=_epoch(db, path),
        created=_created(db, path),
        set_aside=_count(db, "outbox_set_aside"),
    )


def _set_scope(db: sqlite3.Connection, scope: str) -> None:
    _set_meta(db, "scope", scope)


def _commit(
    db: sqlite3.Connection,
    messages: list[LifecycleMessage],
    document: ScheduledEventsDocument | None,
    revisions: dict[str, int] | None,
    scope: str | None,
    outcome_of: str | None,
    applied_event: str | None,
    hooks: list[tuple[int, str]],
    hook_done: str | None,
    limit: int,
) -> Committed:
    rows: list[OutboxRow] = []
    now = time.time()
    db.execute("BEGIN IMMEDIATE")
    try:
        sequence = _next_sequence(db, None)
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
            sequence += 1
        if outcome_of is not None and rows:
            db.execute(
                "INSERT OR REPLACE INTO approvals (approval_id, message, decided) VALUES (?, ?, ?)",
                (outcome_of, rows[0].body, now),
            )
            db.execute("DELETE FROM approval_intents WHERE approval_id = ?", (outcome_of,))
            db.execute("DELETE FROM approval_attempts WHERE approval_id = ?", (outcome_of,))
            horizon = now - REMEMBERED_SECONDS
            db.execute("DELETE FROM approvals WHERE decided < ?", (horizon,))
            db.execute("DELETE FROM approval_attempts WHERE first < ?", (horizon,))
            db.execute("DELETE FROM applied_events WHERE at < ?", (horizon,))
        if applied_event is not None and outcome_of is not None:
            db.execute(
                "INSERT OR REPLACE INTO applied_events (event_id, approval_id, at) "
                "VALUES (?, ?, ?)",
                (applied_event, outcome_of, now),
            )
        for index, hook in hooks:
            row = rows[index]
            db.execute(
                "INSERT OR IGNORE INTO hook_runs (run_id, position, hook, transition_id, body, "
                "state, attempt) VALUES (?, ?, ?, ?, ?, 'queued', 0)",
                (f"{row.message_id}/{hook}", row.sequence, hook, row.message_id, row.body),
            )
        if hook_done is not None:
            db.execute("DELETE FROM hook_runs WHERE run_id = ?", (hook_done,))
        _set_meta(db, "next_sequence", str(sequence))
        if document is not None:
            _set_meta(db, "document", json.dumps(document.to_imds(), separators=(",", ":")))
        if revisions is not None:
            _set_meta(db, "revisions", json.dumps(revisions, separators=(",", ":")))
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
        _rollback(db)
        raise
    kept = {row.sequence for row in rows} if not dropped else _present(db, rows)
    return Committed([r for r in rows if r.sequence in kept], dropped, depth)


def _rollback(db: sqlite3.Connection) -> None:
    # An error may have ended the transaction already (SQLite rolls back on a full disk, for
    # one): a ROLLBACK then would fail and hide that error.
    if db.in_transaction:
        db.execute("ROLLBACK")


def _present(db: sqlite3.Connection, rows: list[OutboxRow]) -> set[int]:
    found: set[int] = set()
    for row in rows:
        if db.execute("SELECT 1 FROM outbox WHERE sequence = ?", (row.sequence,)).fetchone():
            found.add(row.sequence)
    return found


def _pending(db: sqlite3.Connection, limit: int) -> list[OutboxRow]:
    cursor = db.execute(
        f"SELECT sequence, {_cells('message_id', 'kind', 'body', 'created')} FROM outbox "
        "ORDER BY sequence LIMIT ?",
        (limit,),
    )
    return [_outbox_row(row) for row in cursor]


def _outbox_row(row: Sequence[Any]) -> OutboxRow:
    """One row of :func:`_pending`; a row that cannot be read comes back with ``unreadable``
    saying which cell and why (before, one such row raised out of every read of the outbox:
    the publisher ended, and the agent with it, at every start)."""
    problems: list[str] = []

    def cell(read: Callable[[str, str, Any], T], name: str, at: int, otherwise: T) -> T:
        try:
            return read(name, row[at], row[at + 1])
        except _Unreadable as exc:
            problems.append(str(exc))
            return otherwise

    message_id = cell(_text_cell, "message_id", 1, UNREADABLE)
    kind = cell(_text_cell, "kind", 3, UNREADABLE)
    body = cell(_bytes_cell, "body", 5, b"")
    created = cell(_time_cell, "created", 7, math.nan)
    if problems:
        return OutboxRow(int(row[0]), message_id, kind, b"", created, "; ".join(problems))
    return OutboxRow(int(row[0]), message_id, kind, body, created)


def _delete(db: sqlite3.Connection, sequence: int) -> int:
    db.execute("DELETE FROM outbox WHERE sequence = ?", (sequence,))
    return _depth(db)


def _set_aside(db: sqlite3.Connection, row: OutboxRow, why: str, reason: str) -> int:
    db.execute("BEGIN IMMEDIATE")
    try:
        # The cells are moved as they are stored (an unreadable one too, for a person to look
        # at), not as they were read; a NULL only a table of another shape holds is kept as
        # the empty value of its column, which refuses NULL.
        db.execute(
            "INSERT OR REPLACE INTO outbox_set_aside (sequence, message_id, kind, body, created, "
            "why, reason, at) SELECT sequence, coalesce(message_id, ''), coalesce(kind, ''), "
            "coalesce(body, x''), coalesce(created, 0), ?, ?, ? FROM outbox WHERE sequence = ?",
            (why, reason, time.time(), row.sequence),
        )
        db.execute("DELETE FROM outbox WHERE sequence = ?", (row.sequence,))
        db.execute("COMMIT")
    except BaseException:
        _rollback(db)
        raise
    return _depth(db)


def _approval_outcome(db: sqlite3.Connection, approval_id: str) -> bytes | None:
    # The row is what counts (the approval was handled; its outcome is only ever asked for
    # being there): stored as text or anything else, bytes() of it raised, which ended the
    # agent while it reconciled its intents, at every start.
    row = db.execute(
        "SELECT coalesce(CAST(message AS BLOB), x'') FROM approvals WHERE approval_id = ?",
        (approval_id,),
    ).fetchone()
    return None if row is None else bytes(row[0])


def _approval_record(db: sqlite3.Connection, approval_id: str, event_id: str) -> ApprovalRecord:
    outcome = _approval_outcome(db, approval_id)
    intent = None if outcome is not None else _intent(db, approval_id)
    attempt = _attempt(db, approval_id) if outcome is None and intent is None else 0
    return ApprovalRecord(outcome, intent, attempt, _applied_by(db, event_id))


def _attempt(db: sqlite3.Connection, approval_id: str) -> int:
    db.execute(
        "INSERT INTO approval_attempts (approval_id, count, first) VALUES (?, 1, ?) "
        "ON CONFLICT (approval_id) DO UPDATE SET count = count + 1",
        (approval_id, time.time()),
    )
    row = db.execute(
        "SELECT count FROM approval_attempts WHERE approval_id = ?", (approval_id,)
    ).fetchone()
    return int(row[0])


def _record_intent(
    db: sqlite3.Connection, approval_id: str, event_id: str, event_version: str, body: bytes
) -> None:
    db.execute(
        "INSERT OR IGNORE INTO approval_intents (approval_id, event_id, event_version, body, at) "
        "VALUES (?, ?, ?, ?, ?)",
        (approval_id, event_id, event_version, body, time.time()),
    )


_INTENT = _cells("approval_id", "event_id", "event_version", "body", "at")


def _intent_of(row: Sequence[Any]) -> Intent:
    """An intent of :data:`_INTENT`'s cells; :class:`_Unreadable` for a row of another shape."""
    return Intent(
        approval_id=_text_cell("approval_id", row[0], row[1]),
        event_id=_text_cell("event_id", row[2], row[3]),
        event_version=_text_cell("event_version", row[4], row[5]),
        body=_bytes_cell("body", row[6], row[7]),
        at=_time_cell("at", row[8], row[9]),
    )


def _intent(db: sqlite3.Connection, approval_id: str) -> Intent | None:
    row = db.execute(
        f"SELECT {_INTENT} FROM approval_intents WHERE approval_id = ?", (approval_id,)
    ).fetchone()
    return None if row is None else _intent_of(row)


def _intents(db: sqlite3.Connection) -> list[Intent]:
    cursor = db.execute(f"SELECT {_INTENT} FROM approval_intents ORDER BY at")
    found = []
    for row in cursor:
        try:
            found.append(_intent_of(row))
        except _Unreadable as exc:
            # Written by this agent as text, bytes and a number: a row of another shape (or
            # text that is not UTF-8, on which the cursor raised) was edited or damaged.
            # Raising here ended the agent at every start.
            log.error(
                "the stored approval intent %s cannot be read (%s): left as it is, not "
                "reconciled (its POST may have gone out; a new delivery of that approval is "
                "refused); the other intents are reconciled",
                _name(row[0], row[1], "approval_id"),
                exc,
            )
    return found


def _applied_among(db: sqlite3.Connection, event_ids: list[str]) -> set[str]:
    # An intent is written before the POST and replaced by the outcome once its answer is read:
    # while it is there, the POST may have gone out and started the event. A starved agent read
    # a later poll's answer (the event gone) before its POST's, and reported canceled an event
    # its own POST had started.
    return {
        event_id
        for event_id in event_ids
        if _applied_by(db, event_id) is not None
        or db.execute(
            "SELECT 1 FROM approval_intents WHERE event_id = ? LIMIT 1", (event_id,)
        ).fetchone()
        is not None
    }


def _applied_by(db: sqlite3.Connection, event_id: str) -> str | None:
    # The row is what counts (the event was started here); the id is only named in a report,
    # so text that is not UTF-8 (on which the cursor raised) is named as best it can be.
    row = db.execute(
        "SELECT CAST(approval_id AS BLOB) FROM applied_events WHERE event_id = ?", (event_id,)
    ).fetchone()
    return None if row is None else bytes(row[0] or b"").decode("utf-8", "replace")


#: A hook run's states (``done`` is no longer written: a run that reported is deleted).
_HOOK_STATES = frozenset({"queued", "running", "done"})


def _hook_runs(db: sqlite3.Connection, reported: set[int]) -> list[HookRun]:
    cursor = db.execute(
        f"SELECT rowid, {_cells('run_id', 'hook', 'transition_id', 'body', 'state', 'attempt')} "
        "FROM hook_runs ORDER BY position, run_id"
    )
    found = []
    for row in cursor:
        try:
            found.append(_hook_run(row))
        except _Unreadable as exc:
            # Written by this agent with these types: a row of another shape was edited or
            # damaged. Raising here ended the hook runner, and the agent, at every start (and
            # the runs after it never ran); an unknown state was passed over without a word.
            rowid = int(row[0])
            if rowid in reported:
                continue
            reported.add(rowid)
            log.error(
                "the stored hook run %s (row %d of hook_runs) cannot be read (%s): left as it "
                "is, not run and no result reported for it (a policy waiting for it leaves its "
                "event to NotBefore); the other runs go on",
                _name(row[1], row[2], "run_id"),
                rowid,
                exc,
            )
    return found


def _hook_run(row: Sequence[Any]) -> HookRun:
    state = _text_cell("state", row[9], row[10])
    if state not in _HOOK_STATES:
        raise _Unreadable(f"state is {_shown(state)}, not one of {', '.join(sorted(_HOOK_STATES))}")
    attempt = row[12]
    # The next attempt is stored as this one plus 1: it must be a number SQLite still holds.
    if row[11] != "integer" or not 0 <= attempt < MAX_SEQUENCE:
        raise _Unreadable(f"attempt is {_described(row[11], attempt)}, not an attempt number")
    return HookRun(
        run_id=_text_cell("run_id", row[1], row[2]),
        hook=_text_cell("hook", row[3], row[4]),
        transition_id=_text_cell("transition_id", row[5], row[6]),
        body=_bytes_cell("body", row[7], row[8]),
        state=state,
        attempt=int(attempt),
    )


def _hook_started(db: sqlite3.Connection, run_id: str, attempt: int) -> None:
    db.execute(
        "UPDATE hook_runs SET state = 'running', attempt = ?, started = ? WHERE run_id = ?",
        (attempt, time.time(), run_id),
    )
