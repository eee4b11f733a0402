"""The central approval service: reads the fleet stream as consumer group ``approver``, keeps a
fleet view, asks the policies about every event still Scheduled, and sends one signed approval,
bound to the version of the event it judged, when they say so. Every decision (approve, wait,
never) is recorded with its reason and that version.

It runs as one active consumer of its group (single-active-consumer on RabbitMQ, one session on
Service Bus): more processes on the same group are hot standbys that take over, in order, when
it dies. With a database (``--db``), the state a decision depends on is durable
(:mod:`consumers._approver_state`): the process that takes over rebuilds the same fleet view —
live events and their phases, approvals sent and their versions, hook results, agent identities,
who is unavailable — and sends again what it cannot be sure went out. Without one, it says at
start that a failover forgets. A takeover hands nothing twice to the handlers: a redelivered
message the group's state holds was handled by the process before (the stream's ``recall``),
and a commit moves the state only from the version its process last read or wrote, so the
process the broker took the queue from commits nothing over the one that took it.

A message is acked only once a crash can no longer lose its decisions. The stream acks a batch
of messages after awaiting :meth:`ApproverService.commit`. Without a database, that sends the
batch's approvals together (and any a lost link stopped) and returns once the broker confirmed
them all, so a crash before brings the messages back to the next active process: one confirm
round trip a batch, not one an approval. With one, it commits the batch's messages together,
with their decisions and their approvals as ``sending``: one transaction for up to a batch of
messages instead of one each. The stream handles the next batch while a batch is being
written (its ``pipeline``): a commit begun after another expects the state version that one
writes, so it lands after it or, when that one failed, fails too (and the broker delivers both
batches again). The approvals then go out while the stream reads on, and are
marked sent in a later commit; a process that takes over sends again whatever is still
``sending`` (an agent applies an approval once, whatever the copies). Holding the stream until
the broker confirmed each batch's approvals capped a busy approver at one batch per confirm
round trip.

Per message, the work does not grow with the number of open events: the message's own event is
decided again, and, when it changes who is unavailable, only the events a guard holds that the
change can release (:meth:`FleetView.take_changes`): where a group has room again (a VM there
became available, a VM down left it, an available one joined it under a percent cap), the
events held there, in the order they were first held, until the group has no room left
(:meth:`PolicySet.room`); where a VM became unavailable or left a group, the held events of
that VM (being down costs them no room any more; moved, they are guarded by its new groups). A
VM going down never releases anything else, so nothing else is decided again. Over a burst
this is a queue per group: a freed slot goes to the longest-held event that fits, and an event
that needs no room (its VMs are down already) is released by the change that put them down, or
by the next one that leaves room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from schemas import (
    ApprovalOutcomeMessage,
    LifecycleMessage,
    NewerMessage,
    PublishNotConfirmed,
    RejectReason,
    SchemaError,
    TransportError,
    decode,
)
from schemas.messages import content_digest
from schemas.origin import OriginVerifier
from schemas.transport import Transport

from ._approvals import ApprovalSender, NoApprovalTarget
from ._approver_state import ApproverState, Hold, PendingApproval, PlannedDecision
from ._db import Database, DatabaseError, WriteConflict
from ._fleet import EventPhase, EventState, FleetView, Group, SentApproval
from ._origin import Origin
from ._policies import Action, PolicySet, Verdict
from ._stream import FleetStream, dependency_unavailable, vm_of

__all__ = ["ApproverService", "Decision"]

log = logging.getLogger(__name__)

#: Rejections that say "not on this VM": another VM of the event may still apply it.
_TRY_ANOTHER = frozenset(
    {
        RejectReason.OBSERVE_ONLY.value,
        RejectReason.NOT_FOR_THIS_VM.value,
        RejectReason.EVENT_NOT_FOUND.value,
        RejectReason.BAD_SIGNATURE.value,
        RejectReason.UNKNOWN_KEY.value,
    }
)
#: Rejections that say "not now on this VM" (it could not ask IMDS about the event): that VM
#: is tried again after :data:`RETRY_PAUSES` (another VM of the event meanwhile, if any).
_TRY_LATER = frozenset({RejectReason.IMDS_REFUSED.value})
#: Seconds before the n-th retry of a VM that could not reach IMDS (the last one repeats).
RETRY_PAUSES = (5.0, 10.0, 20.0, 40.0)
#: At most this many approvals for one version of an event; then NotBefore applies.
MAX_APPROVALS_PER_VERSION = 5
#: Approvals sent at once (each waits for the broker's confirm).
SENDS_IN_FLIGHT = 64
#: How long a stopping approver waits for the approvals it is sending.
SEND_DRAIN_SECONDS = 5.0
#: How often pruning and the look at holds happen (housekeeping).
HOUSEKEEPING_SECONDS = 1.0
#: How many times what failed handling left undecided is decided again when that fails other
#: than on the database or the broker (a defect: it would fail every time).
MAX_OWED_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class Decision:
    """What the approver decided about one event, and why."""

    event_id: str
    event_type: str
    action: Action
    reason: str
    policy: str
    at: datetime
    target: str | None = None
    event_version: str = ""
    approval_id: str | None = None


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(slots=True)
class _Plan:
    """What handling messages decided: recorded in one commit, then the approvals go out."""

    decisions: list[PlannedDecision] = field(default_factory=list)
    approvals: list[PendingApproval] = field(default_factory=list)
    made: list[Decision] = field(default_factory=list)
    #: The (action, reason) of each event's newest decision here: the approver's record of
    #: what was decided last takes them once the plan is settled, not before (a plan dropped
    #: half way records nothing).
    last: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: The messages handled (with a database: stored in the same commit).
    messages: list[LifecycleMessage] = field(default_factory=list)
    #: Approvals the broker took, and events pruned, since the last commit.
    sent: list[str] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)
    #: What deciding took on, for :meth:`ApproverService._owe` should it fail part way: the
    #: events decided about (in order), the changes of who is unavailable it took to decide on,
    #: the approvals it signed (each with its event and the approval the event had out
    #: before), and the work a failure before it left owed.
    evaluated: list[str] = field(default_factory=list)
    taken: list[tuple[set[Group], set[str]]] | None = None
    signed: list[tuple[EventState, SentApproval | None, SentApproval]] | None = None
    owed: _Owed | None = None

    def take(self, other: _Plan) -> None:
        self.decisions += other.decisions
        self.approvals += other.approvals
        self.made += other.made
        self.messages += other.messages
        self.sent += other.sent
        self.forget += other.forget

    @property
    def empty(self) -> bool:
        return not (self.decisions or self.approvals or self.messages or self.sent or self.forget)


@dataclass(slots=True)
class _Owed:
    """What handling that failed part way left undecided (:meth:`ApproverService._owe`): events
    to decide about again, in order, and the changes of who is unavailable whose held events
    are to be decided again (groups with room again, VMs that became unavailable or moved)."""

    events: dict[str, None] = field(default_factory=dict)
    freed: set[Group] = field(default_factory=set)
    downed: set[str] = field(default_factory=set)
    #: Times deciding it again failed other than on the database or the broker (a defect).
    failures: int = 0


class ApproverService:
    """``await service.run()`` until ``service.stop()``; see the module docstring."""

    def __init__(
        self,
        transport: Transport,
        signing_key: Ed25519PrivateKey,
        policies: PolicySet | None = None,
        *,
        group: str = "approver",
        decided_by: str = "approver",
        db: Database | None = None,
        fleet: FleetView | None = None,
        exclusive: bool = True,
        origin: Origin | None = None,
        verifier: OriginVerifier | None = None,
        on_decision: Callable[[Decision], None] | None = None,
        clock: Callable[[], datetime] = _now,
    ) -> None:
        self.policies = policies or PolicySet.default()
        self.fleet = fleet or FleetView(clock=clock)
        self.sender = ApprovalSender(
            transport, signing_key, fleet=self.fleet, decided_by=decided_by
        )
        self.decided_by = decided_by
        self.state = None if db is None else ApproverState(db, group)
        self.clock = clock
        self.on_decision = on_decision
        self.decisions: deque[Decision] = deque(maxlen=10_000)
        self.stream = FleetStream(
            transport,
            group,
            exclusive=exclusive,
            origin=origin,
            verifier=verifier,
            before_ack=self._stage,
            recall=self._recall,
            # With a database, the next batch is handled while the last one is written.
            pipeline=db is not None,
        )
        self.stream.add_handler(self.handle)
        self._last: dict[str, tuple[str, str]] = {}
        #: VMs an approval of an event's version was refused by, and how many were signed.
        self._tried: dict[tuple[str, str], set[str]] = {}
        self._signed: dict[tuple[str, str], int] = {}
        #: VMs that could not reach IMDS for an event's version: how often, and until when
        #: they rest (then housekeeping decides about the event again).
        self._resting: dict[tuple[str, str], dict[str, tuple[int, datetime]]] = {}
        #: Events to decide about again at a time (a resting VM's pause ends).
        self._wake: dict[str, datetime] = {}
        #: Events a guard holds, by the group whose capacity holds them (in the order held),
        #: and by VM of theirs (casefolded).
        self._waiting_on: dict[Group, dict[str, None]] = {}
        self._waiting_vm: dict[str, set[str]] = {}
        #: Event -> the groups and VMs it waits under in those two.
        self._held_on: dict[str, tuple[tuple[Group, ...], tuple[str, ...]]] = {}
        self._unsent: list[PendingApproval] = []
        #: Why a commit outside the stream's failed with changes of messages it handled (the
        #: stream's next commit fails then, so those are not acked).
        self._lost: BaseException | None = None
        #: The last commit begun (with a database): its write, under way or done.
        self._writing: asyncio.Future[None] | None = None
        #: Committed approvals on their way (with a database, sent while the stream reads on).
        self._sending: set[asyncio.Task[None]] = set()
        #: With a database: what the messages handled since the last commit changed.
        self._staged = _Plan()
        self._lock = asyncio.Lock()
        self._loaded = False
        self._held: set[str] = set()
        #: The holds read for the approvals of the batch being handled (None: read them).
        self._holds: dict[str, Hold] | None = None
        #: What handling that failed part way left undecided (:meth:`_owe`), decided with the
        #: next message, or by housekeeping.
        self._owed: _Owed | None = None
        self._next_prune = 0.0

    # ----------------------------------------------------------------------------- running

    async def run(self) -> None:
        if self.state is None:
            log.warning(
                "approver %s: no database (--db): its state lives in memory only; a standby "
                "that takes over after a failover starts from nothing (events already approved "
                "or held, hook results, who is down are forgotten)",
                self.decided_by,
            )
        log.info(
            "approver %s: reading group %s, %d policies",
            self.decided_by,
            self.stream.group,
            len(self.policies.policies),
        )
        housekeeping = asyncio.create_task(self._housekeeping())
        try:
            await self.stream.run()
        finally:
            housekeeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await housekeeping
            if self._sending:  # let them finish; what is cut off stays ``sending``
                _, late = await asyncio.wait(self._sending, timeout=SEND_DRAIN_SECONDS)
                for task in late:
                    task.cancel()
                if late:
                    log.warning(
                        "approver %s: %d approval send(s) cut off at stop: still 'sending', "
                        "sent again by the next active approver",
                        self.decided_by,
                        len(late),
                    )
                    await asyncio.wait(late)

    def stop(self) -> None:
        self.stream.stop()

    async def handle(self, message: LifecycleMessage) -> None:
        """Take one message into account. Without a database its approvals are sent before
        this returns; with one, what it changed is committed by :meth:`commit`. When it
        fails, the message is not taken: the view gives it back, for the stream's retry to
        take anew (or for good, dead-lettered: the database never has it either)."""
        async with self._lock:
            if self._staged.empty:  # the first message since the last commit
                await self._sync()
            try:
                await self._send_unsent()
            except TransportError as exc:
                # Not this message's failure: the approvals stay unsent, for the next message,
                # housekeeping (with a database) or the batch's commit, which fails and brings
                # the batch back while one is unsent (without one).
                log.info("approvals a lost link stopped are still not confirmed (%s)", exc)
            if self._owed is not None:  # on the view before this message, as it was left
                await self._decide_owed(commit=False)
            # Still owed: deciding them failed again just now. They are decided as owed work
            # (which a failure does not cost a message), not for this message: a defect met
            # deciding one event must not fail every message that frees room for it (each
            # retried, then dead-lettered, and its change lost).
            owing = () if self._owed is None else tuple(self._owed.events)
            plan = _Plan(messages=[message])
            self.fleet.take_changes()
            state, taken = self.fleet.take(message)
            # From here on the view holds the message (it takes one whole or not at all). Should
            # handling fail, the message is given back: it is not taken (the stream retries it,
            # or dead-letters it, and the database never has it), so neither is the view to
            # have it, nor decisions after this one to rest on it; and what deciding took on
            # is owed (see _owe).
            put_back = self._keep_refusal(message, state)
            try:
                if isinstance(message, ApprovalOutcomeMessage) and state is not None:
                    self._outcome(message, state)
                if state is not None:
                    await self._evaluate(state, plan)
                # Before the changes are taken: an event a prune ends (the VM it waited for
                # fell silent) or forgets frees room that held events are decided again for.
                self._prune_now_and_then()
                await self._reevaluate(plan, skip=state, owing=owing)
            except BaseException:
                self.fleet.give_back(taken)
                if put_back is not None:
                    put_back()
                self._owe(plan, state)
                raise
            await self._settle(plan, commit=False)

    async def commit(self) -> None:
        """Commit, in one transaction, what the messages handled since the last commit changed
        (the messages, their decisions, the approvals signed as ``sending``), then send those
        approvals. When it fails, the view is loaded again from the database before the next
        decision. Without a database: send the approvals the messages led to, together, and
        return once the broker confirmed them all (so a crash before brings the messages
        back)."""
        written = await self._stage()
        if written is not None:
            await written

    async def _stage(self) -> asyncio.Future[None] | None:
        """The stream's ``before_ack``: :meth:`commit`, returning once what it commits is fixed
        (with a database: its write is under way, returned; the stream handles the next batch
        meanwhile and acks this one once it is written).

        A commit outside the stream's (housekeeping's, the console's) takes along what the
        messages handled since changed; when it failed, this fails too, so the stream does not
        ack messages whose changes were never committed."""
        async with self._lock:
            lost, self._lost = self._lost, None
            if lost is not None:
                # Those handled since were decided on a view loaded again: the stream drops
                # them with the rest of the batch, so their changes go too.
                self._staged = _Plan()
                self._loaded = False
                # Of the kind of that failure: a database that could not be reached is waited
                # for (the stream handles the batch again in place), a refusal is not.
                failure = TransportError if dependency_unavailable(lost) else DatabaseError
                raise failure(
                    f"a commit outside the stream's failed ({lost}) and took along what "
                    "messages of this batch changed: not acked; they are handled again"
                ) from lost
            if self.state is None:
                await self._commit()
                return None
            # Written in the background: a commit begun after this one follows it, or fails
            # with it (the state version it expects is the one this one writes).
            return self._begin_commit(own=True)

    async def _settle(self, plan: _Plan, *, commit: bool) -> None:
        """Record what ``plan`` decided and stage it for the next commit (now when ``commit``):
        with a database, the commit stores it and then sends its approvals; without one, it
        sends them and waits for their confirms."""
        # Recorded from here on: the same decision again is not (see _record).
        self._last.update(plan.last)
        if self.state is None:
            self._made(plan)
            self._staged.approvals += plan.approvals
        else:
            self._staged.take(plan)
        if commit:
            await self._commit()

    async def _commit(self) -> None:
        if self.state is None:
            plan, self._staged = self._staged, _Plan()
            self._holds = None
            # Those a lost link stopped too: the batch is acked only once none is left unsent.
            unsent, self._unsent = self._unsent, []
            await self._send(unsent + plan.approvals)
            return
        write = self._begin_commit(own=False)
        if write is not None:
            await write

    def _begin_commit(self, *, own: bool) -> asyncio.Future[None] | None:
        """Begin the commit of what is staged (fixed now: what is handled from here on goes in
        the next one); its write runs in the background, in order after those begun before.
        Once written, its decisions are recorded and its approvals sent. ``own``: the stream's
        commit, which learns of its failure itself; another's failure makes the stream's next
        commit fail (``_lost``)."""
        assert self.state is not None
        plan, self._staged = self._staged, _Plan()
        self._holds = None
        if plan.empty:
            return None
        written = self.state.commit(
            plan.messages, plan.decisions, plan.approvals, sent=plan.sent, forget=plan.forget
        )
        before = self._writing

        async def finish() -> None:
            try:
                if before is not None and not before.done():
                    # In the order begun: on PostgreSQL's pool a later write could reach the
                    # database first and find the version it expects not yet written. One that
                    # failed before this began needs no wait: made on the view it left, this
                    # one is refused by the database's guard; made after a reload, it goes in.
                    await asyncio.wait([before])
                    if not before.cancelled() and before.exception() is not None:
                        written.close()  # never sent: it expects what that one did not write
                        raise WriteConflict(
                            f"approver group {self.stream.group}: a commit before this one "
                            f"failed ({before.exception()}): this one is not written either"
                        )
                await written
            except BaseException as exc:
                self._loaded = False  # the view holds what was not committed: load it again
                if plan.messages and not own:  # what the stream handled is not committed
                    self._lost = exc
                raise
            self._made(plan)
            self._send_detached(plan.approvals)

        write = self._writing = asyncio.ensure_future(finish())
        return write

    # ----------------------------------------------------------------------------- deciding

    async def evaluate(self, state: EventState) -> None:
        """Decide about one event now (outside the message flow: tests, the console)."""
        async with self._lock:
            self.fleet.take_changes()
            await self._decide(state)

    async def _decide(self, state: EventState) -> None:
        """Decide about ``state`` and what that decision changes for the others, as one plan
        (committed), owed when it fails part way."""
        plan = _Plan()
        try:
            await self._evaluate(state, plan)
            await self._reevaluate(plan, skip=state)
        except BaseException:
            self._owe(plan, state)
            raise
        await self._settle(plan, commit=True)

    async def _decide_owed(self, *, commit: bool) -> None:
        """Decide what handling that failed part way left undecided (see :meth:`_owe`), before
        the next message (``commit``: now, for housekeeping: the failed message may have been
        dead-lettered, and in a quiet fleet the next one may be a minute away).

        In a plan of its own: should it fail again, it stays owed and the message about to be
        handled is not failed for it (a defect met deciding one event must not fail every
        message after it). A failure of the database or the broker waits for them to come
        back, as the messages do; after :data:`MAX_OWED_ATTEMPTS` other failures it is given
        up, saying what is left undecided."""
        owed, self._owed = self._owed, None
        if owed is None:
            return
        plan = _Plan(owed=owed)  # owed again should this fail too
        try:
            await self._reevaluate(plan, skip=None, owed=owed)
        except Exception as exc:
            again = self._owe(plan, None)
            if not isinstance(exc, DatabaseError | TransportError):
                again.failures += 1
            if again.failures < MAX_OWED_ATTEMPTS:
                log.warning(
                    "approver %s: deciding again what failed handling left undecided failed "
                    "(%s: %s): tried again with the next message",
                    self.decided_by,
                    type(exc).__name__,
                    exc,
                )
                return
            self._owed = None
            log.error(
                "approver %s: deciding again %s and the events held on %s failed %d times "
                "(last: %s: %s): given up; they are decided again with the next change of "
                "their groups, else NotBefore applies",
                self.decided_by,
                ", ".join(again.events) or "no event",
                ", ".join(f"{key}={value}" for key, value in again.freed) or "no group",
                again.failures,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
            return
        except BaseException:
            self._owe(plan, None)
            raise
        await self._settle(plan, commit=commit)

    def _owe(self, plan: _Plan, state: EventState | None) -> _Owed:
        """Deciding failed part way (a database read, a defect): ``plan`` is dropped, so
        nothing it decided is recorded and none of its approvals goes out; the approvals it
        signed are taken back from the view (their events and VMs are as before them), and so
        is a message that failed (:meth:`handle` gives it back first). What deciding took on
        is owed all the same, decided with the next message (the retry or another) or by
        housekeeping: the events it decided about and ``state``'s, and the changes of who is
        unavailable it took or left (those the message made, and their undoing; a prune's,
        which stays), whose held events are decided again as for a new change. Without this,
        the held events a freed slot released waited for their NotBefore, and an approval
        signed and never sent kept its event from being approved. Deciding an event again on
        a view that did not change for it decides the same (recorded once)."""
        owed = _Owed()
        for before in (plan.owed, self._owed):
            if before is not None:
                owed.events.update(before.events)
                owed.freed |= before.freed
                owed.downed |= before.downed
                owed.failures = max(owed.failures, before.failures)
        for signed, previous, sent in reversed(plan.signed or ()):
            key = (signed.event_id, sent.event_version)
            if self._signed.get(key, 0) > 1:
                self._signed[key] -= 1
            else:
                self._signed.pop(key, None)
            if signed.sent is sent:
                signed.sent = previous
                if previous is not None:
                    signed.superseded.pop(previous.approval_id, None)
            if self.fleet.event(signed.event_id) is signed:  # not one the message made, gone
                self.fleet.refresh(signed)
        owed.events.update(dict.fromkeys(plan.evaluated))
        if state is not None:
            owed.events[state.event_id] = None
        for freed, downed in [*(plan.taken or ()), self.fleet.take_changes()]:
            owed.freed |= freed
            owed.downed |= downed
        self._owed = owed
        log.info(
            "approver %s: deciding stopped part way: nothing it decided is recorded or sent; "
            "%d event(s) and the events held on %d group(s) and %d VM(s) it was deciding about "
            "are decided again before the next message (or by housekeeping)",
            self.decided_by,
            len(owed.events),
            len(owed.freed),
            len(owed.downed),
        )
        return owed

    async def _evaluate(self, state: EventState, plan: _Plan) -> None:
        """Decide about one event (while it is Scheduled and no approval of its current
        version is out)."""
        plan.evaluated.append(state.event_id)
        if state.phase is not EventPhase.SCHEDULED or state.approved_or_sent:
            self._unwait(state.event_id)
            return
        version = state.version
        verdict = self.policies.decide(state, self.fleet, self.clock())
        if verdict.action is not Action.APPROVE:
            self._record(state, verdict, plan)
            self._wait(state, verdict.groups)
            return
        self._unwait(state.event_id)
        hold = await self._hold(state.event_id)
        if hold is not None:
            why = f"{verdict.reason}, but held by {hold}: NotBefore applies unless released"
            self._record(state, Verdict(Action.WAIT, why, "hold"), plan)
            return
        key = (state.event_id, version)
        if self._signed.get(key, 0) >= MAX_APPROVALS_PER_VERSION:
            why = (
                f"{self._signed[key]} approvals of this version were refused or could not be "
                "delivered: NotBefore applies"
            )
            self._record(state, Verdict(Action.WAIT, why, "approver"), plan)
            return
        now = self.clock()
        resting = {vm for vm, (_, until) in self._resting.get(key, {}).items() if until > now}
        try:
            approval, address = self.sender.prepare(
                state.event_id,
                event_version=version,
                reason=verdict.reason,
                exclude=frozenset(self._tried.get(key, set()) | resting),
            )
        except NoApprovalTarget as exc:
            why = str(exc)
            if resting:
                again = min(self._resting[key][vm][1] for vm in resting)
                why = (
                    f"{verdict.reason}, but {', '.join(sorted(resting))} could not reach IMDS "
                    f"to apply it: approving again at {again:%H:%M:%S}"
                )
            self._record(state, Verdict(Action.WAIT, why, verdict.policy), plan)
            return
        self._signed[key] = self._signed.get(key, 0) + 1
        previous = state.sent
        sent = SentApproval(approval.approval_id, version, approval.vm, self.clock())
        state.send(sent)
        if plan.signed is None:
            plan.signed = []
        plan.signed.append((state, previous, sent))  # taken back should deciding fail
        plan.approvals.append(PendingApproval(approval, address))
        self._record(state, verdict, plan, target=approval.vm, approval_id=approval.approval_id)
        self.fleet.refresh(state)

    async def _reevaluate(
        self,
        plan: _Plan,
        skip: EventState | None,
        owed: _Owed | None = None,
        owing: Iterable[str] = (),
    ) -> None:
        """Who is unavailable changed: decide again the held events the change can release
        (see the module docstring), and only those, but not ``owing`` (left to owed work);
        with ``owed`` (see :meth:`_owe`), its events first, then the held events of its
        changes as of the view's."""
        seen: set[str] = set(owing)
        if skip is not None:
            seen.add(skip.event_id)

        async def again(event_id: str) -> None:
            seen.add(event_id)
            other = self.fleet.event(event_id)
            if other is None:
                self._unwait(event_id)
            else:
                await self._evaluate(other, plan)

        freed, downed = self.fleet.take_changes()
        if owed is not None:
            for event_id in owed.events:
                if event_id not in seen:
                    await again(event_id)
            freed |= owed.freed
            downed |= owed.downed
        while freed or downed:
            if plan.taken is None:
                plan.taken = []
            plan.taken.append((freed, downed))
            for vm in downed:
                for event_id in list(self._waiting_vm.get(vm, ())):
                    if event_id not in seen:
                        await again(event_id)
            for group in freed:
                for event_id in list(self._waiting_on.get(group, ())):
                    room = self.policies.room(self.fleet, group)
                    if room is not None and room <= 0:
                        break  # full again: the rest wait for the next freed slot
                    if event_id not in seen:
                        await again(event_id)
            freed, downed = self.fleet.take_changes()

    def _wait(self, state: EventState, groups: tuple[Group, ...]) -> None:
        """A guard holds the event on ``groups`` (none: nothing holds it any more). It keeps its
        place in the groups it was held on already."""
        event_id = state.event_id
        # Each VM once: Resources may name one twice (``web-2``, ``WEB-2``), and :meth:`_drop`
        # takes the event off each VM's list once per name it is given.
        vms = tuple(dict.fromkeys(r.casefold() for r in state.resources)) if groups else ()
        old_groups, old_vms = self._held_on.pop(event_id, ((), ()))
        self._drop(
            event_id,
            [group for group in old_groups if group not in groups],
            [vm for vm in old_vms if vm not in vms],
        )
        if groups:
            for group in groups:
                self._waiting_on.setdefault(group, {}).setdefault(event_id, None)
            for vm in vms:
                self._waiting_vm.setdefault(vm, set()).add(event_id)
            self._held_on[event_id] = (groups, vms)

    def _unwait(self, event_id: str) -> None:
        groups, vms = self._held_on.pop(event_id, ((), ()))
        self._drop(event_id, groups, vms)

    def _drop(self, event_id: str, groups: Iterable[Group], vms: Iterable[str]) -> None:
        for group in groups:
            events = self._waiting_on[group]
            del events[event_id]
            if not events:
                del self._waiting_on[group]
        for vm in vms:
            held = self._waiting_vm[vm]
            held.discard(event_id)
            if not held:
                del self._waiting_vm[vm]

    def _groups_of(self, state: EventState) -> list[Group]:
        """Every group of the event's VMs, once each."""
        return list(dict.fromkeys(g for vm in state.resources for g in self.fleet.groups(vm)))

    def _keep_refusal(
        self, message: LifecycleMessage, state: EventState | None
    ) -> Callable[[], None] | None:
        """What :meth:`_outcome` may change for ``message`` outside the view (the VMs refused
        by and resting for the version its event has out), as it is now: a function that puts
        it back should the handling fail (the refusal was not taken; its retry counts it once,
        not twice)."""
        if not isinstance(message, ApprovalOutcomeMessage) or state is None:
            return None
        sent = state.sent
        if sent is None:
            return None  # it can settle only an earlier version's approval: nothing counted
        key, event_id = (state.event_id, sent.event_version), state.event_id
        tried = self._tried.get(key)
        tried = None if tried is None else set(tried)
        resting = self._resting.get(key)
        resting = None if resting is None else dict(resting)
        wake = self._wake.get(event_id)

        def put_back() -> None:
            if tried is None:
                self._tried.pop(key, None)
            else:
                self._tried[key] = tried
            if resting is None:
                self._resting.pop(key, None)
            else:
                self._resting[key] = resting
            if wake is None:
                self._wake.pop(event_id, None)
            else:
                self._wake[event_id] = wake

        return put_back

    def _outcome(self, message: ApprovalOutcomeMessage, state: EventState) -> None:
        """An agent refused one of this approver's approvals: it is void; a VM-specific
        refusal sends the next approval elsewhere."""
        data = message.data
        sent = state.sent
        if data.applied or data.decided_by != self.decided_by:
            return
        if not state.settle(data.approval_id, message.vm.name):
            return  # not an approval of ours still out to that VM
        if sent is None or sent.approval_id != data.approval_id:
            log.info(
                "approval %s of %s (an earlier version) rejected by %s: %s; no longer counted",
                data.approval_id,
                data.event_id,
                message.vm.name,
                data.reason,
            )
            self.fleet.refresh(state)
            return
        log.warning(
            "approval %s of %s (version %s) rejected by %s: %s %s",
            data.approval_id,
            data.event_id,
            sent.event_version,
            message.vm.name,
            data.reason,
            data.detail,
        )
        key = (state.event_id, sent.event_version)
        if data.reason in _TRY_ANOTHER:
            self._tried.setdefault(key, set()).add(message.vm.name.casefold())
        elif data.reason in _TRY_LATER:
            vm = message.vm.name.casefold()
            times, _ = self._resting.setdefault(key, {}).get(vm, (0, self.clock()))
            pause = RETRY_PAUSES[min(times, len(RETRY_PAUSES) - 1)]
            until = self.clock() + timedelta(seconds=pause)
            self._resting[key][vm] = (times + 1, until)
            self._wake[state.event_id] = min(until, self._wake.get(state.event_id, until))
        self.fleet.refresh(state)

    async def _hold(self, event_id: str) -> str | None:
        """Who holds the event. Read once per commit, at the first approval decided since the
        last one: fresh before any approval of the batch goes out (only an approval is ever
        held back)."""
        if self.state is None:
            return None
        if self._holds is None:
            self._holds = await self.state.holds()
            self._held = set(self._holds)
        hold = self._holds.get(event_id)
        return None if hold is None else f"{hold.held_by} ({hold.reason})"

    def _record(
        self,
        state: EventState,
        verdict: Verdict,
        plan: _Plan,
        *,
        target: str | None = None,
        approval_id: str | None = None,
    ) -> None:
        key = (verdict.action.value, verdict.reason)
        event_id = state.event_id
        last = plan.last.get(event_id) or self._last.get(event_id)
        if last == key and verdict.action is not Action.APPROVE:
            return  # the same decision again: recorded once
        # Taken as recorded once the plan is settled (_settle): a handling that fails after
        # this drops the decision, and its retry, deciding the same again, records it. Taken
        # at once, the retry found it recorded and the ledger never had it.
        plan.last[event_id] = key
        at = self.clock()
        decision = Decision(
            event_id=state.event_id,
            event_type=state.event_type,
            action=verdict.action,
            reason=verdict.reason,
            policy=verdict.policy,
            at=at,
            target=target,
            event_version=state.version,
            approval_id=approval_id,
        )
        plan.made.append(decision)
        plan.decisions.append(
            PlannedDecision(
                event_id=state.event_id,
                event_type=state.event_type,
                action=verdict.action.value,
                reason=verdict.reason,
                policy=verdict.policy,
                decided_by=self.decided_by,
                event_version=state.version,
                at=at,
                target=target,
                approval_id=approval_id,
            )
        )

    def _made(self, plan: _Plan) -> None:
        for decision in plan.made:
            self.decisions.append(decision)
            log.info(
                "decision on %s (%s, version %s): %s by %s: %s%s",
                decision.event_id,
                decision.event_type,
                decision.event_version,
                decision.action.value,
                decision.policy,
                decision.reason,
                f" -> {decision.target}" if decision.target else "",
            )
            if self.on_decision is not None:
                self.on_decision(decision)

    # ------------------------------------------------------------------------------ sending

    def _send_detached(self, approvals: list[PendingApproval]) -> None:
        """Send committed approvals without holding up the stream (see the module docstring);
        what happens to them is settled under the lock when the broker has answered."""
        if not approvals:
            return

        async def send() -> None:
            outcomes = await self._deliver(approvals)
            async with self._lock:
                try:
                    await self._settle_sends(approvals, outcomes)
                except TransportError as exc:
                    log.warning("approvals not confirmed (%s): sent again within a second", exc)
                except Exception:  # a task's error would otherwise surface only when collected
                    log.exception(
                        "settling sent approvals failed: the events it was deciding are decided "
                        "again before the next message (or within a second), and what is still "
                        "'sending' goes out again"
                    )

        task = asyncio.create_task(send(), name="approver-send")
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, approvals: list[PendingApproval]) -> None:
        """Send approvals (without a database, or again) and settle them: see
        :meth:`_settle_sends`."""
        if approvals:
            await self._settle_sends(approvals, await self._deliver(approvals))

    async def _deliver(self, approvals: list[PendingApproval]) -> list[BaseException | None]:
        """Send approvals, up to :data:`SENDS_IN_FLIGHT` at once (each waits for the broker's
        confirm: one after the other, a wave of 1,800 approvals took 36 s); each one's failure,
        if any."""
        room = asyncio.Semaphore(SENDS_IN_FLIGHT)

        async def send(pending: PendingApproval) -> BaseException | None:
            async with room:
                try:
                    await self.sender.send(pending.approval, pending.address)
                except (PublishNotConfirmed, TransportError) as exc:
                    return exc
                except Exception as exc:
                    # Not the transport's words (a library's surprise): the send's outcome is
                    # unknown, so the approval is kept and sent again, as after a lost link;
                    # before, it ended the detached send unseen and the batch went unsettled.
                    log.exception(
                        "approval %s for %s: sending it failed unexpectedly; kept, sent again",
                        pending.approval.approval_id,
                        pending.approval.vm,
                    )
                    return TransportError(f"sending approval failed: {exc!r}")
                return None

        return await asyncio.gather(*(send(pending) for pending in approvals))

    async def _settle_sends(
        self, approvals: list[PendingApproval], outcomes: list[BaseException | None]
    ) -> None:
        """One the broker refused for good (no queue for that VM) is void and the event is
        decided again (another VM); those a lost link stopped are kept for the next message,
        and this raises the link's error (without a database the message comes back)."""
        link_lost: TransportError | None = None
        for pending, outcome in zip(approvals, outcomes, strict=True):
            approval = pending.approval
            if isinstance(outcome, PublishNotConfirmed):
                log.warning(
                    "approval %s for %s could not be delivered (%s): trying another VM",
                    approval.approval_id,
                    approval.vm,
                    outcome,
                )
                await self._undeliverable(pending)
            elif isinstance(outcome, TransportError):
                self._unsent.append(pending)
                link_lost = link_lost or outcome
            elif self.state is not None:
                self._staged.sent.append(approval.approval_id)  # marked in the next commit
        if link_lost is not None:
            raise link_lost

    async def _undeliverable(self, pending: PendingApproval) -> None:
        approval = pending.approval
        state = self.fleet.event(approval.event_id)
        if self.state is not None:
            self._staged.sent.append(approval.approval_id)  # settled: it will never go out
        if state is None:
            return
        sent = state.sent
        if not state.settle(approval.approval_id, approval.vm):
            return
        if sent is not None and sent.approval_id == approval.approval_id:
            key = (state.event_id, sent.event_version)
            self._tried.setdefault(key, set()).add(approval.vm.casefold())
        self.fleet.refresh(state)
        await self._decide(state)

    async def _send_unsent(self) -> None:
        unsent, self._unsent = self._unsent, []
        if unsent:
            log.info("sending %d approval(s) again that were not confirmed", len(unsent))
            await self._send(unsent)

    # ---------------------------------------------------------------------- durable state

    async def _recall(self, message: LifecycleMessage | NewerMessage) -> str | None:
        """For a redelivered message this process does not remember (the stream's ``recall``):
        the digest of the message the group's state holds from its VM under its id, or None. A
        process taking over the queue is given again what the one before committed but could not
        ack; the state holds every message about an open event and each agent's last own message.
        The state is loaded first when another process wrote since, so what that one left to
        send goes out (housekeeping) even when nothing this process is given is new."""
        if self.state is None:
            return None
        async with self._lock:
            if self._staged.empty:  # else this process wrote last: nothing to load
                await self._sync()
            raw = await self.state.stored(vm_of(message), message.id)
        if raw is None:
            return None
        try:
            return content_digest(decode(raw))
        except SchemaError:  # only a downgrade could make a stored message unreadable
            return ""

    async def _active(self) -> bool:
        """Whether this process wrote the state last (or read it since the last write): a
        commit of its own is being written, or the stored version is the one it knows."""
        assert self.state is not None
        if not self._loaded:
            return False
        writing = self._writing
        return (writing is not None and not writing.done()) or not await self.state.stale()

    async def _sync(self) -> None:
        """Load the state when another process wrote since (a failover), after a failed commit
        or on first use. Not while a commit of this process is being written: its view is the
        newest then, and if another process wrote since, that commit fails and the state is
        loaded at the next message."""
        if self.state is None:
            return
        if await self._active():
            return
        writing = self._writing
        if writing is not None:  # commits still being written land (or fail) first
            with contextlib.suppress(Exception):
                await writing
        started = time.monotonic()
        fleet = FleetView(
            liveness_timeout=self.fleet.liveness_timeout,
            retention=self.fleet.retention,
            expiry=self.fleet.expiry,
            clock=self.fleet.clock,
        )
        loaded = await self.state.load(fleet)
        self.fleet = fleet
        self.sender.fleet = fleet
        self._last = dict(loaded.last_decisions)
        self._tried.clear()
        self._signed.clear()
        self._resting.clear()
        self._wake.clear()
        self._waiting_on.clear()
        self._waiting_vm.clear()
        self._held_on.clear()
        self._unsent = list(loaded.unsent)
        for state in fleet.events(open_only=True):
            if state.sent is not None:
                key = (state.event_id, state.sent.event_version)
                self._signed[key] = self._signed.get(key, 0) + 1
            action = loaded.last_decisions.get(state.event_id, ("", ""))[0]
            if action == Action.WAIT.value:
                # Its guard's groups are not stored: wait on every group of its VMs.
                self._wait(state, tuple(self._groups_of(state)))
        self._loaded = True
        log.info(
            "approver %s: state %s (%d messages, %d open events, %d approval(s) to send again) "
            "in %.2f s",
            self.decided_by,
            "loaded" if loaded.messages else "empty",
            loaded.messages,
            sum(1 for _ in fleet.events(open_only=True)),
            len(loaded.unsent),
            time.monotonic() - started,
        )

    def _prune_now_and_then(self) -> None:
        now = time.monotonic()
        if now < self._next_prune:
            return
        self._next_prune = now + 60.0
        gone = self.fleet.prune()
        for event_id in gone:
            self._last.pop(event_id, None)
            self._unwait(event_id)
        for key in [k for k in self._signed if k[0] in gone]:
            self._signed.pop(key, None)
            self._tried.pop(key, None)
            self._resting.pop(key, None)
        for event_id in gone:
            self._wake.pop(event_id, None)
        if self.state is not None:
            self._staged.forget += gone  # with the next commit

    async def _housekeeping(self) -> None:
        """Releases of holds and the end of a resting VM's pause take effect without waiting
        for the next message. With a database, only the process that wrote last acts (the
        active one: a standby receives nothing)."""
        failing_since: float | None = None  # housekeeping's dependency unavailable since
        said = 0.0
        while True:
            await asyncio.sleep(HOUSEKEEPING_SECONDS)
            try:
                if self.state is not None:
                    if not await self._active():
                        continue
                    if self._unsent:  # a lost link stopped them; the next message may be far
                        async with self._lock:
                            await self._send_unsent()
                    if not self._staged.empty:  # approvals sent since the last message
                        async with self._lock:
                            await self._commit()
                    holds = set(await self.state.holds())
                    released = self._held - holds
                    self._held = holds
                    for event_id in released:
                        state = self.fleet.event(event_id)
                        if state is not None:
                            log.info("hold on %s released: deciding again", event_id)
                            self._last.pop(event_id, None)
                            await self.evaluate(state)
                if self._owed is not None:
                    async with self._lock:
                        await self._decide_owed(commit=True)
                now = self.clock()
                for event_id in [e for e, at in self._wake.items() if at <= now]:
                    del self._wake[event_id]
                    state = self.fleet.event(event_id)
                    if state is not None:
                        log.info("%s: trying again a VM that could not reach IMDS", event_id)
                        await self.evaluate(state)
            except TransportError as exc:
                # A database or broker outage: said when it begins and once a minute, not at
                # every try (once a second, for as long as a restart or failover takes).
                moment = time.monotonic()
                if failing_since is None or moment - said >= 60.0:
                    log.warning(
                        "approver housekeeping failed (%s); trying again every %g s%s",
                        exc,
                        HOUSEKEEPING_SECONDS,
                        ""
                        if failing_since is None
                        else f", failing for {moment - failing_since:.0f} s",
                    )
                    said = moment
                if failing_since is None:
                    failing_since = moment
            except Exception:
                log.exception("approver housekeeping failed; trying again in a second")
            else:
                if failing_since is not None:
                    log.info(
                        "approver housekeeping works again after %.0f s",
                        time.monotonic() - failing_since,
                    )
                    failing_since = None
