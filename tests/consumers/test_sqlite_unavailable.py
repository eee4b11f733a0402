"""A SQLite file another process keeps locked (the approver and the audit sharing it, a backup
tool, an upgrade) past the wait for its lock is the database unavailable, not a refusal of the
message: the stream waits it out in place and the message is recorded once the lock is let go.

The audit service on a real SQLite file, the lock held by another process; the broker is the
in-memory one: it is not the subject here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from consumers._audit import Ledger, open_ledger
from consumers._audit_service import AuditService
from consumers._db import SqliteDatabase
from schemas import TransportError
from schemas.transport import MemoryTransport
from schemas.wire import lifecycle_message

from .test_dependency_outage import _until
from .test_postgres_stall import _messages

#: How long the other process holds the file: several of the stream's tries, each waiting
#: ``BUSY`` for the lock.
HOLD_SECONDS = 4.0
BUSY = 0.3

_HOLD = (
    "import sqlite3, sys, time\n"
    "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
    "c.execute('BEGIN EXCLUSIVE')\n"
    "print('held', flush=True)\n"
    "time.sleep(float(sys.argv[2]))\n"
    "c.execute('COMMIT')\n"
)


async def hold(path: Path, seconds: float) -> asyncio.subprocess.Process:
    """Another process holding the SQLite file ``path`` locked (``BEGIN EXCLUSIVE``) for
    ``seconds``, once it holds it."""
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLD, str(path), str(seconds), stdout=asyncio.subprocess.PIPE
    )
    assert holder.stdout is not None
    assert (await holder.stdout.readline()).strip() == b"held"
    return holder


async def test_a_statement_on_a_file_another_process_keeps_locked_is_the_database_unavailable(
    tmp_path: Path,
) -> None:
    """The write waits ``busy_seconds`` for the lock, then fails as the database unavailable
    (it was a DatabaseError, a refusal of the statement), and succeeds once the lock is gone."""
    path = tmp_path / "shared.db"
    async with SqliteDatabase(path, busy_seconds=BUSY) as db:
        await db.script("CREATE TABLE t (x INTEGER);")
        holder = await hold(path, 1.5)
        try:
            with pytest.raises(TransportError, match="locked"):
                await db.write([("INSERT INTO t (x) VALUES (?)", (1,))])
        finally:
            await holder.wait()
        await db.write([("INSERT INTO t (x) VALUES (?)", (2,))])
        assert await db.fetch("SELECT x FROM t") == [(2,)]


async def test_the_audit_waits_out_a_locked_sqlite_file_and_loses_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Messages arrive while another process holds the audit's SQLite file for 4 s. Before,
    each try of the commit failed as a refusal after the lock's wait (an ERROR each time), the
    subscription was opened again and the broker delivered the batch again: every try a
    redelivery, which a RabbitMQ quorum queue counts towards its delivery limit (then it
    dead-letters the messages). Now the stream says the database is unavailable and waits in
    place (the deliveries kept, the subscription not opened again), and records every message
    once the lock is let go; nothing is dead-lettered."""
    caplog.set_level(logging.INFO, logger="consumers._stream")
    path = tmp_path / "audit.db"
    published: list[Any] = []
    async with (
        open_ledger(str(path)) as checker,  # the schema, and the test's own look
        Ledger(SqliteDatabase(path, busy_seconds=BUSY)) as ledger,
        MemoryTransport(f"sqlite-locked-{time.monotonic_ns()}") as transport,
    ):
        await transport.declare_group("audit")
        service = AuditService(transport, ledger)
        service.stream.outage_cap = 0.5
        runner = asyncio.create_task(service.run())

        async def stored() -> bool:
            return await checker.count() >= len(published) and service.stream.settled

        try:
            for message in _messages(0, 2):
                published.append(message)
                await transport.publish(lifecycle_message(message))
            assert await _until(stored, 10)
            holder = await hold(path, HOLD_SECONDS)
            for message in _messages(2, 4):
                published.append(message)
                await transport.publish(lifecycle_message(message))
            await holder.wait()
            recovered = await _until(stored, 10)
        finally:
            service.stop()
            await asyncio.wait_for(runner, 10)
        rows = await checker.db.fetch("SELECT vm, message_id FROM ledger_messages")
        dead = list(transport.broker.dead["audit"].ready)
    said = [r.getMessage() for r in caplog.records if r.name == "consumers._stream"]
    assert dead == []
    assert service.stream.stats.dead_lettered == 0
    assert service.stream.stats.reconnects == 0  # waited in place: no redelivery
    assert service.stream.stats.waited > 0
    assert recovered, said
    assert sorted((row[0], row[1]) for row in rows) == sorted((m.vm.name, m.id) for m in published)
    assert any("unavailable" in line or "cannot be reached" in line for line in said), said


def test_the_holder_really_locks_the_file(tmp_path: Path) -> None:
    """The test's lock is one SQLite honours (else the tests above prove nothing)."""
    path = tmp_path / "probe.db"
    sqlite3.connect(path).close()

    async def probe() -> None:
        holder = await hold(path, 1.0)
        try:
            conn = sqlite3.connect(path, timeout=0.1)
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                conn.execute("CREATE TABLE t (x)")
            conn.close()
        finally:
            await holder.wait()

    asyncio.run(probe())


async def test_services_opening_a_new_file_together_each_open_it(tmp_path: Path) -> None:
    """Services opening one file that is not in WAL mode yet (a new one; one from a tool) each
    switch it to WAL as they open it, and SQLite refuses one of two switches at once, without
    waiting for the lock (each holds the read lock the other must wait out): one of the
    approver and the audit starting together on a new file failed to open it, said it "stayed
    locked by another process for 10 s" after 5 ms, and exited (8 of 150 rounds of six here).
    Now the switch is tried again within the wait for the lock."""
    failures: list[BaseException] = []
    for round_ in range(150):
        path = tmp_path / f"central-{round_}.db"
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.execute("CREATE TABLE t (x)")  # rollback-journal mode, as SQLite makes it
            conn.commit()
        databases = [SqliteDatabase(path, checkpoint_every=None) for _ in range(6)]
        opened = await asyncio.gather(*(db.connect() for db in databases), return_exceptions=True)
        failures += [r for r in opened if isinstance(r, BaseException)]
        for db, result in zip(databases, opened, strict=True):
            if not isinstance(result, BaseException):
                await db.close()
    assert failures == []
