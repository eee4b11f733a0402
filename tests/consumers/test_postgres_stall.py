"""A PostgreSQL that stops answering without closing its connections (a paused link, a frozen
server, packets dropped), and one that answers but cannot write (a demoted primary, a server in
recovery, right after a failover), are the database unavailable: each statement fails as a
:class:`~schemas.TransportError` within its bound, and the stream waits it out in place.

Against the real PostgreSQL, through a TCP proxy that holds every byte while paused (the
connections stay open: nothing tells the client), or on a scratch database made read-only."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable
from typing import Any
from urllib.parse import urlsplit

import pytest

from consumers._audit import Ledger, open_ledger
from consumers._audit_service import AuditService
from consumers._db import PostgresDatabase, open_database
from consumers._stream import dependency_unavailable
from schemas import RelayError, TransportError
from schemas.transport import MemoryTransport
from schemas.wire import lifecycle_message
from tests.transport.proxy import TcpProxy

from ._factory import event, transition, vm
from .test_dependency_outage import _through, _until

pytestmark = pytest.mark.postgres

#: The bound the tests give a statement and the wait for a connection (the defaults are 30 s and
#: 10 s): far above what a statement takes here, even on a loaded machine.
BOUND = 2.0
#: How long a test waits for what that bound ends, before it says the call hangs.
PATIENCE = 8.0


def _bounded(url: str) -> PostgresDatabase:
    """The database at ``url``, every wait for it bounded by ``BOUND`` (the attributes the
    constructor sets, set as a caller may before it connects)."""
    db = PostgresDatabase(url)
    db.statement_seconds = db.acquire_seconds = BOUND
    return db


def _stallable(proxy: TcpProxy, url: str) -> PostgresDatabase:
    """The database at ``url`` through ``proxy``, every wait for it bounded by ``BOUND``."""
    return _bounded(_through(proxy, url))


async def _failure_within(call: Awaitable[Any], what: str) -> Exception:
    """What ``call`` failed with; the test fails when it still waits after ``PATIENCE``."""
    timer = asyncio.timeout(PATIENCE)
    try:
        async with timer:
            await call
    except Exception as exc:
        if timer.expired():
            pytest.fail(f"{what} still waited for PostgreSQL's answer after {PATIENCE:g} s")
        return exc
    pytest.fail(f"{what} succeeded although PostgreSQL could not answer it")


def _messages(first: int, count: int) -> list[Any]:
    return [
        transition("scheduled", event(f"EVT-{i}"), vm(f"web-{i}"))
        for i in range(first, first + count)
    ]


async def test_a_statement_postgresql_does_not_answer_fails_as_unavailable_then_it_works_again(
    postgres_url: str,
) -> None:
    """The link to PostgreSQL stalls (the proxy holds every byte, closes nothing). Before, a
    write waited for the answer with no bound: TCP says nothing for many minutes, and the
    service with it. Now the write fails after its bound as the database unavailable, saying
    so; so does a read, which waits for a connection that cannot be opened. The stall goes
    on: asyncpg's CancelRequest for the write gets no answer either, and that connection is
    closed. Nothing of the given-up write is committed. When the link flows again, the next
    statements work, several at once: no connection of the pool is left waiting for an
    answer."""
    async with (
        TcpProxy("127.0.0.1", urlsplit(postgres_url).port or 5432) as proxy,
        _stallable(proxy, postgres_url) as db,
    ):
        await db.script("CREATE TABLE t (k TEXT PRIMARY KEY)")
        await db.execute("INSERT INTO t (k) VALUES (?)", "before")
        proxy.pause()
        write = await _failure_within(
            db.execute("INSERT INTO t (k) VALUES (?)", "during"), "a write"
        )
        read = await _failure_within(db.fetch("SELECT k FROM t"), "a read")
        await asyncio.sleep(2 * BOUND)  # the CancelRequest's bound, then the release's, expire
        proxy.resume()
        await db.execute("INSERT INTO t (k) VALUES (?)", "after")
        await asyncio.gather(
            *(db.execute("INSERT INTO t (k) VALUES (?)", f"after-{i}") for i in range(8))
        )
        rows = await db.fetch("SELECT k FROM t ORDER BY k")
    for failure in (write, read):
        assert isinstance(failure, TransportError), repr(failure)
        assert dependency_unavailable(failure)
        assert f"did not answer within {BOUND:g} s" in str(failure), str(failure)
    assert [k for (k,) in rows] == ["after", *(f"after-{i}" for i in range(8)), "before"]


async def test_a_statement_given_up_on_a_slow_postgresql_is_cancelled_there(
    postgres_url: str,
) -> None:
    """The server answers but the statement takes longer than its bound (here a minute's
    sleep; in life a lock held by another writer or a migration). It fails after the bound as
    the database unavailable, and the server stops running it: asyncpg's CancelRequest is
    acknowledged (closing the connection instead left the statement running, with its
    locks, until it ended). The next statements work."""
    async with (
        open_database(postgres_url) as look,
        _bounded(postgres_url) as db,
    ):
        slow = await _failure_within(db.fetch("SELECT pg_sleep(60)"), "a slow statement")

        async def stopped() -> bool:
            rows = await look.fetch(
                "SELECT pid FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(60)' "
                "AND state = 'active'"
            )
            return not rows

        cancelled = await _until(stopped, PATIENCE)
        after = [await db.fetch("SELECT ?::int", i) for i in range(6)]
    assert isinstance(slow, TransportError), repr(slow)
    assert f"did not answer within {BOUND:g} s" in str(slow), str(slow)
    assert cancelled, "the statement given up still runs on the server"
    assert after == [[(i,)] for i in range(6)]


async def test_closing_the_database_while_postgresql_does_not_answer_ends(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The service stops while the link is stalled. Before, closing the pool waited for
    PostgreSQL to acknowledge each connection's end, with no bound: the stop hung (systemd
    killed it). Now it ends after the bound, saying the connections were closed without it."""
    async with TcpProxy("127.0.0.1", urlsplit(postgres_url).port or 5432) as proxy:
        db = _stallable(proxy, postgres_url)
        await db.connect()
        await db.fetch("SELECT 1")
        proxy.pause()
        timer = asyncio.timeout(PATIENCE)
        with caplog.at_level(logging.WARNING, logger="consumers._db"):
            try:
                async with timer:
                    await db.close()
            except TimeoutError:
                if timer.expired():
                    pytest.fail(f"closing still waited for PostgreSQL after {PATIENCE:g} s")
                raise
    said = [r.getMessage() for r in caplog.records if r.name == "consumers._db"]
    assert any("did not answer" in line for line in said), said


async def test_the_audit_waits_out_a_stalled_postgresql_says_so_and_loses_nothing(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The audit service (its ledger through the proxy) records three messages; then the
    link stalls while four more arrive, and flows again 5 s later. Before, the commit waited
    silently for as long as the stall lasted (here it then went on; on a real link, for as
    long as TCP takes to give up, many minutes, with nothing logged). Now the operator is told
    while it lasts, by the stream's outage warning naming the unanswered statement; every
    message is recorded once after it, none dead-lettered. The broker is the in-memory one:
    it is not the subject here."""
    caplog.set_level(logging.INFO, logger="consumers._stream")
    published: list[Any] = []
    async with (
        TcpProxy("127.0.0.1", urlsplit(postgres_url).port or 5432) as proxy,
        open_ledger(postgres_url) as checker,  # the test's own look, not through the proxy
        Ledger(_stallable(proxy, postgres_url)) as ledger,
        MemoryTransport(f"stall-{time.monotonic_ns()}") as transport,
    ):
        await transport.declare_group("audit")
        service = AuditService(transport, ledger)
        service.stream.outage_cap = 0.5
        runner = asyncio.create_task(service.run())

        async def publish(messages: list[Any]) -> None:
            for message in messages:
                published.append(message)
                await transport.publish(lifecycle_message(message))

        async def stored() -> bool:
            return await checker.count() >= len(published) and service.stream.settled

        async def told() -> bool:
            return any(
                r.levelno == logging.WARNING and "did not answer within" in r.getMessage()
                for r in caplog.records
                if r.name == "consumers._stream"
            )

        try:
            await publish(_messages(0, 3))
            assert await _until(stored, 10)
            proxy.pause()
            await publish(_messages(3, 4))
            warned = await _until(told, PATIENCE)
            await asyncio.sleep(5.0 - BOUND)  # the stall goes on after the warning
            proxy.resume()
            recovered = await _until(stored, 10)
        finally:
            service.stop()
            await asyncio.wait_for(runner, 10)
        rows = await checker.db.fetch("SELECT vm, message_id FROM ledger_messages")
        dead = list(transport.broker.dead["audit"].ready)
    said = [r.getMessage() for r in caplog.records if r.name == "consumers._stream"]
    assert warned, f"nothing said while PostgreSQL did not answer: {said}"
    assert recovered, said
    assert Counter((row[0], row[1]) for row in rows) == Counter(
        (m.vm.name, m.id) for m in published
    )
    assert dead == []
    assert service.stream.stats.dead_lettered == 0
    assert any("works again" in line for line in said), said


async def test_a_read_only_postgresql_is_waited_out_and_the_write_made_once_it_can(
    postgres_url: str, postgres_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Right after a failover the DSN still leads to the old primary, now a server in
    recovery: it answers, but refuses every write with SQLSTATE 25006 ("cannot execute INSERT
    in a read-only transaction") until the name points at the new primary, seconds to a
    minute later. Here the scratch database's sessions begin read-only
    (``default_transaction_read_only``), then no longer. Before, 25006 was a refusal of the
    statement: the audit's commit failed as the message's fault, again and again, on the same
    read-only connections even once the database could write again. Now it is the database
    unavailable: the stream says so and waits in place; each connection that met it is
    closed (the next one follows the DSN), and the messages are recorded once the database
    can write, none dead-lettered."""
    caplog.set_level(logging.INFO, logger="consumers._stream")
    name = urlsplit(postgres_url).path.lstrip("/")
    messages = _messages(0, 3)
    async with (
        open_ledger(postgres_url) as checker,  # the schema; its sessions began read-write
        open_database(postgres_dsn) as admin,
    ):
        await admin.script(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        try:
            async with (
                open_ledger(postgres_url) as ledger,  # its sessions begin read-only
                MemoryTransport(f"read-only-{time.monotonic_ns()}") as transport,
            ):
                with pytest.raises(RelayError) as refused:
                    await ledger.append(messages[0])
                await transport.declare_group("audit")
                service = AuditService(transport, ledger)
                service.stream.outage_cap = 0.3
                runner = asyncio.create_task(service.run())

                async def told() -> bool:
                    return any(
                        r.levelno == logging.WARNING and "read-only" in r.getMessage()
                        for r in caplog.records
                        if r.name == "consumers._stream"
                    )

                async def stored() -> bool:
                    return await checker.count() >= len(messages) and service.stream.settled

                try:
                    for message in messages:
                        await transport.publish(lifecycle_message(message))
                    warned = await _until(told, PATIENCE)
                    await admin.script(
                        f'ALTER DATABASE "{name}" SET default_transaction_read_only = off'
                    )
                    recovered = await _until(stored, 10)
                finally:
                    service.stop()
                    await asyncio.wait_for(runner, 10)
                dead = list(transport.broker.dead["audit"].ready)
        finally:
            with contextlib.suppress(Exception):
                await admin.script(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
        rows = await checker.db.fetch("SELECT vm, message_id FROM ledger_messages")
    said = [r.getMessage() for r in caplog.records if r.name == "consumers._stream"]
    assert isinstance(refused.value, TransportError), repr(refused.value)
    assert "read-only" in str(refused.value)
    assert warned, f"the read-only server was not said to be unavailable: {said}"
    assert recovered, said
    assert sorted(rows) == sorted((m.vm.name, m.id) for m in messages)
    assert dead == []
    assert service.stream.stats.dead_lettered == 0


async def test_an_outage_is_said_once_by_the_stream_not_every_second_by_the_pool(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL goes away (the proxy resets the connections and refuses new ones). Before,
    asyncpg's pool kept trying to reopen its one-connection floor in the background and logged
    a warning with a whole traceback at each try ("Failed to restore the pool connection
    floor", after 1, 2, 4... s) for as long as the outage lasted, beside the stream's own
    words. Now the pool keeps no floor: a connection is opened when a statement needs one,
    whose failure is the statement's (the database unavailable), and the pool says nothing."""
    caplog.set_level(logging.WARNING, logger="asyncpg")
    async with (
        TcpProxy("127.0.0.1", urlsplit(postgres_url).port or 5432) as proxy,
        _stallable(proxy, postgres_url) as db,
    ):
        await db.fetch("SELECT 1")
        await proxy.cut()
        failure = await _failure_within(db.fetch("SELECT 1"), "a read")
        await asyncio.sleep(3.5)  # the floor's tries came after 1 and 2 more seconds
        await proxy.restore()
        assert await db.fetch("SELECT 1") == [(1,)]
    assert isinstance(failure, TransportError), repr(failure)
    pool_said = [r.getMessage() for r in caplog.records if r.name.startswith("asyncpg")]
    assert pool_said == []
