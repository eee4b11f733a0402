"""The database layer both central services write through: what commits, and what a refused
commit leaves behind (SQLite on a file here, PostgreSQL over its socket)."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime

import pytest

from consumers._db import DatabaseError, SqliteDatabase, WriteConflict, as_time, open_database
from schemas import TransportError

pytestmark = pytest.mark.asyncio

_TABLE = "CREATE TABLE t (k TEXT PRIMARY KEY, v INTEGER NOT NULL);"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "state.db")
    return request.getfixturevalue("postgres_url")  # a scratch database, dropped afterwards


async def test_a_write_commits_every_statement_or_none(db_url):
    async with open_database(db_url) as db:
        await db.script(_TABLE)
        with pytest.raises(DatabaseError):
            await db.write(
                [
                    ("INSERT INTO t (k, v) VALUES (?, ?)", ("a", 1)),
                    ("INSERT INTO t (k, v) VALUES (?, ?)", ("b", 2)),
                    ("INSERT INTO t (k, v) VALUES (?, ?)", ("a", 3)),  # the key again
                ]
            )
        assert await db.fetch("SELECT k, v FROM t") == []

        counts = await db.write(
            [
                ("INSERT INTO t (k, v) VALUES (?, ?), (?, ?)", ("a", 1, "b", 2)),
                ("UPDATE t SET v = v + 10 WHERE k IN (?, ?, ?)", ("a", "b", "none")),
                ("DELETE FROM t WHERE k = ?", ("none",)),
            ]
        )
        assert counts == [2, 2, 0]
        assert sorted(await db.fetch("SELECT k, v FROM t")) == [("a", 11), ("b", 12)]


async def test_a_guarded_write_that_lost_the_race_writes_nothing(db_url):
    """A compare and set: the guard runs first and must change a row. Two writers that read
    version 1 both try to move it; the second finds 2 and none of its statements is kept."""
    async with open_database(db_url) as db, open_database(db_url) as other:
        await db.script(_TABLE)
        await db.execute("INSERT INTO t (k, v) VALUES (?, ?)", "version", 1)
        move = "UPDATE t SET v = ? WHERE k = ? AND v = ?"
        first = await db.write(
            [("INSERT INTO t (k, v) VALUES (?, ?)", ("by-first", 1))],
            guard=(move, (2, "version", 1)),
        )
        assert first == [1]
        with pytest.raises(WriteConflict):
            await other.write(
                [("INSERT INTO t (k, v) VALUES (?, ?)", ("by-second", 1))],
                guard=(move, (2, "version", 1)),
            )
        assert sorted(await other.fetch("SELECT k, v FROM t")) == [("by-first", 1), ("version", 2)]
        # Nothing is left open: the loser writes once it read the current version.
        await other.write(
            [("INSERT INTO t (k, v) VALUES (?, ?)", ("by-second", 1))],
            guard=(move, (3, "version", 2)),
        )
        assert await db.fetchone("SELECT v FROM t WHERE k = ?", "version") == (3,)


@pytest.mark.parametrize("how", ["transaction", "write"])
async def test_a_commit_sqlite_refuses_leaves_the_database_usable(tmp_path, how):
    """A COMMIT can fail after every statement succeeded (here a deferred foreign key; on a
    fleet's database, a full disk or a lock held too long); SQLite then keeps the transaction
    open. Before, the connection stayed inside it: every later transaction of the process
    failed ("cannot start a transaction within a transaction") until a restart."""
    async with open_database(str(tmp_path / "state.db")) as db:
        await db.script(
            "CREATE TABLE parent (id TEXT PRIMARY KEY);"
            "CREATE TABLE child (id TEXT PRIMARY KEY, parent TEXT "
            "REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED);"
        )
        await db.execute("PRAGMA foreign_keys = ON")
        orphan = "INSERT INTO child (id, parent) VALUES (?, ?)", ("c1", "nobody")

        async def in_a_transaction() -> None:
            async with db.transaction() as tx:
                await tx.execute(orphan[0], *orphan[1])

        with pytest.raises(DatabaseError, match="FOREIGN KEY"):
            await (db.write([orphan]) if how == "write" else in_a_transaction())

        async with db.transaction() as tx:
            await tx.execute("INSERT INTO parent (id) VALUES (?)", "p1")
        await db.write([("INSERT INTO child (id, parent) VALUES (?, ?)", ("c2", "p1"))])
        assert await db.fetch("SELECT id, parent FROM child") == [("c2", "p1")]


@pytest.mark.parametrize("how", ["transaction", "write"])
async def test_a_full_database_says_so_and_takes_the_next_write_once_there_is_room(tmp_path, how):
    """A full disk (here SQLite's own page limit) rolls the whole transaction back inside
    SQLite. The error that reaches the caller is that one ("database or disk is full"): before,
    the rollback that followed failed as well ("no transaction is active") and its error hid
    the cause from the operator. It is the database unavailable (TransportError: the stream
    waits until there is room), not a refusal of the message."""
    async with open_database(str(tmp_path / "state.db")) as db:
        await db.script("CREATE TABLE t (k TEXT PRIMARY KEY, v BLOB);")
        pages = (await db.fetch("PRAGMA page_count"))[0][0]
        await db.fetch(f"PRAGMA max_page_count = {pages + 2}")
        small = "INSERT INTO t (k, v) VALUES (?, ?)", ("a", b"x" * 100)
        large = "INSERT INTO t (k, v) VALUES (?, ?)", ("b", b"x" * 200_000)

        async def in_a_transaction() -> None:
            async with db.transaction() as tx:
                for sql, args in (small, large):
                    await tx.execute(sql, *args)

        with pytest.raises(TransportError, match="database or disk is full"):
            await (db.write([small, large]) if how == "write" else in_a_transaction())
        assert await db.fetch("SELECT k FROM t") == []

        await db.fetch("PRAGMA max_page_count = 1000000")
        await db.write([small, large])
        assert sorted(await db.fetch("SELECT k FROM t")) == [("a",), ("b",)]


_BLOB = "CREATE TABLE b (k INTEGER PRIMARY KEY, v BLOB NOT NULL);"


async def _write_pages(db, pages: int) -> None:
    """About ``pages`` pages of 4 KiB, 20 rows of 20 KiB a commit (as an approver's batches)."""
    rows = pages * 4096 // 20_480
    for _ in range(0, rows, 20):
        await db.write(
            [("INSERT INTO b (v) VALUES (?)", (os.urandom(20_480),)) for _row in range(20)]
        )


async def test_a_commit_never_moves_the_log_into_the_database_file_itself(tmp_path):
    """SQLite's default has the commit that finds 1,000 pages in the write-ahead log copy them
    into the database file while the service waits for that commit. Here 1,500 pages are
    committed and none reached the file: that work is the background connection's."""
    path = tmp_path / "state.db"
    async with SqliteDatabase(path, checkpoint_every=3600) as db:
        await db.script(_BLOB)
        await _write_pages(db, 1500)
        assert path.stat().st_size < 1_000_000
        assert tmp_path.joinpath("state.db-wal").stat().st_size > 1500 * 4096


async def test_what_is_committed_reaches_the_database_file_within_about_a_second(tmp_path):
    """The background connection checkpoints every second: 500 pages (under the 1,000 that
    would have made a commit do it) are in the database file soon after, and the log is
    reused rather than growing with everything written."""
    path = tmp_path / "state.db"
    async with open_database(str(path)) as db:
        await db.script(_BLOB)
        for round_ in range(1, 4):
            await _write_pages(db, 500)
            async with asyncio.timeout(5):
                while path.stat().st_size < round_ * 500 * 4096:  # noqa: ASYNC110 - its thread
                    await asyncio.sleep(0.05)
        # The log is reused from its start once all of it was moved in: it never holds all
        # three rounds (how many it holds depends on when the checkpoints fell).
        assert tmp_path.joinpath("state.db-wal").stat().st_size < 3 * 500 * 4096
        assert await db.fetchone("SELECT count(*) FROM b") == (3 * 500 * 4096 // 20_480,)


#: Years the contract allows (1 to 9999), the early ones below 1000 included.
_TIMES = [
    datetime(1, 1, 1, tzinfo=UTC),
    datetime(999, 12, 31, 23, 59, 59, tzinfo=UTC),
    datetime(2025, 1, 6, 12, 0, 0, 250_000, tzinfo=UTC),
    datetime(9999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
]


async def test_times_of_every_year_read_back_and_sort_in_time_order(db_url):
    """SQLite keeps times as text, which must read back and sort as time for any year a
    message may carry. Before, the year 1 was written "1-01-01T..." (glibc's %Y does not pad):
    reading it back raised ValueError (the audit history of that event or VM failed), and the
    year 999 sorted after 2025."""
    async with open_database(db_url) as db:
        column = "TEXT" if db.dialect == "sqlite" else "TIMESTAMPTZ"
        await db.script(f"CREATE TABLE e (k INTEGER PRIMARY KEY, at {column} NOT NULL);")
        for k, at in enumerate(reversed(_TIMES)):
            await db.execute("INSERT INTO e (k, at) VALUES (?, ?)", k, at)
        rows = await db.fetch("SELECT at FROM e ORDER BY at")
        assert [as_time(at) for (at,) in rows] == _TIMES
        before = await db.fetch(
            "SELECT count(*) FROM e WHERE at < ?", datetime(1000, 1, 1, tzinfo=UTC)
        )
        assert before == [(2,)]


@pytest.mark.parametrize(
    ("stored", "moment"),
    [
        ("1-01-01T00:00:00.000000Z", datetime(1, 1, 1, tzinfo=UTC)),
        ("999-12-31T23:59:59.000000Z", datetime(999, 12, 31, 23, 59, 59, tzinfo=UTC)),
        ("0999-12-31T23:59:59.000000Z", datetime(999, 12, 31, 23, 59, 59, tzinfo=UTC)),
    ],
)
async def test_a_time_written_unpadded_by_an_earlier_version_still_reads(stored, moment):
    """Rows an earlier version wrote with an unpadded year stay in the (append-only) ledger:
    they read back as the time they are, not as an error."""
    assert as_time(stored) == moment


@pytest.mark.parametrize(
    "code",
    [
        pytest.param(5, id="BUSY"),
        pytest.param(261, id="BUSY_RECOVERY"),
        pytest.param(517, id="BUSY_SNAPSHOT"),
        pytest.param(773, id="BUSY_TIMEOUT"),
        pytest.param(6, id="LOCKED"),
        pytest.param(262, id="LOCKED_SHAREDCACHE"),
    ],
)
async def test_sqlite_s_extended_busy_codes_are_another_process_holding_the_file(code):
    """Python reports SQLite's extended result code: a file another process is recovering
    (BUSY_RECOVERY, after a crash with the write-ahead log left) was "not a usable SQLite
    database" at open, a settings error (exit 2, systemd leaves the service stopped), where
    plain BUSY is a passing failure. SQLite raises these only in races a test cannot arrange,
    so the error is built here with the code SQLite gives it."""
    import sqlite3

    from consumers._db import _locked

    error = sqlite3.OperationalError("database is locked")
    error.sqlite_errorcode = code
    assert _locked(error)
    other = sqlite3.OperationalError("file is not a database")
    other.sqlite_errorcode = 26  # SQLITE_NOTADB
    assert not _locked(other)


async def test_a_sqlite_file_another_process_keeps_locked_is_a_passing_failure_not_a_setting(
    tmp_path,
):
    """The approver and the audit may share one SQLite file; one of them upgrading its tables
    holds it while the other starts. That other waited 5 s, then called the file "not a usable
    SQLite database" (a settings error: exit 2, and systemd left the service stopped). Now it
    waits its ``busy_seconds`` (10 by default) and then fails as a database error (exit 1: a
    restart tries again); a lock released in time costs only the wait."""
    import sqlite3
    import time

    from schemas import ConfigError

    from .test_sqlite_unavailable import hold

    path = tmp_path / "shared.db"
    sqlite3.connect(path).close()
    holder = await hold(path, 3)
    try:
        refused = SqliteDatabase(path, busy_seconds=0.5)
        with pytest.raises(DatabaseError, match="stayed locked by another process") as caught:
            await refused.connect()
        assert not isinstance(caught.value, ConfigError)
        began = time.monotonic()
        async with SqliteDatabase(path) as waited:  # the default: waits for the holder
            await waited.execute("CREATE TABLE t (x)")
        assert time.monotonic() - began < 10
    finally:
        if holder.returncode is None:
            holder.kill()
        await holder.wait()
