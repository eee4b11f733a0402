"""One small database API over SQLite and PostgreSQL, so every statement is written once.

Statements use ``?`` placeholders; :class:`PostgresDatabase` numbers them (``$1``, ``$2``...)
for asyncpg. Values cross the boundary as Python values: ``datetime`` (aware, UTC), ``bytes``,
``str``, ``int``, ``None``; SQLite keeps times as ISO 8601 text in one fixed format (so they
sort and compare as text), PostgreSQL as ``timestamptz`` — :func:`as_time` reads either back.
Only the schema (DDL) is per backend.

::

    async with open_database("sqlite:///audit.db") as db:
        async with db.transaction() as tx:
            await tx.execute("INSERT INTO t (a, b) VALUES (?, ?)", 1, "x")
        rows = await db.fetch("SELECT a, b FROM t WHERE a > ?", 0)

SQLite work runs on a thread of the database's own, one statement or transaction at a time (a
lock), in WAL mode, and a second connection of its own moves the write-ahead log into the
database file in the background (a commit does not pay for it); PostgreSQL uses a small asyncpg
pool, every wait for the server bounded (a statement by ``statement_seconds``, a connection by
``acquire_seconds``). Failures are :class:`DatabaseError` (with the database's own words: a
statement refused), or :class:`~schemas.TransportError` when the server cannot be reached or
cannot serve just now (unreachable, refusing connections, not answering within a bound, the
connection lost, restarting or failing over, read-only after a failover:
:func:`_postgres_failure`; a SQLite file locked by another process, a full disk, a file that
cannot be written: :func:`_sqlite_failure`), which the fleet stream waits out instead of failing
the message (see :func:`consumers._stream.dependency_unavailable`). :meth:`Database.write`
commits statements that need no result of each other in one go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sqlite3
import time
from abc import abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar
from urllib.parse import urlsplit

from schemas import ConfigError, RelayError, TransportError
from schemas.transport import AsyncResource, redact

__all__ = [
    "Database",
    "DatabaseError",
    "Executor",
    "PostgresDatabase",
    "SqliteDatabase",
    "Statement",
    "WriteConflict",
    "as_time",
    "database_exists",
    "open_database",
]

log = logging.getLogger(__name__)

Dialect = Literal["sqlite", "postgres"]
#: One statement and its arguments, for :meth:`Database.write`.
Statement = tuple[str, Sequence[object]]
_T = TypeVar("_T")


class DatabaseError(RelayError):
    """A statement the database refused (a constraint, a permission, a missing table...)."""


class WriteConflict(DatabaseError):
    """The guard of a :meth:`Database.write` changed no row: another writer changed what it
    checks first. Nothing was written."""


def _iso(moment: datetime) -> str:
    """SQLite's text for a time: every field zero-padded to its full width (the year to four
    digits, as :meth:`~datetime.datetime.isoformat` does; ``strftime("%Y")`` does not on
    glibc), so that text order is time order for every year from 1 to 9999."""
    utc = moment.astimezone(UTC).replace(tzinfo=None)
    return utc.isoformat(timespec="microseconds") + "Z"


#: The year of a time an earlier version wrote with ``strftime("%Y")``: 1 to 3 digits.
_SHORT_YEAR = re.compile(r"(\d{1,3})-")


def as_time(value: object) -> datetime:
    """A time read from either backend (``timestamptz`` or SQLite's ISO text), aware UTC.

    A time without an offset is UTC (what both backends hold): asyncpg gives PostgreSQL's
    ``-infinity`` and ``infinity``, which it writes for the first and last microsecond of the
    years 1 to 9999, back without one. Text an earlier version wrote with an unpadded year
    ("1-01-01T...") reads as the time it is."""
    if isinstance(value, str):
        text = value.strip().replace("Z", "+00:00")
        short = _SHORT_YEAR.match(text)
        if short is not None:
            text = short.group(1).zfill(4) + text[short.end(1) :]
        value = datetime.fromisoformat(text)
    if isinstance(value, datetime):
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)
    raise TypeError(f"not a time: {value!r}")


class Executor(Protocol):
    """What a statement runs on: the database itself or an open transaction."""

    async def execute(self, sql: str, *args: object) -> int:
        """Run a statement; how many rows it changed."""
        ...

    async def fetch(self, sql: str, *args: object) -> list[tuple[Any, ...]]: ...

    async def fetchone(self, sql: str, *args: object) -> tuple[Any, ...] | None: ...


class Database(AsyncResource):
    """A connected database; :meth:`transaction` for several statements at once."""

    dialect: Dialect
    #: Where it is, safe to log.
    display: str

    @abstractmethod
    async def execute(self, sql: str, *args: object) -> int: ...

    @abstractmethod
    async def fetch(self, sql: str, *args: object) -> list[tuple[Any, ...]]: ...

    async def fetchone(self, sql: str, *args: object) -> tuple[Any, ...] | None:
        rows = await self.fetch(sql, *args)
        return rows[0] if rows else None

    @abstractmethod
    def transaction(self) -> contextlib.AbstractAsyncContextManager[Executor]:
        """Statements that commit together or not at all."""

    async def write(
        self, statements: Sequence[Statement], *, guard: Statement | None = None
    ) -> list[int]:
        """Statements that commit together or not at all, when none needs another's result
        (each one's row count): on SQLite, one trip to the database's thread for them all.
        ``guard`` runs first, in the same transaction: when it changes no row (a compare and
        set that found another value), nothing is written and :class:`WriteConflict` is
        raised."""
        async with self.transaction() as tx:
            if guard is not None and not await tx.execute(guard[0], *guard[1]):
                raise _conflict(guard)
            return [await tx.execute(sql, *args) for sql, args in statements]

    @abstractmethod
    async def script(self, ddl: str) -> None:
        """Run several ``;``-separated statements of this backend's own DDL, in one transaction."""


# --------------------------------------------------------------------------------------- SQLite


#: The oldest SQLite the statements run on (``RETURNING`` came in 3.35).
MIN_SQLITE = (3, 35, 0)
#: How long a statement waits for another process's lock on a SQLite file.
BUSY_SECONDS = 10.0
_BUSY = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
#: The pause between two tries of switching a file to WAL while another connection holds it.
_WAL_SWITCH_PAUSE = 0.02
#: SQLite's primary result codes that say the file cannot be used just now, not that the
#: statement is refused: another process holds its lock past ``busy_seconds`` (BUSY, LOCKED: a
#: service sharing the file, a backup, an upgrade), the disk is full (FULL), the file or its
#: journal cannot be read, written or opened (IOERR, READONLY, CANTOPEN: a disk failing or
#: remounted read-only, a permission changed). Each passes or needs the operator, and every
#: message meanwhile would fail alike; as refusals each was the message's fault (retried,
#: redelivered, dead-lettered: an audit losing what arrived while the disk was full). So they
#: are the database unavailable (:class:`~schemas.TransportError`), which the stream waits out
#: in place, saying so. A constraint, a value too large, a type: still the statement's.
_UNAVAILABLE_CODES = frozenset(
    {
        *_BUSY,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_READONLY,
        sqlite3.SQLITE_CANTOPEN,
    }
)
#: How often a SQLite database's background connection moves the write-ahead log into the
#: database file (see :class:`SqliteDatabase`).
CHECKPOINT_SECONDS = 1.0


def _locked(exc: sqlite3.Error) -> bool:
    """Whether SQLite refused because another connection holds the file (BUSY, LOCKED, and
    their extended codes, which Python reports: BUSY_RECOVERY while another process recovers
    the write-ahead log, BUSY_SNAPSHOT, LOCKED_SHAREDCACHE...; the primary code is their low
    byte)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF in _BUSY


def _sqlite_failure(display: str, exc: sqlite3.Error) -> RelayError:
    """A SQLite failure as ours: :class:`~schemas.TransportError` when the file cannot be used
    just now (:data:`_UNAVAILABLE_CODES`), else :class:`DatabaseError` (the statement refused).
    Extended codes carry the primary one in their low byte (SQLITE_IOERR_SHORT_READ...)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int) and code & 0xFF in _UNAVAILABLE_CODES:
        return TransportError(f"SQLite {display} cannot be used just now: {exc}")
    return DatabaseError(f"{display}: {exc}")


def _sqlite_value(value: object) -> object:
    return _iso(value) if isinstance(value, datetime) else value


def _sqlite_args(args: Sequence[object]) -> tuple[object, ...]:
    return tuple(_sqlite_value(a) for a in args)


# What runs on the database's thread: each is one trip there.


def _run(conn: sqlite3.Connection, sql: str, args: tuple[object, ...]) -> int:
    cursor = conn.execute(sql, args)
    try:
        return cursor.rowcount
    finally:
        cursor.close()


def _fetch(conn: sqlite3.Connection, sql: str, args: tuple[object, ...]) -> list[tuple[Any, ...]]:
    cursor = conn.execute(sql, args)
    try:
        return [tuple(row) for row in cursor.fetchall()]
    finally:
        cursor.close()


def _rollback(conn: sqlite3.Connection) -> None:
    # An error may have ended the transaction already (SQLite rolls back on a full disk, for
    # one): a ROLLBACK then would fail and hide that error.
    if conn.in_transaction:
        conn.execute("ROLLBACK")


def _commit(conn: sqlite3.Connection) -> None:
    """COMMIT; one that fails (a deferred constraint, a busy or full disk) leaves SQLite inside
    the transaction, so it is rolled back: the next transaction must not trip over it."""
    try:
        conn.execute("COMMIT")
    except sqlite3.Error:
        _rollback(conn)
        raise


def _conflict(guard: Statement) -> WriteConflict:
    return WriteConflict(f"changed by another writer (no row matched: {guard[0]})")


def _write(
    conn: sqlite3.Connection,
    statements: Sequence[tuple[str, tuple[object, ...]]],
    guard: tuple[str, tuple[object, ...]] | None,
) -> list[int]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        if guard is not None and not _run(conn, *guard):
            raise _conflict(guard)
        counts = [_run(conn, sql, args) for sql, args in statements]
    except BaseException:
        _rollback(conn)
        raise
    _commit(conn)
    return counts


def _checkpoint(conn: sqlite3.Connection) -> None:
    # PASSIVE: as much as it can without waiting for a reader or the writer.
    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()


def _script(conn: sqlite3.Connection, ddl: str) -> None:
    try:
        conn.executescript(f"BEGIN IMMEDIATE;\n{ddl}\nCOMMIT;")
    except sqlite3.Error:
        _rollback(conn)
        raise


def _connect_checkpointer(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


class _SqliteTransaction:
    def __init__(self, db: SqliteDatabase) -> None:
        self._db = db

    async def execute(self, sql: str, *args: object) -> int:
        return await self._db._call(_run, sql, _sqlite_args(args))

    async def fetch(self, sql: str, *args: object) -> list[tuple[Any, ...]]:
        return await self._db._call(_fetch, sql, _sqlite_args(args))

    async def fetchone(self, sql: str, *args: object) -> tuple[Any, ...] | None:
        rows = await self.fetch(sql, *args)
        return rows[0] if rows else None


class SqliteDatabase(Database):
    """One SQLite file in WAL mode. ``create`` False refuses a file that does not exist.

    The connection lives on a thread of its own (every call on it runs there, one at a time,
    in order); each statement, fetch, :meth:`write` or :meth:`script` is one trip to that
    thread and back. On a loaded machine a trip costs milliseconds (the thread and then the
    event loop each wait for a CPU), so a commit of many statements goes in one
    (:meth:`write`).

    A commit appends to the write-ahead log. Moving the log into the database file (a
    checkpoint: copying the pages, and on a real disk an fsync) is left to a second connection
    on a second thread, every ``checkpoint_every`` seconds, instead of SQLite's default: the
    commit that finds 1,000 pages in the log does it, while the service waits for that commit
    (a fifth of an approver's time under a burst). None keeps SQLite's default."""

    dialect: Dialect = "sqlite"

    def __init__(
        self,
        path: Path,
        *,
        create: bool = True,
        checkpoint_every: float | None = CHECKPOINT_SECONDS,
        busy_seconds: float = BUSY_SECONDS,
    ) -> None:
        self.path = path
        self.display = str(path)
        self._create = create
        self.checkpoint_every = checkpoint_every
        #: How long a statement waits for another process's lock on the file before it fails.
        self.busy_seconds = busy_seconds
        self._thread: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None
        self._lock = asyncio.Lock()
        self._checkpointer: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        if self._conn is not None:
            return
        if sqlite3.sqlite_version_info < MIN_SQLITE:
            raise ConfigError(
                f"this Python's SQLite is {sqlite3.sqlite_version}; the ledger needs "
                f"{'.'.join(map(str, MIN_SQLITE))} or later (INSERT ... RETURNING): use a newer "
                "Python build, or PostgreSQL"
            )
        path = self.path
        if path.exists() and not path.is_file():
            raise ConfigError(f"{path} is not a database file (it is a directory or a device)")
        if not path.exists():
            if not self._create:
                raise ConfigError(f"no database at {path}: nothing has been recorded there")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"cannot create {path.parent}: {exc.strerror}") from exc
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sqlite {path.name}")
        try:
            self._conn = await asyncio.get_running_loop().run_in_executor(thread, self._open)
        except BaseException:
            thread.shutdown(wait=False)
            raise
        self._thread = thread
        if self.checkpoint_every is not None:
            self._checkpointer = asyncio.create_task(
                self._checkpoint_regularly(self.checkpoint_every), name=f"checkpoint {path.name}"
            )

    def _open(self) -> sqlite3.Connection:
        """On the database's thread, which the connection then never leaves."""
        began = time.monotonic()
        try:
            # The wait for another process's lock holds from the first statement: switching to
            # WAL takes the file's lock too.
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=self.busy_seconds)
        except (sqlite3.Error, OSError) as exc:
            raise ConfigError(f"cannot open the database {self.path}: {exc}") from exc
        try:
            self._switch_to_wal(conn, began + self.busy_seconds)
            conn.execute("PRAGMA synchronous=NORMAL")
            if self.checkpoint_every is not None:  # the background connection does it
                conn.execute("PRAGMA wal_autocheckpoint=0")
            # A file that is not SQLite fails here, at the first read of the schema.
            conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
        except sqlite3.Error as exc:
            conn.close()
            if _locked(exc):
                # Another process holds the file (a service sharing it, upgrading its tables):
                # that passes, and a restart tries again. As a settings error (exit 2) it was
                # "not a usable SQLite database", and systemd left the service stopped.
                raise DatabaseError(
                    f"{self.path} stayed locked by another process for "
                    f"{time.monotonic() - began:.1f} s ({exc}): not opened; a later start "
                    "tries again"
                ) from exc
            raise ConfigError(f"{self.path} is not a usable SQLite database: {exc}") from exc
        return conn

    @staticmethod
    def _switch_to_wal(conn: sqlite3.Connection, deadline: float) -> None:
        """Put the file in WAL mode (a no-op once it is), trying again until ``deadline``
        (monotonic) while another connection holds it. Two connections switching a file at once
        each hold the read lock the other must wait out, and SQLite refuses one of them at
        once instead of waiting (the approver and the audit starting together on a new file)."""
        while True:
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if not _locked(exc) or time.monotonic() >= deadline:
                    raise
            time.sleep(_WAL_SWITCH_PAUSE)  # on the database's own thread

    async def _checkpoint_regularly(self, every: float) -> None:
        """Checkpoint every ``every`` seconds on a connection and a thread of its own (made at
        the first one, closed when the database is)."""
        loop = asyncio.get_running_loop()
        thread: ThreadPoolExecutor | None = None
        conn: sqlite3.Connection | None = None
        failing = False
        try:
            while True:
                await asyncio.sleep(every)
                if thread is None:
                    thread = ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix=f"sqlite checkpoint {self.path.name}"
                    )
                try:
                    if conn is None:
                        conn = await loop.run_in_executor(thread, _connect_checkpointer, self.path)
                    await loop.run_in_executor(thread, _checkpoint, conn)
                except sqlite3.Error as exc:
                    if not failing:
                        log.warning(
                            "%s: moving the write-ahead log into the database failed (%s); "
                            "trying again every %g s (the log grows until it works)",
                            self.display,
                            exc,
                            every,
                        )
                    failing = True
                else:
                    if failing:
                        log.info("%s: the write-ahead log is moved in again", self.display)
                    failing = False
        finally:
            if thread is not None:
                if conn is not None:  # after the checkpoint under way, on its thread
                    with contextlib.suppress(sqlite3.Error):
                        await asyncio.wrap_future(thread.submit(conn.close))
                thread.shutdown(wait=False)

    async def close(self) -> None:
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None:
            checkpointer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checkpointer
        conn, self._conn = self._conn, None
        thread, self._thread = self._thread, None
        if thread is None:
            return
        try:
            if conn is not None:
                # After whatever is queued there (a call its caller stopped waiting for).
                await asyncio.get_running_loop().run_in_executor(thread, conn.close)
        finally:
            thread.shutdown(wait=False)

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(connection, *args)`` on the database's thread."""
        conn, thread = self._conn, self._thread
        if conn is None or thread is None:
            raise RuntimeError("open the database first (async with ...)")
        return await asyncio.get_running_loop().run_in_executor(thread, fn, conn, *args)

    async def execute(self, sql: str, *args: object) -> int:
        # One statement is a transaction of its own (the connection is in autocommit mode):
        # no BEGIN and COMMIT around it (the audit makes one such append per message).
        async with self._statement() as one:
            return await one.execute(sql, *args)

    async def fetch(self, sql: str, *args: object) -> list[tuple[Any, ...]]:
        async with self._statement() as one:
            return await one.fetch(sql, *args)

    async def write(
        self, statements: Sequence[Statement], *, guard: Statement | None = None
    ) -> list[int]:
        args = [(sql, _sqlite_args(values)) for sql, values in statements]
        checked = None if guard is None else (guard[0], _sqlite_args(guard[1]))
        async with self._statement():
            return await self._call(_write, args, checked)

    @contextlib.asynccontextmanager
    async def _statement(self) -> AsyncIterator[_SqliteTransaction]:
        """One statement (or one trip), outside any transaction, its failure a
        :class:`DatabaseError`."""
        async with self._lock:
            try:
                yield _SqliteTransaction(self)
            except sqlite3.Error as exc:
                raise _sqlite_failure(self.display, exc) from exc

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Executor]:
        async with self._lock:
            try:
                await self._call(_run, "BEGIN IMMEDIATE", ())
                try:
                    yield _SqliteTransaction(self)
                except BaseException:
                    await self._call(_rollback)
                    raise
                await self._call(_commit)
            except sqlite3.Error as exc:
                raise _sqlite_failure(self.display, exc) from exc

    async def script(self, ddl: str) -> None:
        async with self._statement():
            await self._call(_script, ddl)


# ----------------------------------------------------------------------------------- PostgreSQL

_PLACEHOLDER = re.compile(r"\?")


def _numbered(sql: str) -> str:
    """``?`` placeholders as asyncpg's ``$1, $2...`` (our statements hold no ``?`` in text)."""
    counter = iter(range(1, 10_000))
    return _PLACEHOLDER.sub(lambda _: f"${next(counter)}", sql)


#: PostgreSQL's answers that say it cannot serve just now, not that it refuses the statement:
#: shutting down (57P01 admin, 57P02 crash), starting up or recovering (57P03), an idle session
#: ended (57P05), no connection slot left (53300); with class 08 (the connection failed or is
#: gone: asyncpg's ``ConnectionDoesNotExistError`` when it drops mid-statement). A restart or a
#: failover answers these for seconds to a minute.
#:
#: And 25006 (read_only_sql_transaction), a write on a server that cannot write: right after a
#: failover the DSN still leads to the old primary, demoted, or to a server in recovery, for
#: the seconds to a minute until its name points at the new primary (57P03's sibling: that one
#: refuses the connection, this one the write). A DSN that leads to a replica for good is a
#: setting to correct, which the outage's warning names; as a refusal, every message written
#: meanwhile was dead-lettered. The connection that met it is closed (see
#: :meth:`PostgresDatabase._connection`): the pool's next one follows the DSN.
_READ_ONLY = "25006"
_UNAVAILABLE_STATES = frozenset({"57P01", "57P02", "57P03", "57P05", "53300", _READ_ONLY})


def _postgres_failure(display: str, exc: Exception) -> RelayError:
    """An asyncpg failure as ours: :class:`~schemas.TransportError` when the server cannot
    serve just now (see above), :class:`DatabaseError` when it refused the statement (a
    constraint, a permission, a serialization failure or a deadlock)."""
    state = _sqlstate(exc)
    if state.startswith("08") or state in _UNAVAILABLE_STATES:
        return TransportError(f"PostgreSQL at {display}: {exc}")
    return DatabaseError(f"{display}: {exc}")


def _sqlstate(exc: BaseException) -> str:
    return str(getattr(exc, "sqlstate", None) or "")


def _count(status: str) -> int:
    last = status.rsplit(" ", 1)[-1]
    return int(last) if last.isdigit() else 0


class _PostgresTransaction:
    def __init__(self, conn: Any) -> None:
        self._conn = conn

    async def execute(self, sql: str, *args: object) -> int:
        return _count(await self._conn.execute(_numbered(sql), *args))

    async def fetch(self, sql: str, *args: object) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in await self._conn.fetch(_numbered(sql), *args)]

    async def fetchone(self, sql: str, *args: object) -> tuple[Any, ...] | None:
        row = await self._conn.fetchrow(_numbered(sql), *args)
        return None if row is None else tuple(row)


#: How long a statement waits for PostgreSQL's answer: then it fails as the database
#: unavailable (:class:`~schemas.TransportError`), which the stream waits out in place. What
#: the services run is an indexed lookup or a write of at most a few hundred rows, milliseconds
#: (seconds behind another writer's lock): no answer after 30 s says the server or the link is
#: not answering (paused, frozen, its packets dropped). Without a bound the statement waited
#: for TCP, a quarter of an hour of retransmissions when packets are lost, and for ever when
#: the server's host still acknowledges them, the service silent meanwhile.
STATEMENT_SECONDS = 30.0
#: How long a statement waits for a connection: one of the pool's to be free, or a new one to
#: be opened (what bounded only the opening before, at the same 10 s). A free connection is
#: there within milliseconds unless every one waits for a server that does not answer.
ACQUIRE_SECONDS = 10.0
#: The bound of :meth:`PostgresDatabase.script`'s DDL: a schema upgrade builds its indexes
#: over a whole ledger (minutes for millions of rows), and another process's upgrade holds
#: the lock it waits for meanwhile. Bounded all the same, for a server that stops answering.
SCRIPT_SECONDS = 3600.0


def _given_up(exc: BaseException) -> bool:
    """Whether the statement under way was given up: it timed out, or its task was cancelled
    (a stop). See :meth:`PostgresDatabase._connection`."""
    return isinstance(exc, TimeoutError | asyncio.CancelledError)


class PostgresDatabase(Database):
    """A PostgreSQL database through a small asyncpg pool.

    Every wait for the server is bounded: a statement by ``statement_seconds``, the wait for a
    connection (a free one of the pool, or a new one opened) by ``acquire_seconds``. Either
    expired fails as :class:`~schemas.TransportError`, "did not answer within N s"."""

    dialect: Dialect = "postgres"

    def __init__(
        self,
        dsn: str,
        *,
        pool_size: int = 4,
        statement_seconds: float = STATEMENT_SECONDS,
        acquire_seconds: float = ACQUIRE_SECONDS,
    ) -> None:
        self.dsn = dsn
        self.display = redact(dsn)
        self._pool_size = pool_size
        #: How long a statement waits for the server's answer (read at :meth:`connect`).
        self.statement_seconds = statement_seconds
        #: How long a statement waits for a connection (read at :meth:`connect`).
        self.acquire_seconds = acquire_seconds
        self._pool: Any = None
        #: Connections whose statement was given up, being ended (see :meth:`_finish`).
        self._finishing: set[asyncio.Task[None]] = set()

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
            # command_timeout bounds every statement asyncpg sends, ours and its own (the
            # reset of a connection given back, the goodbye at close, the CancelRequest for a
            # statement given up); timeout, the opening of each connection.
            # One connection opened now (a wrong DSN or login is a setting, said at start),
            # none kept as a floor: asyncpg reopens a floor in the background, logging a
            # traceback at each failed try for as long as an outage lasts; a statement opens
            # what it needs, and its failure is the statement's (the database unavailable).
            self._pool = await asyncpg.create_pool(
                self.dsn,
                init_size=1,
                min_size=0,
                max_size=self._pool_size,
                timeout=self.acquire_seconds,
                command_timeout=self.statement_seconds,
            )
        except asyncpg.InvalidCatalogNameError as exc:
            raise ConfigError(f"the database of {self.display} does not exist: {exc}") from exc
        except (asyncpg.InvalidAuthorizationSpecificationError, asyncpg.InvalidPasswordError) as e:
            raise ConfigError(f"PostgreSQL refused the login for {self.display}: {e}") from e
        except TimeoutError as exc:
            raise TransportError(
                f"cannot reach PostgreSQL at {self.display}: no answer within "
                f"{self.acquire_seconds:g} s"
            ) from exc
        except (OSError, asyncpg.PostgresError) as exc:
            raise TransportError(f"cannot reach PostgreSQL at {self.display}: {exc}") from exc

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if self._finishing:  # each within its bounds
            await asyncio.gather(*self._finishing, return_exceptions=True)
        try:
            await pool.close()
        except TimeoutError:
            # Each connection's goodbye waits statement_seconds for the server to end it;
            # asyncpg then closes them all without it.
            log.warning(
                "PostgreSQL at %s did not answer within %g s when its connections were "
                "closed: closed without its answer",
                self.display,
                self.statement_seconds,
            )

    def _require(self) -> Any:
        if self._pool is None:
            raise RuntimeError("open the database first (async with ...)")
        return self._pool

    def _no_answer(self, seconds: float, what: str) -> TransportError:
        return TransportError(
            f"PostgreSQL at {self.display} did not answer within {seconds:g} s: {what}"
        )

    @contextlib.asynccontextmanager
    async def _connection(
        self, *, transaction: bool = False, seconds: float | None = None
    ) -> AsyncIterator[Any]:
        """A connection of the pool for one statement, or for a transaction (committed when
        the block ends, rolled back when it fails); every failure as ours
        (:func:`_postgres_failure`). ``seconds``: the bound of its statements, for the
        message.

        A statement given up (it timed out, or its task was cancelled) fails at once, and
        its connection is ended in the background (:meth:`_finish`): asyncpg cancels the
        statement with a CancelRequest, which opens another connection to the server, and
        the connection cannot serve again until the server acknowledges it. When the server
        does not answer, neither does the CancelRequest: waiting for it here (as asyncpg's
        own ROLLBACK and the pool's release do) held the caller one bound longer. A
        connection that met a read-only server is closed, not given back to the pool (see
        :data:`_UNAVAILABLE_STATES`)."""
        import asyncpg

        pool = self._require()
        try:
            conn = await pool.acquire(timeout=self.acquire_seconds)
        except TimeoutError as exc:
            raise self._no_answer(
                self.acquire_seconds, "no connection to it (none of the pool's free, none opened)"
            ) from exc
        except asyncpg.PostgresError as exc:
            raise _postgres_failure(self.display, exc) from exc
        except (OSError, asyncpg.InterfaceError) as exc:
            raise TransportError(f"PostgreSQL at {self.display}: {exc}") from exc
        try:
            try:
                if transaction:
                    await conn.execute("BEGIN")
                try:
                    yield conn
                except BaseException as exc:
                    if transaction and not _given_up(exc) and not conn.is_closed():
                        await conn.execute("ROLLBACK")
                    raise
                if transaction:
                    await conn.execute("COMMIT")
            except BaseException as exc:
                if _given_up(exc):
                    task = asyncio.create_task(self._finish(pool, conn, rollback=transaction))
                    self._finishing.add(task)
                    task.add_done_callback(self._finishing.discard)
                    if isinstance(exc, TimeoutError):
                        bound = self.statement_seconds if seconds is None else seconds
                        raise self._no_answer(bound, "the statement is given up") from exc
                    raise
                if _sqlstate(exc) == _READ_ONLY:
                    conn.terminate()
                # Given back to the pool: asyncpg resets it first (one statement, bounded by
                # acquire_seconds), or closes it when it failed.
                await pool.release(conn)
                raise
            await pool.release(conn)
        except TransportError:
            raise
        except TimeoutError as exc:
            raise self._no_answer(
                self.acquire_seconds, "the reset of a connection given back (it is closed)"
            ) from exc
        except asyncpg.PostgresError as exc:
            raise _postgres_failure(self.display, exc) from exc
        except (OSError, asyncpg.InterfaceError) as exc:
            raise TransportError(f"PostgreSQL at {self.display}: {exc}") from exc

    async def _finish(self, pool: Any, conn: Any, *, rollback: bool) -> None:
        """End a connection whose statement was given up: wait for asyncpg's CancelRequest to
        be acknowledged (a live server ends the statement and its locks at once; left
        running, it held them until done), roll back, give the connection back to the pool.
        When the server does not answer, asyncpg closes the connection instead, after
        ``statement_seconds`` (the CancelRequest's bound) or ``acquire_seconds`` (the
        release's): never given back waiting for an answer."""
        with contextlib.suppress(Exception):
            if rollback and not conn.is_closed():
                await conn.execute("ROLLBACK")
        with contextlib.suppress(Exception):
            await pool.release(conn)

    async def execute(self, sql: str, *args: object) -> int:
        async with self.transaction() as tx:
            return await tx.execute(sql, *args)

    async def fetch(self, sql: str, *args: object) -> list[tuple[Any, ...]]:
        async with self._connection() as conn:
            rows = await conn.fetch(_numbered(sql), *args)
        return [tuple(row) for row in rows]

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Executor]:
        async with self._connection(transaction=True) as conn:
            yield _PostgresTransaction(conn)

    async def script(self, ddl: str) -> None:
        async with self._connection(transaction=True, seconds=SCRIPT_SECONDS) as conn:
            await conn.execute(ddl, timeout=SCRIPT_SECONDS)


# ---------------------------------------------------------------------------------------- open


def _sqlite_path(url: str) -> Path | None:
    text = url.strip()
    scheme = urlsplit(text).scheme.lower()
    if scheme == "sqlite":
        # SQLAlchemy's convention: sqlite:///relative.db, sqlite:////absolute/path.db
        path = text[len("sqlite:") :].removeprefix("//").removeprefix("/")
        if not path:
            raise ConfigError(f"{url!r}: give the SQLite file, sqlite:///audit.db")
        return Path(path)
    if scheme in ("postgresql", "postgres"):
        return None
    if scheme and len(scheme) > 1:  # a one-letter "scheme" is a Windows drive
        raise ConfigError(
            f"database {redact(url)!r} is not understood: use a file path, sqlite:///PATH or "
            "postgresql://USER@HOST/DB"
        )
    return Path(text)


def open_database(url: str, *, create: bool = True, pool_size: int = 4) -> Database:
    """The database at ``url`` (a file path, ``sqlite:///PATH`` or ``postgresql://...``), not
    connected yet (use ``async with``). ``create`` False: a SQLite file must exist already."""
    path = _sqlite_path(url)
    if path is None:
        return PostgresDatabase(url.strip(), pool_size=pool_size)
    return SqliteDatabase(path, create=create)


def database_exists(url: str) -> bool | None:
    """Whether a SQLite database is there (None for PostgreSQL: the server decides)."""
    path = _sqlite_path(url)
    return None if path is None else path.is_file()


def placeholders(count: int) -> str:
    return ", ".join("?" * count)


Rows = Sequence[tuple[Any, ...]]
