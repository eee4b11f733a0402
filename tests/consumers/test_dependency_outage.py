"""A dependency that is down for a while (a PostgreSQL restart or failover takes 10-60 s) costs
no message: a handler or a commit that fails because the database cannot be reached is not the
message's fault. The stream keeps the delivery and tries it again in place (not requeued: the
broker's delivery count does not grow) until the database answers again; a handler's defect is
still dead-lettered after ``max_attempts``.

On the real RabbitMQ and PostgreSQL, the database behind a TCP proxy the test cuts; the stream's
own rules on the in-memory transport."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from consumers import FleetStream
from consumers._approver import ApproverService
from consumers._audit import open_ledger
from consumers._audit_service import AuditService
from consumers._db import open_database
from consumers._policies import parse_policy
from schemas import ChannelNames, MessageType, RelayError, TransportError
from schemas.approvals import generate_signing_key
from schemas.transport import DEAD_LETTER_REASON, MemoryTransport, open_transport
from schemas.transport.rabbitmq import RabbitMQTransport
from schemas.wire import lifecycle_message
from tests.transport.proxy import TcpProxy

from ._factory import event, heartbeat, transition, vm
from .test_rabbitmq import _approvals_of

#: How long the database is cut off: a quick PostgreSQL restart.
OUTAGE_SECONDS = 8.0


def _through(proxy: TcpProxy, url: str) -> str:
    """``url`` with its host and port those of ``proxy``."""
    split = urlsplit(url)
    user = f"{split.username}@" if split.username else ""
    return urlunsplit(split._replace(netloc=f"{user}127.0.0.1:{proxy.port}"))


async def _dead_letters(transport: Any, group: str, within: float = 1.5) -> list[tuple[str, str]]:
    """What group ``group`` (or the broker, for it) dead-lettered: (reason, description)."""
    letters: list[tuple[str, str]] = []
    with contextlib.suppress(TimeoutError):
        async with transport.dead_letters(group) as dead, asyncio.timeout(within):
            async for letter in dead:
                letters.append(
                    (
                        str(letter.properties.get(DEAD_LETTER_REASON)),
                        str(letter.properties.get("dead_letter_description"))[:200],
                    )
                )
                await letter.ack()
    return letters


async def _until(check: Any, within: float) -> bool:
    """Whether ``check()`` came true within ``within`` seconds."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(within):
            while not await check():  # noqa: ASYNC110 - the database, another process
                await asyncio.sleep(0.1)
            return True
    return False


def _cap_one_per_scale_set() -> Any:
    return parse_policy(
        {
            "approve": {"user_initiated": {}},
            "max_unavailable": {"group_by": "scale_set", "count": 1},
        }
    )


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_a_database_outage_dead_letters_nothing_and_every_message_counts(
    amqp_url: str, postgres_url: str, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The approver and the audit, their database (one scratch PostgreSQL database) reached
    through a TCP proxy, on the real RabbitMQ. Scale sets S1 (web-1, web-2) and S2 (web-3,
    web-4), at most one VM of each down. EVT-A (web-1) and EVT-C (web-3) are approved and
    start. Then the database is cut off for 8 s while the agents report: EVT-B (web-2) and
    EVT-D (web-4) scheduled, EVT-A and EVT-C completed, heartbeats. It comes back.

    Before: every message handled during the outage failed its five tries in about a second
    and was dead-lettered ``handler-failed``: EVT-B and EVT-D were never approved (the
    ``completed`` that frees their group lost too), and the audit's ledger missed them. Now
    nothing is dead-lettered (neither by the services nor by the broker's delivery limit),
    EVT-B and EVT-D are approved once each, and the ledger holds every message once. The
    approver's housekeeping says the outage when it begins (it said it at every try, once a
    second) and when it is over."""
    caplog.set_level(logging.INFO, logger="consumers._approver")
    started = time.monotonic()
    channels = ChannelNames().suffixed(unique)
    names = ["web-1", "web-2", "web-3", "web-4"]
    now = datetime.now(UTC)
    later = now + timedelta(minutes=15)
    vms = {name: vm(name, scale_set="S1" if name in ("web-1", "web-2") else "S2") for name in names}
    scheduled = {
        name: event(f"EVT-{letter}", source="User", resources=(name,), not_before=later)
        for name, letter in zip(names, "ABCD", strict=True)
    }
    running = {
        name: event(f"EVT-{letter}", source="User", status="Started", resources=(name,))
        for name, letter in (("web-1", "A"), ("web-3", "C"))
    }
    published: list[Any] = []
    checker = open_database(postgres_url)  # the test's own look, not through the proxy
    async with contextlib.AsyncExitStack() as stack:
        rabbit = await stack.enter_async_context(RabbitMQTransport(amqp_url, channels))
        stack.push_async_callback(
            rabbit.delete_topology, groups=["approver", "audit"], vms=names, exchanges=True
        )
        reply = rabbit.channels.approvals_exchange

        async def publish(*messages: Any) -> None:
            for message in messages:
                published.append(message)
                await rabbit.publish(lifecycle_message(message))

        proxy = await stack.enter_async_context(
            TcpProxy("127.0.0.1", urlsplit(postgres_url).port or 5432)
        )
        database_url = _through(proxy, postgres_url)
        approver_ledger = await stack.enter_async_context(open_ledger(database_url))
        audit_ledger = await stack.enter_async_context(open_ledger(database_url))
        await stack.enter_async_context(checker)
        received, subscriptions, collect = await _approvals_of(rabbit, names)
        for subscription in subscriptions:
            stack.push_async_callback(subscription.close)
        link = await stack.enter_async_context(open_transport(amqp_url, channels))
        approver = ApproverService(
            link, generate_signing_key(), _cap_one_per_scale_set(), db=approver_ledger.db
        )
        audit = AuditService(link, audit_ledger)
        runners = [asyncio.create_task(approver.run()), asyncio.create_task(audit.run())]
        collectors = [
            asyncio.create_task(collect(n, s)) for n, s in zip(names, subscriptions, strict=True)
        ]
        try:
            async with asyncio.timeout(10):
                while not (approver.stream.subscribed and audit.stream.subscribed):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            await publish(*(heartbeat(vms[n], at=now, approvals=reply) for n in names))
            for name in ("web-1", "web-3"):
                await publish(
                    transition("scheduled", scheduled[name], vms[name], at=now, approvals=reply)
                )

            async def first_approved() -> bool:
                return bool(received["web-1"] and received["web-3"])

            assert await _until(first_approved, 10), received
            for name in ("web-1", "web-3"):
                await publish(
                    transition(
                        "started", running[name], vms[name], at=now + timedelta(seconds=1),
                        approvals=reply,
                    )
                )  # fmt: skip

            async def audited() -> bool:
                row = await checker.fetchone("SELECT count(*) FROM ledger_messages")
                return row is not None and row[0] >= len(published)

            assert await _until(audited, 10)

            # The outage: the agents go on reporting meanwhile.
            await proxy.cut()
            cut_at = time.monotonic()
            during = [
                transition("scheduled", scheduled["web-2"], vms["web-2"], at=now, approvals=reply),
                transition("scheduled", scheduled["web-4"], vms["web-4"], at=now, approvals=reply),
                transition(
                    "completed", running["web-1"], vms["web-1"], at=now + timedelta(seconds=2),
                    approvals=reply,
                ),
                transition(
                    "completed", running["web-3"], vms["web-3"], at=now + timedelta(seconds=2),
                    approvals=reply,
                ),
                heartbeat(vms["web-2"], at=now + timedelta(seconds=3), approvals=reply),
                heartbeat(vms["web-4"], at=now + timedelta(seconds=3), approvals=reply),
            ]  # fmt: skip
            for message in during:
                await publish(message)
                await asyncio.sleep(OUTAGE_SECONDS / (len(during) + 1))
            await asyncio.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - cut_at)))
            await proxy.restore()
            outage = time.monotonic() - cut_at

            async def all_done() -> bool:
                row = await checker.fetchone("SELECT count(*) FROM ledger_messages")
                return (
                    bool(received["web-2"] and received["web-4"])
                    and row is not None
                    and row[0] >= len(published)
                    and approver.stream.settled
                    and audit.stream.settled
                )

            recovered = await _until(all_done, 35)
            recovery = time.monotonic() - cut_at - outage
            await asyncio.sleep(0.5)  # anything approved twice would be by now
        finally:
            approver.stop()
            audit.stop()
            async with asyncio.timeout(20):
                await asyncio.gather(*runners, return_exceptions=True)
            for task in collectors:
                task.cancel()
            await asyncio.gather(*collectors, return_exceptions=True)
        dead = {group: await _dead_letters(rabbit, group) for group in ("approver", "audit")}
        rows = await checker.fetch("SELECT vm, message_id FROM ledger_messages")
    took = time.monotonic() - started
    print(
        f"outage {outage:.1f} s; recovered {recovery:.1f} s after it: {recovered}; "
        f"{len(published)} messages; test {took:.1f} s; stats approver {approver.stream.stats}, "
        f"audit {audit.stream.stats}; dead letters {dead}; approvals received (copies "
        f"included) { ({name: len(got) for name, got in received.items()}) }"
    )
    assert dead == {"approver": [], "audit": []}
    assert approver.stream.stats.dead_lettered == audit.stream.stats.dead_lettered == 0
    # One approval each (a copy the approver sends again, when the commit marking it sent was
    # lost with the database, is the same approval: the agent applies it once).
    approved = {name: {(a.event_id, a.approval_id) for a in got} for name, got in received.items()}
    assert {name: [event for event, _ in pairs] for name, pairs in approved.items()} == {
        "web-1": ["EVT-A"],
        "web-2": ["EVT-B"],
        "web-3": ["EVT-C"],
        "web-4": ["EVT-D"],
    }
    assert Counter((row[0], row[1]) for row in rows) == Counter(
        (m.vm.name, m.id) for m in published
    )
    assert recovered
    assert took < 60
    said = [r.getMessage() for r in caplog.records if r.name == "consumers._approver"]
    assert len([m for m in said if m.startswith("approver housekeeping failed")]) == 1, said
    assert [m for m in said if m.startswith("approver housekeeping works again")], said


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_a_group_commit_to_a_database_that_is_down_costs_no_delivery_on_rabbitmq(
    amqp_url: str, postgres_url: str, unique: str
) -> None:
    """A library user's stream on the real RabbitMQ: its handler needs no database, its
    ``before_ack`` writes the batch to PostgreSQL (through the proxy, cut for 8 s while five
    messages arrive). Before, each failed commit opened the subscription again, at once (the
    pause is reset by every delivery): RabbitMQ's quorum queue counted each return, and
    dead-lettered the batch at its ``delivery_limit`` (20) within seconds. Now the batch is
    handled again and committed in place, with a pause that grows while the database is down:
    nothing is dead-lettered, every message is stored once."""
    channels = ChannelNames().suffixed(unique)
    group = "outage"
    checker = open_database(postgres_url)
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(checker)
        await checker.script("CREATE TABLE seen (vm TEXT, id TEXT, PRIMARY KEY (vm, id))")
        proxy = await stack.enter_async_context(
            TcpProxy("127.0.0.1", urlsplit(postgres_url).port or 5432)
        )
        database = await stack.enter_async_context(open_database(_through(proxy, postgres_url)))
        transport = await stack.enter_async_context(RabbitMQTransport(amqp_url, channels))
        stack.push_async_callback(transport.delete_topology, groups=[group], exchanges=True)
        pending: list[tuple[str, str]] = []

        async def commit() -> None:
            batch, pending[:] = list(pending), []
            insert = "INSERT INTO seen (vm, id) VALUES (?, ?) ON CONFLICT DO NOTHING"
            await database.write([(insert, row) for row in batch])

        stream = FleetStream(transport, group, before_ack=commit)

        @stream.on()
        async def handler(message: Any) -> None:
            pending.append((message.vm.name, message.id))

        messages = [transition("scheduled", event(f"EVT-{i}"), vm(f"web-{i}")) for i in range(5)]
        runner = asyncio.create_task(stream.run())
        try:
            async with asyncio.timeout(10):
                while not stream.subscribed:  # noqa: ASYNC110 - the stream's flag
                    await asyncio.sleep(0.05)
            await proxy.cut()
            for message in messages:
                await transport.publish(lifecycle_message(message))
            await asyncio.sleep(OUTAGE_SECONDS)
            await proxy.restore()

            async def stored() -> bool:
                row = await checker.fetchone("SELECT count(*) FROM seen")
                return row is not None and row[0] >= len(messages) and stream.settled

            recovered = await _until(stored, 35)
        finally:
            stream.stop()
            await asyncio.wait_for(runner, 20)
        dead = await _dead_letters(transport, group)
        rows = await checker.fetch("SELECT vm, id FROM seen")
    print(f"recovered: {recovered}; stats {stream.stats}; dead letters {dead}")
    assert dead == []
    assert sorted(rows) == sorted((m.vm.name, m.id) for m in messages)
    assert recovered


@pytest.mark.postgres
async def test_the_approvers_commit_cut_off_by_a_restart_is_made_again_in_place(
    postgres_url: str,
) -> None:
    """The approver's database goes away just as it commits a batch (the proxy is cut when the
    write begins: the failure is the real one, the moment is chosen), and comes back 3 s
    later. Before, the failed commit opened the subscription again; the message came back
    redelivered, its handling found the database still gone, and after five tries it was
    dead-lettered: EVT-A was never approved. Now the batch is kept, handled again in place
    once the database answers, committed, and EVT-A approved once; the broker delivered it
    once. The broker is the in-memory one: it is not the subject here."""
    from .test_approver_retry import _approvals

    now = datetime.now(UTC)
    web1 = vm("web-1", scale_set="S1")
    scheduled = transition(
        "scheduled",
        event("EVT-A", source="User", resources=("web-1",), not_before=now + timedelta(minutes=15)),
        web1,
        at=now,
    )
    async with (
        TcpProxy("127.0.0.1", urlsplit(postgres_url).port or 5432) as proxy,
        open_database(postgres_url) as checker,
        open_ledger(_through(proxy, postgres_url)) as ledger,
        MemoryTransport(f"outage-{time.monotonic_ns()}") as transport,
    ):
        service = ApproverService(
            transport, generate_signing_key(), _cap_one_per_scale_set(), db=ledger.db
        )
        write = ledger.db.write
        armed = False
        restoring: list[asyncio.Task[None]] = []

        async def restore_later() -> None:
            await asyncio.sleep(3.0)
            await proxy.restore()

        async def cut_then_write(*args: Any, **kwargs: Any) -> Any:
            nonlocal armed
            if armed:
                armed = False
                await proxy.cut()
                restoring.append(asyncio.create_task(restore_later()))
            return await write(*args, **kwargs)

        ledger.db.write = cut_then_write  # type: ignore[method-assign]
        await transport.declare_group("approver")
        runner = asyncio.create_task(service.run())

        async def stored(count: int) -> bool:
            row = await checker.fetchone("SELECT count(*) FROM approver_messages")
            return row is not None and row[0] >= count

        try:
            await transport.publish(lifecycle_message(heartbeat(web1, at=now)))
            assert await _until(lambda: stored(1), 10)
            armed = True
            await transport.publish(lifecycle_message(scheduled))
            got = await _approvals(transport, "web-1", 12)
            assert restoring
            await restoring[0]
        finally:
            service.stop()
            await asyncio.wait_for(runner, 10)
        dead = list(transport.broker.dead["approver"].ready)
    assert [a.event_id for a in got] == ["EVT-A"]
    assert dead == []
    assert service.stream.stats.dead_lettered == 0
    assert service.stream.stats.reconnects == 0
    assert service.stream.stats.waited > 0


@pytest.mark.postgres
async def test_postgres_going_away_is_unavailable_and_a_refused_statement_is_not(
    postgres_url: str,
) -> None:
    """What the stream waits out is what :mod:`consumers._db` says is unavailable. A
    PostgreSQL restart (its fast shutdown) ends every session with 57P01 "terminating
    connection due to administrator command", here sent to the statement under way with
    ``pg_terminate_backend``; a cut link drops the connection mid-statement (asyncpg's
    ``ConnectionDoesNotExistError``, class 08); and new connections are refused while it is
    down. Before, the first two were :class:`DatabaseError`, a refusal: the message was
    dead-lettered after its five tries however short the restart. A statement the database
    refuses (a duplicate key) is still a :class:`DatabaseError`, and the message's fault."""
    from consumers._db import DatabaseError
    from consumers._stream import dependency_unavailable

    failures: dict[str, BaseException] = {}
    async with (
        TcpProxy("127.0.0.1", urlsplit(postgres_url).port or 5432) as proxy,
        open_database(postgres_url) as admin,
        open_database(_through(proxy, postgres_url)) as db,
    ):
        await db.script("CREATE TABLE t (k TEXT PRIMARY KEY)")
        await db.execute("INSERT INTO t (k) VALUES (?)", "a")
        with pytest.raises(DatabaseError) as refused:
            await db.execute("INSERT INTO t (k) VALUES (?)", "a")
        failures["duplicate key"] = refused.value

        async def terminated() -> None:
            await asyncio.sleep(0.5)
            await admin.fetch(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE query LIKE 'SELECT pg_sleep%' AND pid <> pg_backend_pid()"
            )

        killer = asyncio.create_task(terminated())
        with pytest.raises(RelayError) as shut_down:
            await db.fetch("SELECT pg_sleep(5)")
        await killer
        failures["57P01 (restart)"] = shut_down.value

        async def cut() -> None:
            await asyncio.sleep(0.5)
            await proxy.cut()

        cutter = asyncio.create_task(cut())
        with pytest.raises(RelayError) as dropped:
            await db.fetch("SELECT pg_sleep(5)")
        await cutter
        failures["link dropped"] = dropped.value
        with pytest.raises(RelayError) as refused_connection:
            await db.fetch("SELECT 1")
        failures["connection refused"] = refused_connection.value
    kinds = {what: (type(e).__name__, dependency_unavailable(e)) for what, e in failures.items()}
    assert kinds == {
        "duplicate key": ("DatabaseError", False),
        "57P01 (restart)": ("TransportError", True),
        "link dropped": ("TransportError", True),
        "connection refused": ("TransportError", True),
    }


# ------------------------------------------------------------------------------- the stream


async def _memory_stream(
    *, outage_cap: float, **options: Any
) -> tuple[MemoryTransport, FleetStream]:
    """A stream of group ``g`` on a memory broker of its own; ``outage_cap``: the longest pause
    between tries while a dependency is down."""
    transport = MemoryTransport(f"outage-{time.monotonic_ns()}")
    await transport.connect()
    await transport.declare_group("g")
    stream = FleetStream(transport, "g", **options)
    stream.outage_cap = outage_cap
    return transport, stream


async def test_a_handler_whose_database_is_down_is_retried_in_place_until_it_is_back(caplog):
    """A handler raises the project's "cannot be reached" error (:class:`TransportError`, what
    :mod:`consumers._db` raises for an unreachable PostgreSQL) ten times, then succeeds. The
    message is handled once, not dead-lettered, and never requeued: each try is the same
    delivery, its delivery count 0 (a requeue adds one per try on the broker, whose delivery
    limit then dead-letters it). Two log lines: when it starts waiting, when it is back."""
    transport, stream = await _memory_stream(retry_delay=0.001, outage_cap=0.02)
    tries: list[tuple[object, int]] = []
    handled: list[str] = []

    @stream.on(MessageType.SCHEDULED)
    async def handler(message: Any) -> None:
        delivery = stream.current_delivery
        assert delivery is not None
        tries.append((delivery, delivery.delivery_count))
        if len(tries) <= 10:
            raise TransportError("PostgreSQL at db:5432: connection refused (test)")
        handled.append(message.id)
        stream.stop()

    message = transition("scheduled", event("EVT-1"), vm("web-1"))
    await transport.publish(lifecycle_message(message))
    with caplog.at_level(logging.INFO, logger="consumers._stream"):
        async with asyncio.timeout(10):
            await stream.run()
    assert handled == [message.id]
    assert len(tries) == 11
    assert {count for _, count in tries} == {0}, "requeued: the broker counts every try"
    assert len({id(delivery) for delivery, _ in tries}) == 1
    assert stream.stats.dead_lettered == stream.stats.retried == 0
    assert not transport.broker.dead["g"].ready
    lines = [r for r in caplog.records if r.name == "consumers._stream" and message.id in r.message]
    assert [r.levelname for r in lines] == ["WARNING", "INFO"], [r.message for r in lines]
    assert "connection refused (test)" in lines[0].message
    await transport.close()


async def test_a_handler_defect_is_still_dead_lettered_after_max_attempts():
    """A plain ``RuntimeError`` is the handler's own: retried (requeued), then dead-lettered
    ``handler-failed`` after ``max_attempts``, as before."""
    transport, stream = await _memory_stream(retry_delay=0.001, outage_cap=0.02)
    tries: list[int] = []

    @stream.on(MessageType.SCHEDULED)
    async def handler(message: Any) -> None:
        assert stream.current_delivery is not None
        tries.append(stream.current_delivery.delivery_count)
        raise RuntimeError("a defect (test)")

    message = transition("scheduled", event("EVT-1"), vm("web-1"))
    await transport.publish(lifecycle_message(message))
    runner = asyncio.create_task(stream.run())
    async with transport.dead_letters("g") as dead, asyncio.timeout(10):
        letter = await anext(aiter(dead))
        await letter.ack()
    stream.stop()
    await asyncio.wait_for(runner, 5)
    assert tries == [0, 1, 2, 3, 4]
    assert letter.properties[DEAD_LETTER_REASON] == "handler-failed"
    assert "RuntimeError: a defect (test)" in str(letter.properties["dead_letter_description"])
    assert stream.stats.dead_lettered == 1
    await transport.close()


async def test_a_stop_while_a_message_waits_for_its_database_returns_at_once_and_keeps_it():
    """The database stays down; the operator stops the service. The stop does not wait for the
    next try (which may be 30 s away), and the message is back in the queue, not dead-lettered,
    for the next process."""
    transport, stream = await _memory_stream(retry_delay=0.05, outage_cap=30.0)
    tries = 0

    @stream.on(MessageType.SCHEDULED)
    async def handler(message: Any) -> None:
        nonlocal tries
        tries += 1
        raise TransportError("PostgreSQL at db:5432: connection refused (test)")

    await transport.publish(lifecycle_message(transition("scheduled", event(), vm("web-1"))))
    runner = asyncio.create_task(stream.run())
    await asyncio.sleep(3.5)  # the pause grows past a second meanwhile
    stopped = time.monotonic()
    stream.stop()
    await asyncio.wait_for(runner, 5)
    took = time.monotonic() - stopped
    assert took < 0.5, f"the stop waited {took:.1f} s for the next try"
    assert tries >= 3
    assert stream.stats.dead_lettered == 0
    assert transport.broker.depth("g") == 1
    assert not transport.broker.dead["g"].ready
    await transport.close()


async def test_a_commit_whose_database_is_down_is_made_again_in_place():
    """``before_ack`` (a library user's group commit) fails ten times because the database
    cannot be reached, then works; its handler needs no database. Before, each failure opened
    the subscription again: the broker delivered the batch once more each time (RabbitMQ's
    quorum queue counts every return, and dead-letters the message at its ``delivery_limit``,
    20, within seconds of an outage). Now the batch is handled again in place and committed
    when the database is back: delivered once, stored once, not dead-lettered."""
    commits: list[list[str]] = []
    pending: list[str] = []
    failures = 0

    async def commit() -> None:
        nonlocal failures
        batch, pending[:] = list(pending), []
        if failures < 10:
            failures += 1
            raise TransportError("PostgreSQL at db:5432: connection refused (test)")
        commits.append(batch)

    transport, stream = await _memory_stream(retry_delay=0.001, outage_cap=0.02, before_ack=commit)
    counts: list[int] = []

    @stream.on(MessageType.SCHEDULED)
    async def handler(message: Any) -> None:
        assert stream.current_delivery is not None
        counts.append(stream.current_delivery.delivery_count)
        pending.append(message.id)

    messages = [transition("scheduled", event(f"EVT-{i}"), vm("web-1")) for i in range(3)]
    for message in messages:
        await transport.publish(lifecycle_message(message))
    runner = asyncio.create_task(stream.run())
    async with asyncio.timeout(10):
        while not commits or not stream.settled:  # noqa: ASYNC110 - the stream's flag
            await asyncio.sleep(0.01)
    stream.stop()
    await asyncio.wait_for(runner, 5)
    assert sorted(id for batch in commits for id in batch) == sorted(m.id for m in messages)
    assert set(counts) == {0}, f"delivered again by the broker: delivery counts {counts}"
    assert stream.stats.reconnects == 0
    assert stream.stats.dead_lettered == 0
    assert transport.broker.depth("g") == 0
    assert not transport.broker.dead["g"].ready
    await transport.close()
