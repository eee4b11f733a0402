"""The approver service over the in-memory transport: decisions by policy, signed approvals to
the first live VM, recorded reasons, a retry elsewhere after a rejection; and the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from consumers import Action, ApprovalSender, FleetView, NoApprovalTarget, PolicySet
from consumers._approver import ApproverService
from consumers._approver_state import ApproverState
from consumers._audit import open_ledger
from consumers._cli import main
from consumers._db import DatabaseError, WriteConflict, open_database
from schemas import (
    Approval,
    ReplyAddress,
    ScheduledEvent,
    TransportError,
    VmIdentity,
    event_version,
    key_id,
    load_public_keys,
    verify,
)
from schemas.approvals import generate_signing_key
from schemas.messages import AgentMessage, LifecycleMessage, TransitionMessage, content_digest
from schemas.transport import MemoryTransport, OutgoingMessage
from schemas.wire import lifecycle_message

from ._factory import event, heartbeat, outcome, transition, vm


@pytest.fixture
async def transport():
    async with MemoryTransport(f"approver-{uuid.uuid4().hex}") as memory:
        yield memory


async def next_approval(transport, name: str, within: float = 2) -> Approval:
    async with transport.approvals(name) as sub:
        async with asyncio.timeout(within):
            async for delivery in sub:
                await delivery.ack()
                return Approval.from_bytes(delivery.body)
    raise AssertionError("unreachable")


def now_messages(*messages):
    return [lifecycle_message(m) for m in messages]


async def test_user_reboot_is_approved_on_the_first_live_vm_and_the_reason_recorded(transport):
    key = generate_signing_key()
    service = ApproverService(transport, key)
    now = datetime.now(UTC)
    ev = event("EVT-U", source="User", resources=("web-1", "web-2"))
    await transport.declare_group("approver")
    runner = asyncio.create_task(service.run())
    # web-1 is silent (no agent heard): the approval goes to web-2, the first live VM.
    for message in now_messages(
        heartbeat(vm("web-2"), at=now), transition("scheduled", ev, vm("web-2"), at=now)
    ):
        await transport.publish(message)
    approval = await next_approval(transport, "web-2")
    service.stop()
    await asyncio.wait_for(runner, 2)
    verify(approval, {key_id(key.public_key()): key.public_key()}, vm_name="web-2")
    assert approval.event_id == "EVT-U"
    assert approval.reason == "user-initiated (EventSource User)"
    [decision] = service.decisions
    assert decision.action is Action.APPROVE
    assert decision.target == "web-2"


async def test_a_platform_reboot_waits_for_not_before_and_is_recorded_once(transport):
    service = ApproverService(transport, generate_signing_key(), PolicySet.default())
    now = datetime.now(UTC)
    ev = event("EVT-P", resources=("web-1",))
    await transport.declare_group("approver")
    runner = asyncio.create_task(service.run())
    for message in now_messages(
        heartbeat(vm("web-1"), at=now),
        transition("scheduled", ev, vm("web-1"), at=now),
        heartbeat(vm("web-1"), at=now + timedelta(seconds=1)),
    ):
        await transport.publish(message)
    async with asyncio.timeout(2):
        while service.stream.stats.handled < 3:  # noqa: ASYNC110 - polls the service's counter
            await asyncio.sleep(0.01)
    service.stop()
    await asyncio.wait_for(runner, 2)
    [decision] = service.decisions
    assert decision.action is Action.WAIT
    assert "no policy approves it: NotBefore" in decision.reason
    assert transport.broker.vm("web-1").ready == type(transport.broker.vm("web-1").ready)()


async def test_a_rejected_approval_is_sent_to_another_live_vm(transport):
    service = ApproverService(transport, generate_signing_key())
    now = datetime.now(UTC)
    ev = event("EVT-R", source="User", resources=("a", "b"))
    await transport.declare_group("approver")
    runner = asyncio.create_task(service.run())
    for message in now_messages(
        heartbeat(vm("a"), at=now),
        heartbeat(vm("b"), at=now),
        transition("scheduled", ev, vm("a"), at=now),
    ):
        await transport.publish(message)
    first = await next_approval(transport, "a")
    rejected = outcome(vm("a"), ev, applied=False, at=now).model_copy(deep=True)
    rejected = rejected.model_copy(
        update={
            "data": rejected.data.model_copy(
                update={"reason": "observe-only", "approval_id": first.approval_id}
            )
        }
    )
    await transport.publish(lifecycle_message(rejected))
    second = await next_approval(transport, "b")
    service.stop()
    await asyncio.wait_for(runner, 2)
    assert first.vm == "a"
    assert second.vm == "b"


async def test_a_vm_that_could_not_reach_imds_is_sent_the_approval_again_later(transport):
    """``imds-refused``: the agent could not ask IMDS about the event (a storm of 429s, 500s
    or timeouts on that VM), which says nothing about the VM's right to apply it. The approver
    tries the same VM again after a pause, up to its cap per version; before, it excluded the
    VM for good, and a Freeze of one VM (nobody else to approve it) waited for NotBefore: 174
    of 180 after a 20 s IMDS storm in ``tests/benchmarks/faults.py``."""
    now = [datetime.now(UTC)]
    service = ApproverService(transport, generate_signing_key(), clock=lambda: now[0])
    ev = event("EVT-I", source="User", resources=("web-2",))
    await transport.declare_group("approver")
    runner = asyncio.create_task(service.run())
    for message in now_messages(
        heartbeat(vm("web-2"), at=now[0]), transition("scheduled", ev, vm("web-2"), at=now[0])
    ):
        await transport.publish(message)
    first = await next_approval(transport, "web-2")
    refused = outcome(vm("web-2"), ev, applied=False, at=now[0]).model_copy(deep=True)
    refused = refused.model_copy(
        update={
            "data": refused.data.model_copy(
                update={"reason": "imds-refused", "approval_id": first.approval_id}
            )
        }
    )
    await transport.publish(lifecycle_message(refused))
    with pytest.raises(TimeoutError):  # not at once: the VM's IMDS is in trouble right now
        await next_approval(transport, "web-2")
    waiting = service.decisions[-1]
    assert waiting.action is Action.WAIT
    assert "could not reach IMDS" in waiting.reason
    now[0] += timedelta(seconds=30)  # the pause is over
    second = await next_approval(transport, "web-2")
    service.stop()
    await asyncio.wait_for(runner, 2)
    assert second.vm == "web-2"
    assert second.approval_id != first.approval_id
    assert second.event_version == first.event_version


async def _user_reboots(transport: MemoryTransport, count: int) -> list[str]:
    """``count`` VMs (their names): each a heartbeat, then a user-initiated Reboot of its own
    reported Scheduled, waiting in the approver's queue."""
    now = datetime.now(UTC)
    names = [f"web-{n}" for n in range(count)]
    await transport.declare_group("approver")
    for name in names:
        ev = event(f"EVT-{name}", source="User", resources=(name,))
        for message in now_messages(
            heartbeat(vm(name), at=now), transition("scheduled", ev, vm(name), at=now)
        ):
            await transport.publish(message)
    return names


class _CountingSends(MemoryTransport):
    """A broker whose confirm of an approval takes a moment, counting the sends at once."""

    def __init__(self) -> None:
        super().__init__(f"approver-{uuid.uuid4().hex}")
        self.in_flight = self.most = 0

    async def send_approval(self, to: ReplyAddress, message: OutgoingMessage) -> None:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(0.05)
            await super().send_approval(to, message)
        finally:
            self.in_flight -= 1


async def test_a_wave_of_approvals_goes_out_without_waiting_for_each_confirm(tmp_path):
    """A burst of events decided in one commit (a fleet's Freeze wave): the approvals go out
    together, not each after the previous one's confirm (1,800 of them took 36 s that way in
    ``tests/benchmarks/fleet.py``), and every one arrives."""
    ledger = open_ledger(f"sqlite:///{tmp_path / 'central.db'}")
    async with _CountingSends() as counting, ledger:
        service = ApproverService(counting, generate_signing_key(), db=ledger.db)
        names = await _user_reboots(counting, 12)
        runner = asyncio.create_task(service.run())
        approvals = [await next_approval(counting, name) for name in names]
        service.stop()
        await asyncio.wait_for(runner, 5)
    assert [a.vm for a in approvals] == names
    assert counting.most > 1


async def test_an_approver_the_queue_was_taken_from_cannot_commit_over_the_one_that_took_it(
    transport, tmp_path
):
    """Two approvers of one group, one database. The broker gave the queue to the second while
    the first was still deciding (its link died; it does not know yet), and both judged the
    same Scheduled event. One approval reaches the VM, not two: the first one's commit finds
    the group's state moved on and commits nothing (so sends nothing); its next message loads
    what the other did."""
    url = f"sqlite:///{tmp_path / 'central.db'}"
    key = generate_signing_key()
    now = datetime.now(UTC)
    beat = heartbeat(vm("web-1"), at=now)
    scheduled = transition(
        "scheduled", event("EVT-T", source="User", resources=("web-1",)), vm("web-1"), at=now
    )
    ledger = open_ledger(url)
    async with ledger, open_database(url) as theirs:
        first = ApproverService(transport, key, db=ledger.db, decided_by="first")
        second = ApproverService(transport, key, db=theirs, decided_by="second")
        for message in (beat, scheduled):
            await first.handle(message)
        for message in (beat, scheduled):
            await second.handle(message)
        await second.commit()
        with pytest.raises(WriteConflict, match="took over"):
            await first.commit()
        got: list[Approval] = []
        async with transport.approvals("web-1") as approvals:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.5):
                    async for delivery in approvals:
                        await delivery.ack()
                        got.append(Approval.from_bytes(delivery.body))
        assert [(a.event_id, a.vm) for a in got] == [("EVT-T", "web-1")]
        await first.handle(heartbeat(vm("web-1"), at=now + timedelta(seconds=1)))
        await first.commit()  # it read what the other one wrote: its commit goes in
        state = first.fleet.event("EVT-T")
        assert state is not None
        assert state.sent is not None
        assert state.sent.approval_id == got[0].approval_id


async def _approvals_within(transport, name: str, seconds: float) -> list[Approval]:
    got: list[Approval] = []
    async with transport.approvals(name) as approvals:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                async for delivery in approvals:
                    await delivery.ack()
                    got.append(Approval.from_bytes(delivery.body))
    return got


async def test_a_batch_is_not_acked_when_a_commit_outside_the_stream_lost_what_it_changed(
    transport, tmp_path
):
    """The approver also commits outside the stream's batches (housekeeping: a released hold,
    a VM's pause over; the console), and such a commit takes along what the messages handled
    since the last batch changed. When it fails, those changes are gone: the batch's own
    commit must fail too (the broker delivers its messages again), or they would be acked
    with their decisions and approvals never made. Here the failure is another writer of the
    group's state (a takeover); the messages come back and the approval goes out once."""
    url = f"sqlite:///{tmp_path / 'central.db'}"
    now = datetime.now(UTC)
    beat = heartbeat(vm("web-1"), at=now)
    scheduled = transition(
        "scheduled", event("EVT-L", source="User", resources=("web-1",)), vm("web-1"), at=now
    )
    elsewhere = transition("scheduled", event("EVT-O", resources=("web-2",)), vm("web-2"), at=now)
    ledger = open_ledger(url)
    async with ledger, open_database(url) as theirs:
        service = ApproverService(transport, generate_signing_key(), db=ledger.db)
        await service.handle(elsewhere)
        await service.commit()
        for message in (beat, scheduled):  # a batch under way: handled, not yet committed
            await service.handle(message)
        other = ApproverState(theirs, "approver")
        await other.load(FleetView())
        await other.commit([], [], [])  # another process wrote the group's state meanwhile
        other_event = service.fleet.event("EVT-O")
        assert other_event is not None
        with pytest.raises(WriteConflict):
            await service.evaluate(other_event)  # housekeeping's commit: refused
        with pytest.raises(DatabaseError, match="took along what messages of this batch"):
            await service.commit()  # so the batch's is: its messages come back
        assert await _approvals_within(transport, "web-1", 0.5) == []
        for message in (beat, scheduled):  # the broker delivers them again
            await service.handle(message)
        await service.commit()
        got = await _approvals_within(transport, "web-1", 1.5)
    assert [(a.event_id, a.vm) for a in got] == [("EVT-L", "web-1")]


async def test_a_burst_read_while_the_last_batch_is_written_approves_each_event_once(
    transport, state_url
):
    """With a database the approver handles the next batch while the last one is written
    (the stream's ``pipeline``). Mid-burst another process writes the group's state (a
    takeover); the write under way and the one begun after it are refused (each expects the
    version the one before writes), the view is loaded again and the broker delivers those
    batches again. Every event is approved, once: one approval id each, whatever the copies.
    On PostgreSQL the writes go through a pool of connections: they must still land in the
    order begun (a later one first would find the version it expects not yet written)."""
    url = state_url
    ledger = open_ledger(url)
    async with ledger, open_database(url) as theirs:
        service = ApproverService(transport, generate_signing_key(), db=ledger.db)
        assert service.stream.pipeline
        state = service.state
        assert state is not None
        write = state.db.write
        writes = 0

        async def write_and_meanwhile_another_process(statements, *, guard=None):
            nonlocal writes
            writes += 1
            if writes == 3:
                other = ApproverState(theirs, "approver")
                await other.load(FleetView())
                await other.commit([], [], [])
            return await write(statements, guard=guard)

        state.db.write = write_and_meanwhile_another_process  # type: ignore[method-assign]
        names = await _user_reboots(transport, 300)
        runner = asyncio.create_task(service.run())
        try:
            got = {name: await _approvals_within(transport, name, 0.02) for name in names[:1]}
            async with asyncio.timeout(30):
                while not all(got.get(name) for name in names):
                    for name in names:
                        if not got.get(name):
                            got[name] = await _approvals_within(transport, name, 0.01)
        finally:
            service.stop()
            await asyncio.wait_for(runner, 10)
        rows = await ledger.db.fetch(
            "SELECT event_id, count(DISTINCT approval_id) FROM approver_approvals GROUP BY event_id"
        )
    assert writes > 3
    # The other process's write refused the write under way and the one begun after it: the
    # subscription was opened again once for them, not once for every write out of order.
    assert 1 <= service.stream.stats.reconnects <= 2
    assert {name: {a.event_id for a in approvals} for name, approvals in got.items()} == {
        name: {f"EVT-{name}"} for name in names
    }
    assert all(len({a.approval_id for a in approvals}) == 1 for approvals in got.values())
    assert sorted(rows) == sorted((f"EVT-{name}", 1) for name in names)


class _SlowConfirms(MemoryTransport):
    """A broker that confirms each approval two seconds after it was sent (a busy broker
    under a fleet's burst; the in-memory broker stands in for it, with that delay added)."""

    def __init__(self) -> None:
        super().__init__(f"approver-{uuid.uuid4().hex}")

    async def send_approval(self, to: ReplyAddress, message: OutgoingMessage) -> None:
        await asyncio.sleep(2.0)
        await super().send_approval(to, message)


async def test_with_a_database_the_broker_confirming_approvals_slowly_does_not_slow_the_reading(
    tmp_path,
):
    """Once its decisions and approvals are committed (the approvals as ``sending``), the
    approver acks the batch and reads on; the approvals go out meanwhile and are marked sent in
    a later commit (a successor sends again what is still ``sending``). A burst of 320 events
    (640 messages: five batches or more) is read without waiting two seconds a batch for each
    batch's approvals to be confirmed (at least ten seconds in all)."""
    ledger = open_ledger(f"sqlite:///{tmp_path / 'central.db'}")
    async with _SlowConfirms() as slow, ledger:
        service = ApproverService(slow, generate_signing_key(), db=ledger.db)
        names = await _user_reboots(slow, 320)
        began = asyncio.get_running_loop().time()
        runner = asyncio.create_task(service.run())
        async with asyncio.timeout(20):
            while service.stream.stats.handled < 2 * len(names):  # noqa: ASYNC110 - its counter
                await asyncio.sleep(0.01)
        read_in = asyncio.get_running_loop().time() - began
        async with asyncio.timeout(15):  # confirmed, then marked sent by a later commit
            while await ledger.db.fetch(  # noqa: ASYNC110 - the database has no event to wait on
                "SELECT 1 FROM approver_approvals WHERE state != 'sent'"
            ):
                await asyncio.sleep(0.1)
        approvals = [await next_approval(slow, name) for name in names]
        service.stop()
        await asyncio.wait_for(runner, 5)
    assert [a.vm for a in approvals] == names
    assert read_in < 5, f"640 messages read in {read_in:.1f} s"


class _HalfSecondConfirms(MemoryTransport):
    """A broker that confirms each approval half a second after it was sent."""

    def __init__(self) -> None:
        super().__init__(f"approver-{uuid.uuid4().hex}")

    async def send_approval(self, to: ReplyAddress, message: OutgoingMessage) -> None:
        await asyncio.sleep(0.5)
        await super().send_approval(to, message)


async def test_without_a_database_a_wave_waits_for_confirms_a_batch_at_a_time_not_one_at_a_time():
    """Without a database a message is acked only once the broker confirmed its approvals (a
    crash before that must bring the message back: nothing else remembers the decision). The
    wait is per ack batch, the batch's approvals sent together: a wave of 40 events whose
    approvals each take half a second to be confirmed is decided and sent in a few seconds,
    not the 20 s one confirm after the other took (the stream read nothing meanwhile)."""
    async with _HalfSecondConfirms() as slow:
        service = ApproverService(slow, generate_signing_key())
        names = await _user_reboots(slow, 40)
        began = asyncio.get_running_loop().time()
        runner = asyncio.create_task(service.run())
        approvals = [await next_approval(slow, name, within=30) for name in names]
        took = asyncio.get_running_loop().time() - began
        service.stop()
        await asyncio.wait_for(runner, 5)
    assert sorted(a.vm for a in approvals) == sorted(names)
    assert took < 6, f"40 approvals confirmed in {took:.1f} s"


class _LinkDown(MemoryTransport):
    """A broker link that is down for approvals until ``up`` is set, or (``once``) while the
    first approval is being sent, then back."""

    def __init__(self, *, once: bool = False) -> None:
        super().__init__(f"approver-{uuid.uuid4().hex}")
        self.up = False
        self.once = once
        self.failures = 0

    async def send_approval(self, to: ReplyAddress, message: OutgoingMessage) -> None:
        if not self.up:
            self.up = self.once
            self.failures += 1
            raise TransportError("link lost (test)")
        await super().send_approval(to, message)


async def test_without_a_database_a_batch_is_not_acked_while_an_approval_of_it_is_unsent():
    """Without a database the batch's commit (what the stream awaits before it acks) returns
    only once every approval decided so far is confirmed, those a lost link stopped included:
    the first commit fails with the link; the next one sends the approval before it returns,
    even with nothing new decided (before, it returned at once and the batch was acked with
    its approval still unsent, which a crash then lost)."""
    async with _LinkDown(once=True) as flaky:
        await flaky.declare_group("approver")
        service = ApproverService(flaky, generate_signing_key())
        ev = event("EVT-web-1", source="User", resources=("web-1",))
        now = datetime.now(UTC)
        await service.handle(heartbeat(vm("web-1"), at=now))
        await service.handle(transition("scheduled", ev, vm("web-1"), at=now))
        with pytest.raises(TransportError):
            await service.commit()
        await service.commit()
        approval = await next_approval(flaky, "web-1", within=1)
    assert approval.event_id == "EVT-web-1"


async def test_a_message_handled_while_an_approval_waits_for_the_link_is_not_failed_for_it(
    tmp_path,
):
    """With a database, an approval a lost link stopped is durable (``sending``) and goes out
    again on its own; a message handled meanwhile (another VM's ``started``) is handled, not
    failed because the approval could not go out yet. Before, the handler raised the link's
    error: the stream retried that message (every handler got it again: the fault storm's
    duplicates at a handler) and, after its attempts, dead-lettered it."""
    ledger = open_ledger(f"sqlite:///{tmp_path / 'central.db'}")
    async with _LinkDown() as down, ledger:
        await down.declare_group("approver")
        service = ApproverService(down, generate_signing_key(), db=ledger.db)
        now = datetime.now(UTC)
        ev = event("EVT-web-1", source="User", resources=("web-1",))
        await service.handle(heartbeat(vm("web-1"), at=now))
        await service.handle(transition("scheduled", ev, vm("web-1"), at=now))
        await service.commit()  # committed as sending; the send fails on the link
        await asyncio.gather(*service._sending)
        other = event("EVT-web-2", source="User", resources=("web-2",))
        await service.handle(transition("started", other, vm("web-2"), at=now))
        await service.commit()
        down.up = True  # the next message sends it (or housekeeping, within a second)
        await service.handle(heartbeat(vm("web-3"), at=datetime.now(UTC)))
        await service.commit()
        approval = await next_approval(down, "web-1", within=2)
    assert approval.event_id == "EVT-web-1"


async def test_with_a_database_an_approval_a_lost_link_stopped_goes_out_without_another_message(
    tmp_path,
):
    """The approvals of a committed batch are sent while the stream reads on; when the link
    drops during that send, the approval is sent again by the approver's housekeeping, not only
    when some other message happens to arrive (a quiet fleet may send none for a minute)."""
    ledger = open_ledger(f"sqlite:///{tmp_path / 'central.db'}")
    async with _LinkDown(once=True) as flaky, ledger:
        service = ApproverService(flaky, generate_signing_key(), db=ledger.db)
        [name] = await _user_reboots(flaky, 1)
        runner = asyncio.create_task(service.run())
        try:
            approval = await next_approval(flaky, name)
        finally:
            service.stop()
            await asyncio.wait_for(runner, 5)
    assert flaky.failures == 1
    assert approval.vm == name


class _Surprise(MemoryTransport):
    """A transport whose first approval send fails with a bare ``Exception()``: what aiormq
    fails a publish waiting for its confirm with when its connection ended without an error
    (the fault storm met it; the transport now takes it for a lost link, see
    ``tests/transport/test_rabbitmq_closed_quietly.py``). The in-memory broker stands in for any
    library's surprise the transport does not know yet."""

    def __init__(self) -> None:
        super().__init__(f"approver-{uuid.uuid4().hex}")
        self.failures = 0

    async def send_approval(self, to: ReplyAddress, message: OutgoingMessage) -> None:
        if not self.failures:
            self.failures += 1
            raise Exception()  # exactly what the library raised
        await super().send_approval(to, message)


async def test_an_approval_whose_send_fails_unexpectedly_is_sent_again(tmp_path, caplog):
    """Before, the unexpected error ended the approver's detached send task ("Task exception
    was never retrieved" in the fault storm) and its batch went unsettled: the approval stayed
    ``sending`` until another approver took over."""
    ledger = open_ledger(f"sqlite:///{tmp_path / 'central.db'}")
    async with _Surprise() as surprising, ledger:
        service = ApproverService(surprising, generate_signing_key(), db=ledger.db)
        [name] = await _user_reboots(surprising, 1)
        runner = asyncio.create_task(service.run())
        try:
            approval = await next_approval(surprising, name, within=5)
        finally:
            service.stop()
            await asyncio.wait_for(runner, 5)
    assert surprising.failures == 1
    assert approval.vm == name
    assert any("sending it failed unexpectedly" in r.getMessage() for r in caplog.records)


async def test_the_sender_needs_a_vm_for_an_event_it_never_heard_of(transport):
    sender = ApprovalSender(transport, generate_signing_key(), fleet=FleetView())
    with pytest.raises(NoApprovalTarget, match="name the VM"):
        await sender.approve("EVT-UNKNOWN", event_version="0" * 32)
    # named: the transport's reply address
    await sender.approve("EVT-UNKNOWN", "web-3", event_version="0" * 32)
    approval = await next_approval(transport, "web-3")
    assert approval.event_id == "EVT-UNKNOWN"


def test_keygen_then_manual_approve_from_the_command_line(tmp_path, capsys):
    assert main(["keygen", "--out", str(tmp_path)]) == 0
    assert "approver.pub" in capsys.readouterr().out
    assert main(["keygen", "--out", str(tmp_path)]) == 2  # never overwrites a key
    assert "refusing to overwrite" in capsys.readouterr().err
    event_id = "8EE31A01-6A5F-4C1E-8E5A-7C2F0D1B9A33"
    assert main(["approve", "EVT-42", "--vm", "web-7", "--signing-key", "k"]) == 2
    assert "is not an EventId" in capsys.readouterr().err
    code = main(
        [
            "approve",
            event_id,
            "--vm",
            "web-7",
            "--broker",
            "memory://cli",
            "--signing-key",
            str(tmp_path / "approver.key"),
            "--decided-by",
            "alice",
        ]
    )
    assert code == 2  # no version of the event known: refused, saying what to pass
    assert "--event-version" in capsys.readouterr().err
    code = main(
        [
            "approve",
            event_id,
            "--vm",
            "web-7",
            "--broker",
            "memory://cli",
            "--signing-key",
            str(tmp_path / "approver.key"),
            "--decided-by",
            "alice",
            "--event-version",
            "a" * 32,
            "--no-wait",
        ]
    )
    assert code == 0
    assert f"of event {event_id} version {'a' * 32}" in capsys.readouterr().out

    async def received() -> Approval:
        async with MemoryTransport("cli") as memory:
            return await next_approval(memory, "web-7")

    approval = asyncio.run(received())
    trusted = load_public_keys([tmp_path / "approver.pub"])
    verify(approval, trusted, vm_name="web-7")
    assert approval.decided_by == "alice"


def test_the_command_line_explains_itself(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for command in ("approver", "audit", "tail", "approve", "keygen", "demo"):
        assert command in text
    assert main(["approver", "--signing-key", "/nonexistent/key"]) == 2
    assert "cannot read the signing key" in capsys.readouterr().err


@pytest.mark.parametrize(
    "announced",
    [
        # another channel (a 1.0 agent's direct exchange, or a hostile one)
        {"channel": "scheduled-events.approvals", "key": "web-2"},
        # another VM's queue: that VM would refuse the approval, and web-2 never gets it
        {"channel": None, "key": "web-9"},
    ],
)
async def test_an_announced_reply_address_never_redirects_an_approval(transport, announced):
    """A VM's messages say where its approvals go (``reply_to``); the approver sends to the
    VM's own address by the transport's convention whatever a message announces, so a bad or
    hostile announcement neither stops the approver nor sends the approval elsewhere."""
    service = ApproverService(transport, generate_signing_key())
    now = datetime.now(UTC)
    ev = event("EVT-A", source="User", resources=("web-2",))
    own = transport.reply_address("web-2")
    address = own.model_copy(update={k: v for k, v in announced.items() if v is not None})
    messages: list[AgentMessage | TransitionMessage] = [
        heartbeat(vm("web-2"), at=now),
        transition("scheduled", ev, vm("web-2"), at=now),
    ]
    await transport.declare_group("approver")
    runner = asyncio.create_task(service.run())
    for message in messages:
        data = message.data.model_copy(update={"reply_to": address})
        await transport.publish(lifecycle_message(message.model_copy(update={"data": data})))
    approval = await next_approval(transport, "web-2")
    assert approval.vm == "web-2"
    assert not runner.done()
    service.stop()
    await asyncio.wait_for(runner, 2)


def _own_and_squatter() -> tuple[TransitionMessage, TransitionMessage]:
    """web-y's message, and web-x's about another event sent under the same id."""
    now = datetime.now(UTC)
    own = transition("scheduled", event("EVT-Y", resources=("web-y",)), vm("web-y"), at=now)
    squatter = transition(
        "scheduled", event("EVT-X", resources=("web-x",)), vm("web-x"), at=now
    ).model_copy(update={"id": own.id})
    return own, squatter


async def test_a_redelivered_message_is_recalled_only_from_its_own_vm(transport, tmp_path):
    """Message ids are the senders' own, and a VM can compute another's (they are derived from
    what the message says). After a takeover, the messages the standby is given again are
    looked up in the group's state: a message another VM stored under the same id first must
    not make a VM's own message look handled, nor contradict it (it would be dead-lettered as an
    id conflict instead of handled)."""
    ledger = open_ledger(f"sqlite:///{tmp_path / 'central.db'}")
    async with ledger:
        service = ApproverService(transport, generate_signing_key(), db=ledger.db)
        own, squatter = _own_and_squatter()
        await service.handle(squatter)
        await service.commit()
        recall = service.stream.recall
        assert recall is not None
        assert await recall(own) is None  # not handled: web-y's message is handled when it comes
        assert await recall(squatter) == content_digest(squatter)  # web-x's own: handled


async def test_a_message_under_an_id_another_vm_stored_first_is_in_the_standbys_view(
    transport, state_url
):
    """A VM that sends a message under another VM's id first (ids can be computed from what a
    message says) must not keep that VM's own message out of the group's state: the standby
    that takes over rebuilds its view from the state, and would not know the event."""
    async with open_ledger(state_url) as ledger:
        service = ApproverService(transport, generate_signing_key(), db=ledger.db)
        own, squatter = _own_and_squatter()
        for message in (squatter, own):
            await service.handle(message)
            await service.commit()
        standby = FleetView()
        await ApproverState(ledger.db, "approver").load(standby)
        recall = service.stream.recall
        assert recall is not None
        recalled = await recall(own)
    assert {s.event_id for s in standby.events(open_only=True)} == {"EVT-X", "EVT-Y"}
    evt_y = standby.event("EVT-Y")
    assert evt_y is not None
    assert set(evt_y.reports) == {"web-y"}
    assert recalled == content_digest(own)


async def test_a_standby_rebuilds_an_event_another_vm_reported_over_as_still_open(tmp_path):
    """VM a's event started; VM b reported it over; a's agent is still live (its heartbeat is
    the last message stored), so the active approver keeps the event open (each VM speaks for
    itself). The standby that takes over replays the stored messages: it must not end the
    event on the way because a's older messages, replayed first, looked stale."""
    from ._factory import T0

    ev = event("EVT-Z", resources=("web-a",), status="Started")
    messages: list[LifecycleMessage] = [
        transition("started", ev, vm("web-a"), at=T0),
        transition("completed", ev, vm("web-b"), at=T0 + timedelta(minutes=1)),
        heartbeat(vm("web-a"), at=T0 + timedelta(minutes=5)),
    ]
    now = [T0]
    active = FleetView(clock=lambda: now[0])
    for message in messages:  # each as it arrives
        now[0] = message.time + timedelta(seconds=1)
        active.apply(message)
    now[0] = T0 + timedelta(minutes=6)
    standby = FleetView(clock=lambda: now[0])
    async with open_ledger(f"sqlite:///{tmp_path / 'central.db'}") as ledger:
        await ApproverState(ledger.db, "approver").commit(messages, [], [])
        await ApproverState(ledger.db, "approver").load(standby)
    for view in (active, standby):
        state = view.event("EVT-Z")
        assert state is not None
        assert not state.phase.is_over
        assert view.is_down("web-a")


async def test_a_standby_counts_an_agent_live_for_the_heartbeat_interval_it_declared(tmp_path):
    """The stored state keeps an agent's last message of its own, which declares its heartbeat
    interval (10 minutes here): a standby that takes over 5 minutes after a was last heard
    counts it live as the active did, so the event b reported over stays open and a down."""
    from ._factory import T0

    ev = event("EVT-L", resources=("web-a",), status="Started")
    messages: list[LifecycleMessage] = [
        heartbeat(vm("web-a"), at=T0, heartbeat_interval=600.0),
        transition("started", ev, vm("web-a"), at=T0 + timedelta(seconds=10)),
        transition("completed", ev, vm("web-b"), at=T0 + timedelta(minutes=1)),
    ]
    now = [T0 + timedelta(minutes=5)]
    standby = FleetView(clock=lambda: now[0])
    async with open_ledger(f"sqlite:///{tmp_path / 'central.db'}") as ledger:
        await ApproverState(ledger.db, "approver").commit(messages, [], [])
        await ApproverState(ledger.db, "approver").load(standby)
    standby.prune()
    state = standby.event("EVT-L")
    assert state is not None
    assert not state.phase.is_over
    assert standby.is_down("web-a")
    now[0] = T0 + timedelta(minutes=26)  # 2.5 x 10 minutes after a was last heard
    standby.prune()
    assert state.completed


async def _next_held_behind_a(
    transport, now: list[datetime], *, heartbeat_interval: float | None
) -> tuple[ApproverService, dict[str, VmIdentity]]:
    """Under a cap of one unavailable VM per scale set, VM a's event BUSY started; NEXT (on c)
    is held for it; VM b, which sees BUSY, reported it over while a's agent is live. Every
    agent heard at ``now[0]``, declaring ``heartbeat_interval``."""
    from consumers import ApproveUserInitiated, MaxUnavailable

    service = ApproverService(
        transport,
        generate_signing_key(),
        policies=PolicySet((ApproveUserInitiated(), MaxUnavailable("scale_set", count=1))),
        clock=lambda: now[0],
    )
    ids = {name: vm(name, scale_set="ss") for name in ("a", "b", "c")}
    busy = event("BUSY", source="User", resources=("a",), status="Started")
    next_one = event("NEXT", source="User", resources=("c",))
    for name in ids:
        await service.handle(heartbeat(ids[name], at=now[0], heartbeat_interval=heartbeat_interval))
    await service.handle(transition("started", busy, ids["a"], at=now[0]))
    await service.handle(transition("scheduled", next_one, ids["c"], at=now[0]))
    await service.handle(transition("completed", busy, ids["b"], at=now[0]))
    held = [d for d in service.decisions if d.event_id == "NEXT"]
    assert [d.action for d in held] == [Action.WAIT]
    return service, ids


async def test_an_event_held_by_a_cap_is_approved_once_the_vm_in_the_way_falls_silent(transport):
    """VM a's maintenance holds NEXT (on c) under a cap of one unavailable VM per scale set.
    VM b, which sees a's event, reports it over; a's agent is live, so a still counts. Then
    a's agent falls silent (it cannot report the end any more): at the approver's next prune
    the event ends for a, and NEXT, held on the scale set, is decided again and approved."""
    now = [datetime.now(UTC)]
    service, ids = await _next_held_behind_a(transport, now, heartbeat_interval=None)
    now[0] += timedelta(minutes=3)  # a's agent silent past its liveness
    service._next_prune = 0.0  # the minute between prunes is over
    await service.handle(heartbeat(ids["c"], at=now[0]))
    decided = [d for d in service.decisions if d.event_id == "NEXT"]
    assert [d.action for d in decided] == [Action.WAIT, Action.APPROVE]


async def test_a_vm_on_a_long_heartbeat_interval_keeps_its_groups_room_between_heartbeats(
    transport,
):
    """As above, but a's agent heartbeats every 10 minutes, as it declared: 3 minutes after a
    was last heard it is quiet, not gone, and still in maintenance, so NEXT stays held. Judged
    by the approver's own 150 s, NEXT was approved then: two VMs of the scale set down under a
    cap of one. It is approved once 2.5 of a's intervals went by without a word."""
    now = [datetime.now(UTC)]
    service, ids = await _next_held_behind_a(transport, now, heartbeat_interval=600.0)
    last_heard = now[0]
    for minutes in (3, 12, 24):
        now[0] = last_heard + timedelta(minutes=minutes)
        service._next_prune = 0.0  # the minute between prunes is over
        await service.handle(heartbeat(ids["c"], at=now[0], heartbeat_interval=600.0))
        held = [d.action for d in service.decisions if d.event_id == "NEXT"]
        assert held == [Action.WAIT], (minutes, held)
    now[0] = last_heard + timedelta(minutes=26)  # 2.5 x 10 minutes without a word from a
    service._next_prune = 0.0
    await service.handle(heartbeat(ids["c"], at=now[0], heartbeat_interval=600.0))
    decided = [d.action for d in service.decisions if d.event_id == "NEXT"]
    assert decided == [Action.WAIT, Action.APPROVE]


async def test_an_event_held_by_a_percent_cap_is_approved_once_more_vms_join_its_group(
    transport,
):
    """Half of a scale set may be down: of a and c, a is in maintenance, so c's event waits.
    Then b and d come online in the same scale set: half of four is two, and c's event is
    decided again and approved. Before, a VM joining a group was not a change that could free
    room, and the event waited for the next change in its group (or its NotBefore)."""
    from consumers import ApproveUserInitiated, MaxUnavailable

    now = datetime.now(UTC)
    service = ApproverService(
        transport,
        generate_signing_key(),
        policies=PolicySet((ApproveUserInitiated(), MaxUnavailable("scale_set", percent=50))),
        clock=lambda: now,
    )
    ids = {name: vm(name, scale_set="ss") for name in ("a", "b", "c", "d")}
    busy = event("BUSY", source="User", resources=("a",), status="Started")
    next_one = event("NEXT", source="User", resources=("c",))
    for name in ("a", "c"):
        await service.handle(heartbeat(ids[name], at=now))
    await service.handle(transition("started", busy, ids["a"], at=now))
    await service.handle(transition("scheduled", next_one, ids["c"], at=now))
    held = [d for d in service.decisions if d.event_id == "NEXT"]
    assert [d.action for d in held] == [Action.WAIT]
    for name in ("b", "d"):
        await service.handle(heartbeat(ids[name], at=now))
    decided = [d for d in service.decisions if d.event_id == "NEXT"]
    assert [d.action for d in decided] == [Action.WAIT, Action.APPROVE]


async def test_a_not_before_with_no_utc_equivalent_never_gets_the_real_version_approved():
    """A neighbour reports web-1's Platform reboot as user-initiated, with a NotBefore that
    parses but has no UTC equivalent. Computing its version raised OverflowError after the view
    had taken the new content; the stream retried the message, the content now matched, and the
    policy approved the lie under the real event's version, which web-1's agent would apply.
    Now the lie has a version of its own: whatever is approved of it, web-1's agent refuses as
    ``event-changed``; the real version is never approved."""
    from consumers._origin import Origin

    name = f"nb-{uuid.uuid4().hex}"
    now = datetime.now(UTC)
    real = event("EVT-X", source="Platform", resources=("web-1",))  # the sample policy: wait
    lie = transition(
        "scheduled",
        event("EVT-X", source="User", resources=("web-1",)),
        vm("evil"),
        at=now + timedelta(seconds=1),
    )
    body = json.loads(lie.to_bytes())
    body["data"]["event"]["NotBefore"] = "Fri, 31 Dec 9999 23:00:00 -0500"
    async with (
        MemoryTransport(name) as central,
        MemoryTransport(name, user="web-1") as web1,
        MemoryTransport(name, user="evil") as evil,
    ):
        service = ApproverService(central, generate_signing_key(), origin=Origin.VM_USER)
        await central.declare_group("approver")
        runner = asyncio.create_task(service.run())
        await web1.publish(lifecycle_message(heartbeat(vm("web-1"), at=now)))
        await web1.publish(lifecycle_message(transition("scheduled", real, vm("web-1"), at=now)))
        await evil.publish(lifecycle_message(heartbeat(vm("evil"), at=now)))
        await evil.publish(
            OutgoingMessage(
                body=json.dumps(body).encode(),
                message_id=lie.id,
                content_type="application/cloudevents+json",
                routing_key=lie.routing_key,
            )
        )
        approvals = []
        with contextlib.suppress(TimeoutError):
            async with central.approvals("web-1") as sub, asyncio.timeout(2.0):
                async for delivery in sub:
                    await delivery.ack()
                    approvals.append(Approval.from_bytes(delivery.body))
        service.stop()
        await asyncio.wait_for(runner, 5)
    assert [a.event_version for a in approvals if a.event_version == event_version(real)] == []
    assert service.stream.stats.retried == 0  # handled once: no handler failed on it


async def _first_approval(transport: MemoryTransport, name: str, within: float) -> Any:
    with contextlib.suppress(TimeoutError):
        async with transport.approvals(name) as sub, asyncio.timeout(within):
            async for delivery in sub:
                await delivery.ack()
                return Approval.from_bytes(delivery.body)
    return None


@pytest.mark.parametrize("reporter", ["web-9", "web-1"], ids=["a-neighbour", "the-vm-itself"])
async def test_a_report_of_a_new_version_does_not_free_a_vm_that_holds_an_approval(reporter):
    """Scale set S, at most one VM down. EVT-A's approval (version V1) is on its way to web-1,
    so EVT-B on web-2 waits. Then a report says EVT-A changed (V2: a lie of a neighbour, or
    web-1's own report ahead of the approval). The approval of V1 counted only while V1 was the
    view's version, so web-1 looked available and EVT-B was approved at once; but web-1's IMDS
    still shows V1, and its agent applies the approval it holds: two VMs of S down under a cap
    of one. An approval out counts until its VM refuses it, whatever the version."""
    from consumers._policies import parse_policy

    policy = parse_policy(
        {
            "approve": {"user_initiated": {}},
            "max_unavailable": {"group_by": "scale_set", "count": 1},
        }
    )
    now = datetime.now(UTC)
    web1, web2 = vm("web-1", scale_set="S"), vm("web-2", scale_set="S")
    later = now + timedelta(minutes=15)
    a = event("EVT-A", source="User", resources=("web-1",), not_before=later)
    b = event("EVT-B", source="User", resources=("web-2",), not_before=later)
    a_moved = event("EVT-A", source="Platform", resources=("web-1",), not_before=later)
    async with MemoryTransport(f"cap-{uuid.uuid4().hex}") as transport:
        service = ApproverService(transport, generate_signing_key(), policy)
        await transport.declare_group("approver")
        runner = asyncio.create_task(service.run())
        for message in (
            heartbeat(web1, at=now),
            heartbeat(web2, at=now),
            transition("scheduled", a, web1, at=now),
        ):
            await transport.publish(lifecycle_message(message))
        first = await _first_approval(transport, "web-1", 2)
        assert first is not None
        assert first.event_id == "EVT-A"
        await transport.publish(lifecycle_message(transition("scheduled", b, web2, at=now)))
        assert await _first_approval(transport, "web-2", 0.5) is None  # S is full
        moved = transition(
            "updated", a_moved, vm(reporter, scale_set="S"), at=now + timedelta(seconds=1)
        )
        await transport.publish(lifecycle_message(moved))
        second = await _first_approval(transport, "web-2", 1.5)
        assert second is None, "EVT-B approved while web-1 holds an approval of EVT-A"
        # Only web-1's agent can void it: another VM's refusal under its id changes nothing;
        # web-1's does (its IMDS shows V2: event-changed), and then EVT-B goes.
        for who, freed in ((web2, False), (web1, True)):
            refusal = outcome(
                who,
                a,
                applied=False,
                at=now + timedelta(seconds=2),
                approval_id=first.approval_id,
                reason="event-changed",
            )
            await transport.publish(lifecycle_message(refusal))
            assert (await _first_approval(transport, "web-2", 1.5) is not None) is freed
        service.stop()
        await asyncio.wait_for(runner, 5)


async def test_an_event_listing_its_vm_twice_is_approved_once_its_group_has_room():
    """Scale set S, at most one VM down. EVT-B lists web-2 twice (``web-2`` and ``WEB-2``: names
    compare case-insensitively, and nothing in the contract forbids the repeat), and waits while
    EVT-A holds S's one slot. When EVT-A completed, deciding EVT-B again took it off the wait
    lists once per name: the second raised KeyError, the handler failed, and the retried message
    found no change left to decide on (the failed try had taken it). EVT-B was left to NotBefore
    with room in S. Now it is approved when the slot frees."""
    from consumers._policies import parse_policy

    policy = parse_policy(
        {
            "approve": {"user_initiated": {}},
            "max_unavailable": {"group_by": "scale_set", "count": 1},
        }
    )
    now = datetime.now(UTC)
    web1, web2 = vm("web-1", scale_set="S"), vm("web-2", scale_set="S")
    later = now + timedelta(minutes=15)
    a = event("EVT-A", source="User", resources=("web-1",), not_before=later)
    b = event("EVT-B", source="User", resources=("web-2", "WEB-2"), not_before=later)
    async with MemoryTransport(f"twice-{uuid.uuid4().hex}") as transport:
        service = ApproverService(transport, generate_signing_key(), policy)
        await transport.declare_group("approver")
        runner = asyncio.create_task(service.run())
        for message in (
            heartbeat(web1, at=now),
            heartbeat(web2, at=now),
            transition("scheduled", a, web1, at=now),
        ):
            await transport.publish(lifecycle_message(message))
        first = await _first_approval(transport, "web-1", 2)
        assert first is not None
        assert first.event_id == "EVT-A"
        await transport.publish(lifecycle_message(transition("scheduled", b, web2, at=now)))
        assert await _first_approval(transport, "web-2", 0.5) is None  # S is full
        started = event("EVT-A", source="User", status="Started", resources=("web-1",))
        for kind in ("started", "completed"):
            done = transition(kind, started, web1, at=now + timedelta(seconds=1))
            await transport.publish(lifecycle_message(done))
        second = await _first_approval(transport, "web-2", 2)
        service.stop()
        await asyncio.wait_for(runner, 5)
    assert second is not None, "EVT-B left to NotBefore with room in S"
    assert second.event_id == "EVT-B"
    assert service.stream.stats.retried == 0  # no handler failed on the way


@pytest.mark.parametrize("fails", ["once", "always"])
async def test_a_report_the_view_failed_to_take_changes_no_decision(monkeypatch, fails):
    """Scale set S, at most two VMs down. EVT-A (web-1, web-2) was approved and started on
    both, so EVT-B on web-3 waits. web-2's ``completed`` fails in the fleet view (injected:
    the version of the content it carries raises; no real input is known to make applying a
    message raise any more). The view kept web-2's report (completed) and not the rest; with
    the message dead-lettered after its retries, web-1's ``completed`` then ended EVT-A, freed
    S and approved EVT-B while, as far as the approver had taken in, web-2 was still in
    maintenance. Now a message the view failed to take changed nothing: retried, it gives
    what it gives on a view that never failed (EVT-A over, EVT-B approved); dead-lettered,
    what it gives had it never come (web-2 still down, EVT-B waits)."""
    from consumers import _fleet
    from consumers._policies import parse_policy

    policy = parse_policy(
        {
            "approve": {"user_initiated": {}},
            "max_unavailable": {"group_by": "scale_set", "count": 2},
        }
    )
    now = datetime.now(UTC)
    web1, web2, web3 = (vm(f"web-{n}", scale_set="S") for n in (1, 2, 3))
    later = now + timedelta(minutes=15)
    a = event("EVT-A", source="User", resources=("web-1", "web-2"), not_before=later)
    a_started = event("EVT-A", source="User", status="Started", resources=("web-1", "web-2"))
    # What web-2 last saw differs from the view's content (its description): the view takes
    # it, and computes its version.
    a_seen_by_web2 = ScheduledEvent.from_imds({**a_started.to_imds(), "Description": "done"})
    b = event("EVT-B", source="User", resources=("web-3",), not_before=later)
    failed: list[str] = []

    def version(ev: ScheduledEvent) -> str:
        if ev == a_seen_by_web2 and (fails == "always" or not failed):
            failed.append(ev.event_id)
            raise RuntimeError("injected: the version of web-2's content could not be computed")
        return event_version(ev)

    monkeypatch.setattr(_fleet, "event_version", version)
    async with MemoryTransport(f"half-{uuid.uuid4().hex}") as transport:
        service = ApproverService(transport, generate_signing_key(), policy)
        await transport.declare_group("approver")
        runner = asyncio.create_task(service.run())
        opening: list[LifecycleMessage] = [heartbeat(who, at=now) for who in (web1, web2, web3)]
        for message in (*opening, transition("scheduled", a, web1, at=now)):
            await transport.publish(lifecycle_message(message))
        first = await _first_approval(transport, "web-1", 2)
        assert first is not None
        assert first.event_id == "EVT-A"
        for message in (
            transition("started", a_started, web1, at=now + timedelta(seconds=1)),
            transition("started", a_started, web2, at=now + timedelta(seconds=1)),
            transition("scheduled", b, web3, at=now + timedelta(seconds=1)),
            transition("completed", a_seen_by_web2, web2, at=now + timedelta(seconds=2)),
        ):
            await transport.publish(lifecycle_message(message))
        stats = service.stream.stats
        async with asyncio.timeout(10):
            while stats.handled + stats.dead_lettered < 8:  # noqa: ASYNC110 - the counters
                await asyncio.sleep(0.01)
        assert failed
        assert stats.dead_lettered == (1 if fails == "always" else 0)
        done = transition("completed", a_started, web1, at=now + timedelta(seconds=3))
        await transport.publish(lifecycle_message(done))
        second = await _first_approval(transport, "web-3", 1.5)
        service.stop()
        await asyncio.wait_for(runner, 5)
    state = service.fleet.event("EVT-A")
    assert state is not None
    if fails == "once":  # retried: as on a view that never failed
        assert state.completed
        assert second is not None
        assert second.event_id == "EVT-B"
        assert service.fleet.down_in("scale_set", "S") == {"web-3"}
    else:  # dead-lettered: as if it had never come
        assert not state.completed
        assert second is None, "EVT-B approved while web-2's end was never taken"
        assert service.fleet.down_in("scale_set", "S") == {"web-1", "web-2"}
        assert state.reports["web-2"].kind.value == "started"
