"""The audit ledger on SQLite and on the real PostgreSQL: append-only, idempotent, and a
history of a VM or an event that is complete and in order."""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import timedelta

import pytest

from consumers import Action
from consumers._audit import Appended, open_ledger
from consumers._cli import main
from schemas import MAX_KEY_LENGTH, LifecycleMessage, SchemaError, decode, decode_newer

from ._factory import T0, event, heartbeat, hook, outcome, transition, vm


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def ledger_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'audit.db'}"
    return request.getfixturevalue("postgres_url")


def scenario():
    ev = event("EVT-7", resources=("web-1", "web-2"), source="User")
    started = event("EVT-7", resources=("web-1", "web-2"), status="Started")
    at = [T0 + timedelta(seconds=s) for s in range(10)]
    return [
        heartbeat(vm("web-1"), at=at[0]),
        transition("scheduled", ev, vm("web-1"), at=at[1], sequence=1),
        transition("scheduled", ev, vm("web-2"), at=at[1], sequence=1),
        hook(vm("web-1"), ev, at=at[2]),
        outcome(vm("web-1"), ev, at=at[4]),
        transition("started", started, vm("web-2"), at=at[5], sequence=2),
        transition("started", started, vm("web-1"), at=at[5], sequence=2),
        transition("completed", started, vm("web-1"), at=at[8], sequence=3),
    ]


async def test_history_of_an_event_and_of_a_vm_is_complete_and_in_order(ledger_url):
    messages = scenario()
    async with open_ledger(ledger_url) as ledger:
        for message in reversed(messages):  # arrival order does not matter
            assert await ledger.append(message) is Appended.NEW
        # a redelivery: recorded once
        assert await ledger.append(messages[1]) is Appended.DUPLICATE
        await ledger.append_decision(
            "EVT-7",
            Action.APPROVE.value,
            "user-initiated (EventSource User)",
            policy="user_initiated",
            decided_by="approver",
            target="web-1",
            event_type="Reboot",
            at=T0 + timedelta(seconds=3),
        )
        # a wait names no target: it still belongs to the timeline of each VM of the event
        await ledger.append_decision(
            "EVT-7",
            Action.WAIT.value,
            "another VM of the group is down",
            policy="max_unavailable",
            decided_by="approver",
            event_type="Reboot",
            at=T0 + timedelta(seconds=2, milliseconds=500),
        )
        assert await ledger.count() == len(messages)
        by_event = await ledger.history(event_id="EVT-7")
        by_vm = await ledger.history(vm="WEB-1")
    kinds = [e.kind for e in by_event]
    assert len(by_event) == 9  # 7 messages about the event and the two decisions
    assert kinds[:2] == ["scheduled", "scheduled"]
    assert kinds[2:6] == ["hook.completed", "decision.wait", "decision.approve", "approval.applied"]
    assert sorted(kinds[6:8]) == ["started", "started"]
    assert kinds[8] == "completed"
    assert [e.kind for e in by_vm] == [
        "agent.heartbeat",
        "scheduled",
        "hook.completed",
        "decision.wait",
        "decision.approve",
        "approval.applied",
        "started",
        "completed",
    ]
    assert by_event[4].body["reason"].startswith("user-initiated")


async def test_the_ledger_refuses_updates_and_deletes(tmp_path):
    import sqlite3

    path = tmp_path / "audit.db"
    async with open_ledger(str(path)) as ledger:
        await ledger.append(scenario()[0])
    with contextlib.closing(sqlite3.connect(path)) as db:
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            db.execute("DELETE FROM ledger_messages")
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            db.execute("UPDATE ledger_messages SET vm = 'x'")


@pytest.mark.postgres
async def test_postgres_refuses_updates_too(postgres_url):
    import asyncpg

    async with open_ledger(postgres_url) as ledger:
        await ledger.append(scenario()[0])
    conn = await asyncpg.connect(postgres_url)
    try:
        with pytest.raises(asyncpg.RaiseError, match="append-only"):
            await conn.execute("DELETE FROM ledger_messages")
    finally:
        await conn.close()


def test_history_command_prints_for_people_and_for_machines(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'a.db'}"

    async def fill() -> None:
        async with open_ledger(url) as ledger:
            for message in scenario():
                await ledger.append(message)

    asyncio.run(fill())
    assert main(["audit", "history", "--db", url, "--event", "EVT-7"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == "timeline of event EVT-7 (7 entries, UTC):"
    assert "2025-01-06 12:00:01  web-1" in lines[1]
    assert "scheduled" in lines[1]
    assert "NotBefore" in lines[1]
    assert "by User" in lines[1]
    assert "hook drain.sh on scheduled: exit 0" in text
    assert "approval by approver applied" in text
    assert "Started -> gone" in lines[-1]
    assert main(["audit", "--db", url, "history", "--vm", "web-2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["kind"] for d in data] == ["scheduled", "started"]
    assert data[0]["body"]["data"]["vm"]["name"] == "web-2"
    assert main(["audit", "history", "--db", url, "--vm", "nobody"]) == 0
    assert "nothing recorded for VM nobody" in capsys.readouterr().out


def test_a_bad_database_url_is_a_config_error(capsys):
    assert main(["audit", "history", "--db", "mysql://x/y", "--vm", "a"]) == 2
    assert "is not understood" in capsys.readouterr().err


def test_an_sqlite_too_old_for_the_ledger_is_a_config_error(tmp_path, monkeypatch, capsys):
    """The ledger's INSERT needs SQLite 3.35 (RETURNING). An older library (a Python built
    against an old system SQLite) is refused at start with what to do, not at the first
    message. The version is patched: no older SQLite can be loaded here."""
    import sqlite3

    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 31, 1))
    monkeypatch.setattr(sqlite3, "sqlite_version", "3.31.1")
    db = f"sqlite:///{tmp_path / 'audit.db'}"
    assert main(["audit", "history", "--db", db, "--vm", "a"]) == 2
    err = capsys.readouterr().err
    assert "SQLite is 3.31.1" in err
    assert "3.35.0 or later" in err


async def test_the_audit_keeps_each_message_as_received_newer_minor_versions_included(tmp_path):
    """A newer minor version of the contract may add fields to a known message and add message
    types; the audit stores each message's bytes exactly as received (what this version does
    not know survives in the ledger) and records the new types instead of skipping them."""
    import dataclasses
    import uuid

    from consumers._audit_service import AuditService
    from schemas.channels import TYPE_PREFIX
    from schemas.transport import MemoryTransport
    from schemas.wire import lifecycle_message

    scheduled = transition("scheduled", event("EVT-N", resources=("web-1",)), vm("web-1"), at=T0)
    known = json.loads(scheduled.to_bytes())
    known["schemaversion"] = "1.9"
    known["data"]["drain"] = {"deadline": "2035-01-01T00:00:00Z", "added_in": "1.9"}
    newer = dict(known, id="newer-1", type=f"{TYPE_PREFIX}.agent.drained", data={"why": "1.9"})
    bodies = [json.dumps(known).encode(), json.dumps(newer).encode()]
    async with (
        MemoryTransport(f"audit-{uuid.uuid4().hex}") as transport,
        open_ledger(f"sqlite:///{tmp_path / 'audit.db'}") as ledger,
    ):
        service = AuditService(transport, ledger)
        await transport.declare_group("audit")
        outgoing = lifecycle_message(scheduled)
        for body, message_id in zip(bodies, (known["id"], "newer-1"), strict=True):
            await transport.publish(dataclasses.replace(outgoing, body=body, message_id=message_id))
        runner = asyncio.create_task(service.run())
        async with asyncio.timeout(10):
            while await ledger.count() < 2:  # noqa: ASYNC110 - the ledger is the outcome
                await asyncio.sleep(0.05)
        service.stop()
        await asyncio.wait_for(runner, 5)
        rows = await ledger.db.fetch(
            "SELECT message_id, kind, raw FROM ledger_messages ORDER BY position"
        )
    assert [(row[0], row[1]) for row in rows] == [
        (known["id"], "scheduled"),
        ("newer-1", "agent.drained"),
    ]
    assert [bytes(row[2]) for row in rows] == bodies
    assert service.stream.stats.dead_lettered == 0


@pytest.fixture(params=["memory", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
async def audit_transport(request):
    """The in-memory transport, or the real RabbitMQ with names of this test's own."""
    import uuid

    from schemas.channels import ChannelNames
    from schemas.transport import MemoryTransport, open_transport

    if request.param == "memory":
        async with MemoryTransport(f"audit-{uuid.uuid4().hex}") as transport:
            yield transport
        return
    from schemas.transport.rabbitmq import RabbitMQTransport

    channels = ChannelNames().suffixed(request.getfixturevalue("unique"))
    async with open_transport(request.getfixturevalue("amqp_url"), channels) as transport:
        assert isinstance(transport, RabbitMQTransport)
        try:
            yield transport
        finally:
            await transport.delete_topology(groups=["audit"], exchanges=True)


async def test_a_message_contradicting_the_ledger_is_dead_lettered_and_its_burst_recorded(
    ledger_url, audit_transport
):
    """The ledger recorded a message in an earlier run of the audit (no dedupe window remembers
    it now). A message under its id with other content is dead-lettered (``id-conflict``) and
    never recorded, wherever it falls in a burst; an exact copy is acked and recorded once; the
    messages around them are all recorded, the original's bytes unchanged."""
    import dataclasses

    from consumers._audit_service import AuditService
    from consumers._stream import DeadLetterReason
    from schemas.transport import DEAD_LETTER_REASON
    from schemas.wire import lifecycle_message

    messages = scenario()
    original = messages[1]
    altered = json.loads(original.to_bytes())
    altered["data"]["event"]["EventType"] = "Redeploy"
    forged = dataclasses.replace(
        lifecycle_message(original), body=json.dumps(altered).encode(), message_id=original.id
    )
    transport = audit_transport
    async with open_ledger(ledger_url) as ledger:
        assert await ledger.append(original) is Appended.NEW
        await transport.declare_group("audit")
        await transport.publish(lifecycle_message(messages[0]))
        await transport.publish(forged)
        for message in messages[1:]:
            await transport.publish(lifecycle_message(message))
        service = AuditService(transport, ledger)
        runner = asyncio.create_task(service.run())
        async with transport.dead_letters("audit") as dead:
            async with asyncio.timeout(10):
                letter = await anext(aiter(dead))
                await letter.ack()
                while await ledger.count() < len(messages):  # noqa: ASYNC110 - the ledger
                    await asyncio.sleep(0.05)
        service.stop()
        await asyncio.wait_for(runner, 5)
        rows = await ledger.db.fetch("SELECT message_id, raw FROM ledger_messages")
    assert letter.body == forged.body
    assert service.stream.stats.dead_lettered == 1
    assert letter.properties[DEAD_LETTER_REASON] == DeadLetterReason.ID_CONFLICT
    assert sorted(row[0] for row in rows) == sorted(m.id for m in messages)
    stored = {row[0]: bytes(row[1]) for row in rows}
    assert stored[original.id] == original.to_bytes()
    # Counted once: by the ledger's check, or by the stream's window when the original's copy
    # was kept first (which one depends on where the batches fell).
    assert service.conflicts + service.stream.stats.conflicts == 1
    assert service.appended == len(messages) - 1


async def _stop_while_committing(tmp_path, commit, *, stop_grace: float = 10.0):
    """The audit over the scenario's messages on the in-memory transport, its commit replaced
    by ``commit(service)``, run until it stops: (messages, rows stored, messages left queued)."""
    import uuid

    from consumers._audit_service import AuditService
    from schemas.transport import MemoryTransport
    from schemas.wire import lifecycle_message

    class Audit(AuditService):
        async def commit(self) -> None:
            await commit(self)

    messages = scenario()
    async with (
        MemoryTransport(f"audit-{uuid.uuid4().hex}") as transport,
        open_ledger(f"sqlite:///{tmp_path / 'audit.db'}") as ledger,
    ):
        await transport.declare_group("audit")
        for message in messages:
            await transport.publish(lifecycle_message(message))
        service = Audit(transport, ledger)
        service.stream.stop_grace = stop_grace
        await asyncio.wait_for(service.run(), 10)
        return messages, await ledger.count(), transport.broker.depth("audit")


async def test_a_stop_during_a_commit_lets_it_finish_and_acks_its_batch(tmp_path):
    """The audit is stopped while it commits what it handled (the stop comes from inside the
    commit here, so it is always under way): the commit finishes, the batch is acked, and
    nothing is left for the next start to handle again. Before, the stop cancelled the
    commit half done; its messages went back to the queue unacked."""
    from consumers._audit_service import AuditService

    async def stopped_while_committing(service):
        service.stop()
        await AuditService.commit(service)

    messages, stored, left = await _stop_while_committing(tmp_path, stopped_while_committing)
    assert stored == len(messages)
    assert left == 0


async def test_a_stop_waits_for_a_hung_commit_only_so_long(tmp_path):
    """The database stops answering during a commit and the audit is stopped: the stop waits
    for the commit ``stop_grace`` seconds, then ends without it, and the batch goes back to the
    queue unacked for the next start. Before, the stop waited for ever."""

    async def hung(service):
        service.stop()
        await asyncio.Event().wait()  # the database never answers

    messages, stored, left = await _stop_while_committing(tmp_path, hung, stop_grace=0.5)
    assert stored == 0
    assert left == len(messages)


async def test_a_message_under_an_id_another_vm_used_first_is_recorded_too(ledger_url):
    """Ids are the senders' own, and a VM can compute another's (they are derived from what a
    message says). A VM that records a message under another VM's id first must not keep that
    VM's own message out of the ledger: each VM's messages are told apart by the VM and the id,
    as the stream's dedupe window tells them apart."""
    messages = scenario()
    own = messages[2]  # web-2's scheduled
    squatter = messages[1].model_copy(update={"id": own.id})  # web-1's, under web-2's id
    async with open_ledger(ledger_url) as ledger:
        assert await ledger.append(squatter) is Appended.NEW
        assert await ledger.append(own) is Appended.NEW
        assert await ledger.append(own) is Appended.DUPLICATE  # a copy is still a copy
        web2 = await ledger.history(vm="web-2")
        web1 = await ledger.history(vm="WEB-1")
    assert [(e.kind, e.message_id) for e in web2 if e.record == "message"] == [
        ("scheduled", own.id)
    ]
    assert [(e.kind, e.message_id) for e in web1 if e.record == "message"] == [
        ("scheduled", own.id)
    ]


async def test_keys_at_the_contracts_longest_are_stored_and_one_longer_is_refused(ledger_url):
    """Names and ids are keys the ledger indexes, and PostgreSQL refuses an index entry over
    about 2.7 KB: one message with a few KB of subject made its whole batch unstorable, and the
    batch came back with it again and again. The contract bounds every such key
    (``MAX_KEY_LENGTH`` characters); at that bound, in 4-byte characters, they are stored."""
    longest = MAX_KEY_LENGTH
    name = "\U0001d519" * longest  # 4 bytes in UTF-8 each
    ev = event("\U0001d508" * longest, resources=(name,))
    identity = vm(name)
    messages: list[LifecycleMessage] = [
        transition("scheduled", ev, identity).model_copy(update={"id": "\U0001d526" * longest}),
        hook(identity, ev).model_copy(update={"id": "\U0001d527" * longest}),
        outcome(identity, ev),
    ]
    async with open_ledger(ledger_url) as ledger:
        for message in messages:
            assert await ledger.append(message) is Appended.NEW
        history = await ledger.history(event_id=ev.event_id)
    assert len([e for e in history if e.record == "message"]) == 3
    too_long = json.loads(messages[0].to_bytes())
    too_long["id"] = "x" * (longest + 1)
    with pytest.raises(SchemaError, match="at most 200 characters"):
        decode(json.dumps(too_long).encode())


async def test_a_vm_message_never_reads_as_a_decision_in_the_history(tmp_path):
    """A message of a type this version does not know is kept whole by the audit, its kind the
    type without the prefix; the ledger's decisions have kinds ``decision.<action>``. A VM's
    message typed ``...decision.approve`` printed in ``audit history`` exactly as an approver's
    decision no approver made. Such a type is refused: dead-lettered, not recorded."""
    envelope = json.loads(heartbeat(vm("approver"), at=T0).to_bytes())
    envelope.update(type="io.github.scheduledeventsrelay.decision.approve", id="forged-1")
    envelope["data"].update(reason="user-initiated", policy="user_initiated", target="web-1")
    with pytest.raises(SchemaError, match="names a decision"):
        decode_newer(json.dumps(envelope).encode())
    envelope["type"] = "io.github.scheduledeventsrelay.decisions-log.kept"  # not one: kept
    message = decode_newer(json.dumps(envelope).encode())
    async with open_ledger(f"sqlite:///{tmp_path / 'a.db'}") as ledger:
        assert await ledger.append(message) is Appended.NEW


async def test_a_trickle_is_stored_in_a_few_appends_not_one_for_every_few_messages(tmp_path):
    """The audit is on no decision's way: it lets what it handled wait a quarter of a second
    for more before it stores and acks it. A wave reaches it a few messages at a time (the
    agents detect their events over a poll interval) and it stored each few in a write of its
    own (in a 10,000-VM wave 8,075 of them, each a commit to disk and a trip to the database's
    thread), on the CPU the approver needed beside it."""
    import uuid

    from consumers._audit_service import AuditService
    from schemas.transport import MemoryTransport
    from schemas.wire import lifecycle_message

    async with (
        MemoryTransport(f"audit-{uuid.uuid4().hex}") as transport,
        open_ledger(f"sqlite:///{tmp_path / 'audit.db'}") as ledger,
    ):
        service = AuditService(transport, ledger)
        await transport.declare_group("audit")
        appends: list[int] = []
        append_many = ledger.append_many

        async def counted(batch):
            appends.append(len(batch))
            return await append_many(batch)

        ledger.append_many = counted  # type: ignore[method-assign]
        runner = asyncio.create_task(service.run())
        try:
            for index in range(60):  # two every 20 ms, for 0.6 s
                await transport.publish(lifecycle_message(heartbeat(vm(f"web-{index}"))))
                if index % 2:
                    await asyncio.sleep(0.02)
            async with asyncio.timeout(10):
                while await ledger.count() < 60:  # noqa: ASYNC110 - the ledger is the outcome
                    await asyncio.sleep(0.05)
        finally:
            service.stop()
            await asyncio.wait_for(runner, 5)
        assert transport.broker.depth("audit") == 0  # every one acked
    assert sum(appends) == 60
    assert len(appends) <= 6, f"{len(appends)} appends of {appends}"
