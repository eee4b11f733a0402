"""A message whose handling fails part way in the approver (a database read that fails, a
defect) is retried by the stream, then dead-lettered after its attempts. The fleet view takes a
message whole (``FleetView.take``) before the approver decides on it, and gives it back when
the handling fails: a dead-lettered message is one the approver did not take, in its view as
in its database, and a retry takes it anew. What the failed try was deciding (the held events a
capacity change released, the approvals it signed, the decisions for the ledger) must be
decided again, and recorded, all the same, and never approved beyond what the policy allows
given the messages taken."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import pytest

from consumers import _approver
from consumers._approver import ApproverService
from consumers._audit import open_ledger
from consumers._db import DatabaseError
from consumers._fleet import EventState, FleetView
from consumers._policies import PolicySet, Verdict, parse_policy
from schemas import Approval
from schemas.approvals import generate_signing_key
from schemas.messages import LifecycleMessage
from schemas.transport import MemoryTransport
from schemas.wire import lifecycle_message

from ._factory import event, heartbeat, outcome, transition, vm


async def _approvals(transport: MemoryTransport, name: str, within: float) -> list[Approval]:
    """Every approval VM ``name`` receives within ``within`` seconds."""
    got: list[Approval] = []
    with contextlib.suppress(TimeoutError):
        async with transport.approvals(name) as sub, asyncio.timeout(within):
            async for delivery in sub:
                await delivery.ack()
                got.append(Approval.from_bytes(delivery.body))
    return got


async def _handled(service: ApproverService, count: int) -> None:
    """Wait until the stream settled ``count`` messages (handled or dead-lettered)."""
    stats = service.stream.stats
    async with asyncio.timeout(10):
        while stats.handled + stats.dead_lettered < count:  # noqa: ASYNC110 - its counters
            await asyncio.sleep(0.01)


class _HoldsReadFails:
    """The database's next read of the operators' holds fails once armed (injected: a database
    that drops a connection, or times out, now and then; nothing else about the database is
    changed). The read is the approver's hold check, made at the first approval of each
    batch."""

    def __init__(self, db: Any) -> None:
        self.fetch = db.fetch
        self.armed = False
        self.failed = 0
        db.fetch = self

    def arm(self) -> None:
        self.armed = True

    async def __call__(self, sql: str, *args: object) -> Any:
        if self.armed and "FROM approver_holds" in sql:
            self.armed = False
            self.failed += 1
            raise DatabaseError("injected: the connection to the database was lost")
        return await self.fetch(sql, *args)


def _cap(count: int) -> PolicySet:
    return parse_policy(
        {
            "approve": {"user_initiated": {}},
            "max_unavailable": {"group_by": "scale_set", "count": count},
        }
    )


async def _publish(transport: MemoryTransport, *messages: LifecycleMessage) -> None:
    for message in messages:
        await transport.publish(lifecycle_message(message))


async def test_a_held_event_is_approved_on_the_retry_after_the_hold_check_failed(
    state_url, monkeypatch
):
    """Scale set S, at most one VM down. EVT-A runs on web-1, so EVT-B on web-2 waits. web-1's
    ``completed`` frees S's slot; deciding EVT-B again, the hold check's database read fails
    (injected, once). The stream retries the message, but the view had taken it on the failed
    try: the retry found no change of who is down, decided nothing, and EVT-B waited for its
    NotBefore with room in S (the operator saw one 'failed (attempt 1 of 5), retrying' and no
    approval). Now the retry decides again what the failed try left undecided: EVT-B is
    approved, once."""
    # Housekeeping reads the holds every second too; an hour apart, the one injected failure
    # is the hold check of the handler, the step under test.
    monkeypatch.setattr(_approver, "HOUSEKEEPING_SECONDS", 3600.0)
    now = datetime.now(UTC)
    later = now + timedelta(minutes=15)
    web1, web2 = vm("web-1", scale_set="S"), vm("web-2", scale_set="S")
    a = event("EVT-A", source="User", resources=("web-1",), not_before=later)
    a_started = event("EVT-A", source="User", status="Started", resources=("web-1",))
    b = event("EVT-B", source="User", resources=("web-2",), not_before=later)
    ledger = open_ledger(state_url)
    async with MemoryTransport(f"retry-{uuid.uuid4().hex}") as transport, ledger:
        holds = _HoldsReadFails(ledger.db)
        service = ApproverService(transport, generate_signing_key(), _cap(1), db=ledger.db)
        await transport.declare_group("approver")
        runner = asyncio.create_task(service.run())
        try:
            await _publish(
                transport,
                heartbeat(web1, at=now),
                heartbeat(web2, at=now),
                transition("scheduled", a, web1, at=now),
            )
            assert [x.event_id for x in await _approvals(transport, "web-1", 2)] == ["EVT-A"]
            await _publish(
                transport,
                transition("scheduled", b, web2, at=now),
                transition("started", a_started, web1, at=now + timedelta(seconds=1)),
            )
            await _handled(service, 5)
            assert await _approvals(transport, "web-2", 0.3) == []  # S is full
            holds.arm()
            done = transition("completed", a_started, web1, at=now + timedelta(seconds=2))
            await _publish(transport, done)
            got = await _approvals(transport, "web-2", 3)
        finally:
            service.stop()
            await asyncio.wait_for(runner, 5)
        rows = await ledger.db.fetch(
            "SELECT event_id, count(*) FROM approver_approvals GROUP BY event_id"
        )
    assert holds.failed == 1
    assert service.stream.stats.retried == 1
    assert service.stream.stats.dead_lettered == 0
    assert [x.event_id for x in got] == ["EVT-B"], "EVT-B left to NotBefore with room in S"
    assert sorted(rows) == [("EVT-A", 1), ("EVT-B", 1)]
    state = service.fleet.event("EVT-A")
    assert state is not None
    assert state.completed
    assert service.fleet.down_in("scale_set", "S") == {"web-2"}


@pytest.mark.parametrize("attempts", [5, 1], ids=["retried", "dead-lettered"])
async def test_an_approval_signed_before_the_handling_failed_is_decided_again(
    monkeypatch, attempts
):
    """Without a database. Scale set S, at most two VMs down. EVT-A runs on web-1 and web-2, so
    EVT-B (web-3) and EVT-C (web-4) wait. EVT-A's end frees both slots: EVT-B's approval is
    signed, then signing EVT-C's fails (injected, once: a defect; no real input is known to
    make signing fail). The failed try's approvals are never sent (its handling did not
    finish), but the view kept EVT-B's as out: its retry found EVT-B approved already and no
    change to decide on, so neither went out, and web-3 counted as down, until NotBefore. Now
    both are decided again: one approval each, and no more than the cap. Retried, the
    message's retry decides them. Dead-lettered at once (a stream allowed one attempt), the
    message is one the approver did not take: EVT-A still runs on web-2 as far as it knows,
    so S has no room and nothing goes out (before, housekeeping approved both on the end it
    had dead-lettered), until the dead letter is sent again."""
    if attempts > 1:  # the retry decides, not housekeeping
        monkeypatch.setattr(_approver, "HOUSEKEEPING_SECONDS", 3600.0)
    now = datetime.now(UTC)
    later = now + timedelta(minutes=15)
    web1, web2, web3, web4 = (vm(f"web-{n}", scale_set="S") for n in (1, 2, 3, 4))
    a = event("EVT-A", source="User", resources=("web-1", "web-2"), not_before=later)
    a_started = event("EVT-A", source="User", status="Started", resources=("web-1", "web-2"))
    b = event("EVT-B", source="User", resources=("web-3",), not_before=later)
    c = event("EVT-C", source="User", resources=("web-4",), not_before=later)
    async with MemoryTransport(f"retry-{uuid.uuid4().hex}") as transport:
        service = ApproverService(transport, generate_signing_key(), _cap(2))
        service.stream.max_attempts = attempts
        prepare = service.sender.prepare
        failures: list[str] = []

        def prepare_failing_once_for_c(event_id: str, *args: Any, **kwargs: Any) -> Any:
            if event_id == "EVT-C" and not failures:
                failures.append(event_id)
                raise RuntimeError("injected: signing the approval failed")
            return prepare(event_id, *args, **kwargs)

        monkeypatch.setattr(service.sender, "prepare", prepare_failing_once_for_c)
        await transport.declare_group("approver")
        runner = asyncio.create_task(service.run())
        try:
            beats = [heartbeat(who, at=now) for who in (web1, web2, web3, web4)]
            await _publish(transport, *beats, transition("scheduled", a, web1, at=now))
            assert [x.event_id for x in await _approvals(transport, "web-1", 2)] == ["EVT-A"]
            soon = now + timedelta(seconds=1)
            await _publish(
                transport,
                transition("scheduled", b, web3, at=now),
                transition("scheduled", c, web4, at=now),
                transition("started", a_started, web1, at=soon),
                transition("started", a_started, web2, at=soon),
                transition("completed", a_started, web1, at=soon),
            )
            await _handled(service, 10)
            assert service.fleet.down_in("scale_set", "S") == {"web-1", "web-2"}
            done = transition("completed", a_started, web2, at=now + timedelta(seconds=2))
            await _publish(transport, done)  # the last VM of EVT-A: over, S has room for two
            if attempts == 1:
                await _handled(service, 11)
                assert await _approvals(transport, "web-3", 1.5) == []  # housekeeping ran
                assert await _approvals(transport, "web-4", 0.1) == []
                assert service.fleet.down_in("scale_set", "S") == {"web-1", "web-2"}
                await _publish(transport, done)  # the dead letter, sent again
            got_b = await _approvals(transport, "web-3", 3)
            got_c = await _approvals(transport, "web-4", 0.5)
        finally:
            service.stop()
            await asyncio.wait_for(runner, 5)
    assert failures == ["EVT-C"]
    stats = service.stream.stats
    assert (stats.retried, stats.dead_lettered) == ((1, 0) if attempts > 1 else (0, 1))
    assert [x.event_id for x in got_b] == ["EVT-B"], "EVT-B's approval never went out"
    assert [x.event_id for x in got_c] == ["EVT-C"]
    assert service.fleet.down_in("scale_set", "S") == {"web-3", "web-4"}


@dataclass
class _FailsOn:
    """An approve policy with a defect (injected): once armed, deciding ``event_id`` raises."""

    event_id: str
    armed: bool = False
    calls: int = 0
    #: Disarmed once it failed.
    once: bool = False
    role: ClassVar[str] = "approve"
    name: str = "failing"

    def evaluate(self, event: EventState, fleet: FleetView, now: datetime) -> Verdict | None:
        if self.armed and event.event_id == self.event_id:
            self.calls += 1
            self.armed = not self.once
            raise RuntimeError(f"injected: a defect deciding {event.event_id}")
        return None


async def test_a_defect_deciding_a_released_event_costs_that_event_not_the_messages_after_it(
    monkeypatch, caplog
):
    """Scale set S, at most one VM down; EVT-A runs on web-1, EVT-B (web-2) waits. When EVT-A
    ends, deciding EVT-B fails, every time (a policy's defect, injected). What the failed
    handling left undecided is decided again before each next message, and fails again: that
    costs EVT-B (given up after a few attempts, with an error naming it), never the messages:
    web-1's ``completed`` is handled on its retry, and the heartbeats after it at once. Before,
    the retry found nothing left to decide, and EVT-B was left to NotBefore without a word."""
    monkeypatch.setattr(_approver, "HOUSEKEEPING_SECONDS", 3600.0)
    now = datetime.now(UTC)
    later = now + timedelta(minutes=15)
    web1, web2 = vm("web-1", scale_set="S"), vm("web-2", scale_set="S")
    a = event("EVT-A", source="User", resources=("web-1",), not_before=later)
    a_started = event("EVT-A", source="User", status="Started", resources=("web-1",))
    b = event("EVT-B", source="User", resources=("web-2",), not_before=later)
    failing = _FailsOn("EVT-B")
    policies = PolicySet((failing, *_cap(1).policies))
    async with MemoryTransport(f"retry-{uuid.uuid4().hex}") as transport:
        service = ApproverService(transport, generate_signing_key(), policies)
        await transport.declare_group("approver")
        runner = asyncio.create_task(service.run())
        try:
            await _publish(
                transport,
                heartbeat(web1, at=now),
                heartbeat(web2, at=now),
                transition("scheduled", a, web1, at=now),
            )
            assert [x.event_id for x in await _approvals(transport, "web-1", 2)] == ["EVT-A"]
            soon = now + timedelta(seconds=1)
            await _publish(
                transport,
                transition("scheduled", b, web2, at=now),
                transition("started", a_started, web1, at=soon),
            )
            await _handled(service, 5)
            failing.armed = True
            with caplog.at_level(logging.WARNING, logger="consumers"):
                done = transition("completed", a_started, web1, at=now + timedelta(seconds=2))
                await _publish(transport, done)
                await _handled(service, 6)
                for n in range(8):
                    at = now + timedelta(seconds=3 + n)
                    await _publish(transport, heartbeat(web1, at=at))
                await _handled(service, 14)
            got = await _approvals(transport, "web-2", 0.3)
        finally:
            service.stop()
            await asyncio.wait_for(runner, 5)
    stats = service.stream.stats
    assert (stats.handled, stats.retried, stats.dead_lettered) == (14, 1, 0)
    assert got == []
    assert failing.calls == 1 + _approver.MAX_OWED_ATTEMPTS  # the message's try, then owed
    given_up = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(given_up) == 1
    assert "EVT-B" in given_up[0]
    assert "given up" in given_up[0]


async def test_a_wait_decided_before_the_hold_check_failed_is_in_the_ledger(state_url, monkeypatch):
    """Scale set S, at most two VMs down; EVT-A (web-1) and EVT-D (web-5) run. EVT-B needs two
    VMs (web-2, web-3) and waits: four would be down. EVT-C (web-4) waits: three would be.
    EVT-A's end frees one slot, and both are decided again in that order: EVT-B still waits
    (three would be down now: a new decision), then EVT-C is approved, but the hold check's
    database read fails (injected, once). EVT-B's new decision was taken as recorded when it
    was made, so on the retry, deciding the same again, it was never written: ``audit history``
    showed EVT-B waiting for four VMs while it waited for three. Now a decision counts as
    recorded only once the handling that made it went through."""
    monkeypatch.setattr(_approver, "HOUSEKEEPING_SECONDS", 3600.0)
    now = datetime.now(UTC)
    later = now + timedelta(minutes=15)
    web = {n: vm(f"web-{n}", scale_set="S") for n in range(1, 6)}
    a = event("EVT-A", source="User", resources=("web-1",), not_before=later)
    a_started = event("EVT-A", source="User", status="Started", resources=("web-1",))
    d = event("EVT-D", source="User", resources=("web-5",), not_before=later)
    b = event("EVT-B", source="User", resources=("web-2", "web-3"), not_before=later)
    c = event("EVT-C", source="User", resources=("web-4",), not_before=later)
    ledger = open_ledger(state_url)
    async with MemoryTransport(f"retry-{uuid.uuid4().hex}") as transport, ledger:
        holds = _HoldsReadFails(ledger.db)
        service = ApproverService(transport, generate_signing_key(), _cap(2), db=ledger.db)
        await transport.declare_group("approver")
        runner = asyncio.create_task(service.run())
        try:
            beats = [heartbeat(who, at=now) for who in web.values()]
            await _publish(
                transport,
                *beats,
                transition("scheduled", a, web[1], at=now),
                transition("scheduled", d, web[5], at=now),
            )
            assert [x.event_id for x in await _approvals(transport, "web-1", 2)] == ["EVT-A"]
            assert [x.event_id for x in await _approvals(transport, "web-5", 2)] == ["EVT-D"]
            soon = now + timedelta(seconds=1)
            await _publish(
                transport,
                transition("scheduled", b, web[2], at=now),
                transition("scheduled", c, web[4], at=now),
                transition("started", a_started, web[1], at=soon),
            )
            await _handled(service, 10)
            holds.arm()
            done = transition("completed", a_started, web[1], at=now + timedelta(seconds=2))
            await _publish(transport, done)
            got = await _approvals(transport, "web-4", 3)
        finally:
            service.stop()
            await asyncio.wait_for(runner, 5)
        history = await ledger.history(event_id="EVT-B")
    assert holds.failed == 1
    assert service.stream.stats.retried == 1
    assert [x.event_id for x in got] == ["EVT-C"]
    waits = [entry.body["reason"] for entry in history if entry.kind == "decision.wait"]
    assert [reason.split(", but ")[-1] for reason in waits] == [
        "4 VMs of scale_set=S would be unavailable (at most 2)",
        "3 VMs of scale_set=S would be unavailable (at most 2)",
    ]


class _DatabaseDown:
    """The database goes away, once armed, at the approver's next read of the operators' holds
    (the hold check of an approval it is about to sign), and answers no read or write until
    :meth:`restore` (injected: a database restarting or cut off for a few seconds; nothing
    else about it is changed). Every try of the message being handled then fails, and the
    stream dead-letters it after its attempts."""

    def __init__(self, db: Any) -> None:
        self.fetch, self.fetchone, self.write = db.fetch, db.fetchone, db.write
        self.armed = self.down = False
        self.refused = 0
        db.fetch = self._call(self.fetch, holds=True)
        db.fetchone = self._call(self.fetchone)
        db.write = self._call(self.write)

    def _call(self, method: Any, *, holds: bool = False) -> Any:
        async def call(sql: Any, *args: Any, **kwargs: Any) -> Any:
            if self.armed and holds and "FROM approver_holds" in sql:
                self.armed, self.down = False, True
            if self.down:
                self.refused += 1
                raise DatabaseError("injected: the database is unreachable")
            return await method(sql, *args, **kwargs)

        return call

    def restore(self) -> None:
        self.down = False


async def _committed(ledger: Any, messages: int) -> None:
    """Wait until the approver's state holds ``messages`` messages (their batch committed)."""
    async with asyncio.timeout(10):
        while True:
            row = await ledger.db.fetchone("SELECT count(*) FROM approver_messages")
            if row is not None and row[0] >= messages:
                return
            await asyncio.sleep(0.02)


async def _dead_lettered(service: ApproverService, count: int) -> None:
    async with asyncio.timeout(20):
        while service.stream.stats.dead_lettered < count:  # noqa: ASYNC110 - its counters
            await asyncio.sleep(0.02)


async def test_a_dead_lettered_scheduled_event_is_not_approved_to_be_forgotten_at_a_restart(
    state_url,
):
    """Scale set S, at most one VM down. EVT-A (web-1, a user's reboot) is reported; deciding
    it, the hold check finds the database gone, and it stays gone through the message's five
    tries: the stream dead-letters the message, so the state in the database never has it.
    The live view kept it all the same: once the database was back, housekeeping decided the
    owed EVT-A and approved it, a decision resting on a message the approver had not taken.
    After a restart the approver, rebuilt from the database, knows no EVT-A (the stored
    approval of an event it does not know is skipped), counts web-1 as available and approves
    EVT-B on web-2: two VMs of S approved at once under a cap of one. A dead-lettered message
    is one the approver did not take, in the live view as in the database: EVT-A is not
    approved (NotBefore applies, or an operator sends the dead letter again), EVT-B is."""
    now = datetime.now(UTC)
    later = now + timedelta(minutes=15)
    web1, web2 = vm("web-1", scale_set="S"), vm("web-2", scale_set="S")
    a = event("EVT-A", source="User", resources=("web-1",), not_before=later)
    b = event("EVT-B", source="User", resources=("web-2",), not_before=later)
    key = generate_signing_key()
    ledger = open_ledger(state_url)
    async with MemoryTransport(f"dead-{uuid.uuid4().hex}") as transport, ledger:
        database = _DatabaseDown(ledger.db)
        await transport.declare_group("approver")
        first = ApproverService(transport, key, _cap(1), db=ledger.db)
        runner = asyncio.create_task(first.run())
        try:
            await _publish(transport, heartbeat(web1, at=now), heartbeat(web2, at=now))
            await _committed(ledger, 2)
            database.armed = True
            await _publish(transport, transition("scheduled", a, web1, at=now))
            await _dead_lettered(first, 1)
            database.restore()
            got_a = await _approvals(transport, "web-1", 2.5)  # housekeeping: every second
        finally:
            first.stop()
            await asyncio.wait_for(runner, 5)
        restarted = ApproverService(transport, key, _cap(1), db=ledger.db)
        runner = asyncio.create_task(restarted.run())
        try:
            await _publish(transport, transition("scheduled", b, web2, at=now))
            got_b = await _approvals(transport, "web-2", 2)
        finally:
            restarted.stop()
            await asyncio.wait_for(runner, 5)
    assert database.refused >= first.stream.max_attempts
    assert first.stream.stats.dead_lettered == 1
    approved = [x.event_id for x in (*got_a, *got_b)]
    assert approved == ["EVT-B"], f"{approved}: approved from a dead-lettered message"


async def test_a_dead_lettered_completed_frees_no_room_live_nor_after_a_restart(state_url):
    """Scale set S, at most one VM down. EVT-A runs on web-1, so EVT-B (web-2) waits. web-1's
    ``completed`` frees S; deciding EVT-B, the hold check finds the database gone, and it stays
    gone through the message's five tries: the stream dead-letters it, and the state in the
    database never has it. The live view kept it: once the database was back, housekeeping
    approved EVT-B, while the approver rebuilt from the database after a restart has EVT-A
    still running on web-1, and web-2 approved beside it: over the cap by the messages it
    took, and S full for every later event until EVT-A expires. A dead-lettered message is one
    the approver did not take: live as after the restart, web-1 is down and EVT-B waits; the
    dead letter sent again (an operator moving it back) is taken then, and EVT-B approved."""
    now = datetime.now(UTC)
    later = now + timedelta(minutes=15)
    web1, web2 = vm("web-1", scale_set="S"), vm("web-2", scale_set="S")
    a = event("EVT-A", source="User", resources=("web-1",), not_before=later)
    a_started = event("EVT-A", source="User", status="Started", resources=("web-1",))
    b = event("EVT-B", source="User", resources=("web-2",), not_before=later)
    done = transition("completed", a_started, web1, at=now + timedelta(seconds=2))
    key = generate_signing_key()
    ledger = open_ledger(state_url)
    async with MemoryTransport(f"dead-{uuid.uuid4().hex}") as transport, ledger:
        database = _DatabaseDown(ledger.db)
        await transport.declare_group("approver")
        first = ApproverService(transport, key, _cap(1), db=ledger.db)
        runner = asyncio.create_task(first.run())
        try:
            await _publish(
                transport,
                heartbeat(web1, at=now),
                heartbeat(web2, at=now),
                transition("scheduled", a, web1, at=now),
            )
            assert [x.event_id for x in await _approvals(transport, "web-1", 2)] == ["EVT-A"]
            await _publish(
                transport,
                transition("scheduled", b, web2, at=now),
                transition("started", a_started, web1, at=now + timedelta(seconds=1)),
            )
            await _committed(ledger, 5)
            database.armed = True
            await _publish(transport, done)
            await _dead_lettered(first, 1)
            database.restore()
            live = await _approvals(transport, "web-2", 2.5)  # housekeeping: every second
            live_down = set(first.fleet.down_in("scale_set", "S"))
        finally:
            first.stop()
            await asyncio.wait_for(runner, 5)
        restarted = ApproverService(transport, key, _cap(1), db=ledger.db)
        runner = asyncio.create_task(restarted.run())
        try:
            await _publish(transport, heartbeat(web1, at=now + timedelta(seconds=3)))
            await _handled(restarted, 1)
            restarted_down = set(restarted.fleet.down_in("scale_set", "S"))
            await _publish(transport, done)  # the dead letter, sent again
            replayed = await _approvals(transport, "web-2", 2)
        finally:
            restarted.stop()
            await asyncio.wait_for(runner, 5)
    assert database.refused >= first.stream.max_attempts
    assert first.stream.stats.dead_lettered == 1
    assert [x.event_id for x in live] == [], "EVT-B approved while, taken, web-1 still ran EVT-A"
    assert live_down == restarted_down == {"web-1"}
    assert [x.event_id for x in replayed] == ["EVT-B"]


async def test_a_refusal_whose_handling_failed_once_counts_once():
    """web-2 could not reach IMDS to apply EVT-I's approval (``imds-refused``): the approver
    lets it rest 5 s, then sends the approval again. Handling the refusal fails once, after
    the refusal was counted (a defect deciding EVT-I, injected once). The view gives the
    refusal back with the failed try, so the retry takes it anew: counted once more, it would
    have been web-2's second refusal, and its rest 10 s instead of 5."""
    now = [datetime.now(UTC)]
    failing = _FailsOn("EVT-I", once=True)
    policies = PolicySet((failing, *PolicySet.default().policies))
    ev = event("EVT-I", source="User", resources=("web-2",))
    web2 = vm("web-2")
    async with MemoryTransport(f"retry-{uuid.uuid4().hex}") as transport:
        service = ApproverService(transport, generate_signing_key(), policies, clock=lambda: now[0])
        await transport.declare_group("approver")
        runner = asyncio.create_task(service.run())
        try:
            await _publish(
                transport, heartbeat(web2, at=now[0]), transition("scheduled", ev, web2, at=now[0])
            )
            (first,) = await _approvals(transport, "web-2", 1)
            refused = outcome(web2, ev, applied=False, at=now[0], reason="imds-refused")
            refused = refused.model_copy(
                update={"data": refused.data.model_copy(update={"approval_id": first.approval_id})}
            )
            failing.armed = True
            await _publish(transport, refused)
            await _handled(service, 3)
            assert await _approvals(transport, "web-2", 0.3) == []  # resting
            now[0] += timedelta(seconds=6)  # past a first rest, not a second
            again = await _approvals(transport, "web-2", 2)
        finally:
            service.stop()
            await asyncio.wait_for(runner, 5)
    assert failing.calls == 1
    assert service.stream.stats.retried == 1
    assert [(x.event_id, x.event_version) for x in again] == [("EVT-I", first.event_version)]
