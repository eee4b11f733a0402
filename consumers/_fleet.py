"""The fleet view: every VM's reports on each event merged into one picture, and each agent's
liveness from its heartbeats.

One event (one EventId) is seen by every VM in its ``Resources``; each VM's agent reports what
*it* saw. The view answers what an operator asks: who is hit, who reported what and when, who is
silent, how long until NotBefore, and whether the event started, completed or was canceled.

It also answers what a policy asks, at a cost that does not grow with the number of open events:
which VMs are unavailable (an event that hits them started, or an approval of its current
version was sent or applied, and it is not over), per group (scale set, zone, fault or update
domain), from indexes kept up to date as messages arrive (:meth:`FleetView.down_in`). A VM's
report cannot make another VM available: a VM any version of the event named stays counted,
and the event is over only once every VM still reporting it (its agent live) said so.

Memory stays bounded: :meth:`FleetView.prune` forgets events over for longer than ``retention``,
and open events nobody reported on for ``expiry`` (a VM that vanished with an event in hand):
an open event expires ``expiry`` after its last report, and not before its NotBefore is that
far in the past.

>>> view = FleetView()
>>> view.apply(message)                       # doctest: +SKIP
>>> view.event("EVT-1").silent()              # doctest: +SKIP
('web-9',)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import NamedTuple

from schemas import (
    LIVENESS_PER_HEARTBEAT,
    AgentMessage,
    ApprovalOutcomeMessage,
    HookResultMessage,
    LifecycleMessage,
    MessageType,
    ReplyAddress,
    ScheduledEvent,
    TransitionMessage,
    VmIdentity,
    event_version,
)

__all__ = [
    "GROUP_KEYS",
    "AgentState",
    "EventPhase",
    "EventState",
    "FleetView",
    "SentApproval",
    "Taken",
    "VmReport",
]

#: What a VM may be grouped by (its identity's fields).
GROUP_KEYS = ("scale_set", "zone", "fault_domain", "update_domain")

#: Per VM and event: the hook results kept (by transition and hook, the newest) and the approval
#: outcomes kept. An agent sends a handful; more is a VM inventing names or ids, and what it
#: sends must not grow the view (nor each refresh's scan) without bound.
MAX_HOOKS_PER_VM = 64
MAX_OUTCOMES_PER_VM = 32
#: One group: (what it is grouped by, the value), e.g. ("scale_set", "web").
Group = tuple[str, object]


class EventPhase(StrEnum):
    """Where an event is, merged over its VMs' reports: started when any VM saw it start; over
    (completed, canceled) once every VM that reported it says so, or its agent is no longer live
    (each VM speaks for itself: one VM's report cannot end another's maintenance)."""

    SCHEDULED = "scheduled"
    STARTED = "started"
    COMPLETED = "completed"
    CANCELED = "canceled"

    @property
    def is_over(self) -> bool:
        return self in (EventPhase.COMPLETED, EventPhase.CANCELED)


_PHASE_OF = {
    MessageType.SCHEDULED: EventPhase.SCHEDULED,
    MessageType.STARTED: EventPhase.STARTED,
    MessageType.COMPLETED: EventPhase.COMPLETED,
    MessageType.CANCELED: EventPhase.CANCELED,
}
_ENDS = frozenset({MessageType.COMPLETED, MessageType.CANCELED})


def _bound_outcomes(state: EventState, vm: str) -> None:
    """Keep at most :data:`MAX_OUTCOMES_PER_VM` of ``vm``'s outcomes for the event, dropping its
    oldest refusal first: one applied outcome is what counts (:attr:`EventState.approved`), and
    a VM sending refusal after refusal under new ids must not pile them up, nor push out the
    applied one that keeps its place counted."""
    own = [key for key in state.outcomes if key[0] == vm]
    if len(own) <= MAX_OUTCOMES_PER_VM:
        return
    refused = [key for key in own if not state.outcomes[key].data.applied]
    del state.outcomes[(refused or own)[0]]


def _listed(state: EventState) -> set[str]:
    """The event's Resources as each VM last reported them, and as the view holds it now."""
    listed = {resource.casefold() for resource in state.event.resources}
    for report in state.reports.values():
        listed |= report.resources
    return listed


_RANK = {
    EventPhase.SCHEDULED: 0,
    EventPhase.STARTED: 1,
    EventPhase.CANCELED: 2,
    EventPhase.COMPLETED: 3,
}


@dataclass(frozen=True, slots=True)
class VmReport:
    """The last thing one VM reported about one event."""

    vm: str
    kind: MessageType
    status: str
    at: datetime
    message_id: str
    #: Whether the event, as this VM reported it, lists this VM in its Resources (an agent with
    #: ``--all-events`` also reports events of its neighbours).
    listed: bool = True
    #: The event's Resources as this VM reported it (casefolded).
    resources: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class SentApproval:
    """An approval an approver signed for one version of an event."""

    approval_id: str
    event_version: str
    target: str
    at: datetime


@dataclass(slots=True)
class EventState:
    """One event as the whole fleet reported it."""

    event_id: str
    event: ScheduledEvent
    phase: EventPhase
    first_seen: datetime
    last_update: datetime
    #: The last report of each VM, by VM name as it reported it.
    reports: dict[str, VmReport] = field(default_factory=dict)
    #: Hook results by VM (name casefolded), then by ``transition/hook``.
    hooks: dict[str, dict[str, HookResultMessage]] = field(default_factory=dict)
    #: ``approval.applied`` / ``approval.rejected`` outcomes by (VM casefolded, message id), in
    #: arrival order: ids are the senders' own, so one VM's must not replace another's.
    outcomes: dict[tuple[str, str], ApprovalOutcomeMessage] = field(default_factory=dict)
    #: The approval the approver signed last (set by the approver service, :meth:`send`).
    sent: SentApproval | None = None
    #: Approvals of earlier versions still out (approval id -> target): none refused yet, so
    #: any of them may still be applied, if its VM's IMDS still shows the version it names
    #: (reports of a new version may be false, or come before that VM's own poll sees it).
    superseded: dict[str, str] = field(default_factory=dict)
    #: :func:`~schemas.event_version` of ``event`` (kept with it).
    version: str = ""
    #: Whether the view counts the event's VMs as unavailable (see :meth:`FleetView.refresh`).
    counted_down: bool = False
    #: The VMs (casefolded) counted unavailable for it: its Resources as each VM last reported
    #: them, together. A newer report cannot take a VM out (a VM's report speaks for itself, not
    #: for the VMs another one left out), and a VM's report replaces only its own contribution
    #: (one that sends version after version of made-up names does not pile them up).
    listed: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.version = self.version or event_version(self.event)
        self.listed.update(resource.casefold() for resource in self.event.resources)

    @property
    def resources(self) -> tuple[str, ...]:
        return self.event.resources

    @property
    def event_type(self) -> str:
        return self.event.event_type

    @property
    def started(self) -> bool:
        return self.phase in (EventPhase.STARTED, EventPhase.COMPLETED)

    @property
    def completed(self) -> bool:
        return self.phase is EventPhase.COMPLETED

    @property
    def canceled(self) -> bool:
        return self.phase is EventPhase.CANCELED

    @property
    def approved(self) -> bool:
        """Some VM applied an approval for it (the event proceeds for every VM)."""
        return any(
            outcome.data.applied and not outcome.data.dry_run for outcome in self.outcomes.values()
        )

    @property
    def approval_pending(self) -> bool:
        """An approval of the event's *current* version was sent and not rejected (one for an
        earlier version is void: the agent refuses it as ``event-changed``)."""
        return self.sent is not None and self.sent.event_version == self.version

    @property
    def approved_or_sent(self) -> bool:
        return self.approval_pending or self.approved

    @property
    def approval_sent_at(self) -> datetime | None:
        return self.sent.at if self.approval_pending and self.sent is not None else None

    @property
    def unavailable(self) -> bool:
        """Whether its VMs count as unavailable: it started, or an approval was applied, or
        one is out that no agent refused (of any version: a report of a new version does not
        make the approval its VM holds void until that VM's agent says so), and it is not over."""
        return not self.phase.is_over and (
            self.started or self.approved or self.sent is not None or bool(self.superseded)
        )

    def send(self, sent: SentApproval) -> None:
        """The approver signed ``sent``: the approval before it, unless settled, stays out."""
        if self.sent is not None:
            self.superseded[self.sent.approval_id] = self.sent.target
        self.sent = sent

    def settle(self, approval_id: str, vm: str) -> bool:
        """VM ``vm`` refused (or could not be sent) approval ``approval_id``: it is void.
        Whether it was one still out to that VM."""
        sent = self.sent
        if sent is not None and sent.approval_id == approval_id:
            if sent.target.casefold() != vm.casefold():
                return False
            self.sent = None
            return True
        target = self.superseded.get(approval_id)
        if target is None or target.casefold() != vm.casefold():
            return False
        del self.superseded[approval_id]
        return True

    def set_event(self, event: ScheduledEvent, version: str | None = None) -> None:
        """Take ``event``'s content, with its ``version`` when it was computed before (the
        view's :meth:`FleetView.apply` does, before it changes anything)."""
        # The version first: should it fail, the state keeps the content it was computed for
        # (content judged under another content's version is how a lie becomes an approval).
        if version is None:
            version = event_version(event)
        self.event = event
        self.version = version

    def reported(self) -> tuple[str, ...]:
        """The VMs that reported on this event, in Resources order first."""
        seen = {name.casefold(): name for name in self.reports}
        ordered = [seen.pop(r.casefold()) for r in self.resources if r.casefold() in seen]
        return (*ordered, *seen.values())

    def silent(self) -> tuple[str, ...]:
        """The VMs in ``Resources`` that have not reported on this event at all."""
        reported = {name.casefold() for name in self.reports}
        return tuple(r for r in self.resources if r.casefold() not in reported)

    def time_to_not_before(self, now: datetime | None = None) -> timedelta | None:
        """Time left before Azure starts the event anyway (negative once passed); None when
        the event has no NotBefore (started, or a hardware failure)."""
        if self.event.not_before is None or self.phase is not EventPhase.SCHEDULED:
            return None
        return self.event.not_before - (now or datetime.now(UTC))

    def hooks_done(self, vm: str) -> bool:
        """Whether ``vm`` reported every local hook it ran for this event as succeeded."""
        results = self.hooks.get(vm.casefold())
        if not results:
            return False
        return all(r.data.succeeded for r in results.values())

    def hooks_failed(self, vm: str) -> list[HookResultMessage]:
        """The hook runs ``vm`` reported as failed, timed out or interrupted."""
        return [r for r in self.hooks.get(vm.casefold(), {}).values() if not r.data.succeeded]


@dataclass(slots=True)
class AgentState:
    """One VM's agent, from its own messages."""

    identity: VmIdentity
    reply_to: ReplyAddress
    last_seen: datetime
    online: bool = True
    agent_version: str = ""
    last_heartbeat: datetime | None = None
    offline_reason: str | None = None
    #: The heartbeat interval its last message of its own declared (seconds; None: none).
    heartbeat_interval: float | None = None

    @property
    def name(self) -> str:
        return self.identity.name


@dataclass(slots=True)
class Taken:
    """What one message taken with :meth:`FleetView.take` changed, as it was before: what
    :meth:`FleetView.give_back` puts back should the message not be taken after all."""

    #: The message's VM (casefolded), and its agent before the message (a copy; None: the
    #: message made it) and after it (the view's own).
    vm: str
    agent: _AgentBefore | None = None
    agent_after: AgentState | None = None
    #: The event the message is about before it (a copy; None: the message made it) and after
    #: it (the view's own; None: about no event), and whether its end waited (``_ending``).
    event: _EventBefore | None = None
    event_after: EventState | None = None
    ending: bool = False
    #: How many messages the view had taken with this one (see :meth:`FleetView.give_back`).
    serial: int = 0


class _AgentBefore(NamedTuple):
    """An agent as it was before a message (see :class:`Taken`)."""

    identity: VmIdentity
    reply_to: ReplyAddress
    last_seen: datetime
    online: bool
    agent_version: str
    last_heartbeat: datetime | None
    offline_reason: str | None
    heartbeat_interval: float | None


def _copy_agent(agent: AgentState) -> _AgentBefore:
    return _AgentBefore(
        agent.identity,
        agent.reply_to,
        agent.last_seen,
        agent.online,
        agent.agent_version,
        agent.last_heartbeat,
        agent.offline_reason,
        agent.heartbeat_interval,
    )


def _put_agent(agent: AgentState, before: _AgentBefore) -> None:
    (
        agent.identity,
        agent.reply_to,
        agent.last_seen,
        agent.online,
        agent.agent_version,
        agent.last_heartbeat,
        agent.offline_reason,
        agent.heartbeat_interval,
    ) = before


class _EventBefore(NamedTuple):
    """What of an event one message can change, as it was before (see :class:`Taken`): not
    its id, nor ``counted_down``, which says what the index holds (see
    :meth:`FleetView.give_back`). A tuple: one is made per message the approver takes."""

    event: ScheduledEvent
    version: str
    phase: EventPhase
    last_update: datetime
    reports: dict[str, VmReport]
    hooks: dict[str, dict[str, HookResultMessage]]
    outcomes: dict[tuple[str, str], ApprovalOutcomeMessage]
    sent: SentApproval | None
    superseded: dict[str, str]
    listed: set[str]


def _copy_event(state: EventState, vm: str) -> _EventBefore:
    """What of ``state`` a message of VM ``vm`` (casefolded) can change, copied: its containers
    too, but of the hook results only that VM's (a message changes no other VM's)."""
    hooks = dict(state.hooks)
    own = hooks.get(vm)
    if own is not None:
        hooks[vm] = dict(own)
    return _EventBefore(
        state.event,
        state.version,
        state.phase,
        state.last_update,
        dict(state.reports),
        hooks,
        dict(state.outcomes),
        state.sent,
        dict(state.superseded),
        set(state.listed),
    )


def _put_event(state: EventState, before: _EventBefore) -> None:
    (
        state.event,
        state.version,
        state.phase,
        state.last_update,
        state.reports,
        state.hooks,
        state.outcomes,
        state.sent,
        state.superseded,
        state.listed,
    ) = before


@dataclass(slots=True)  # not frozen: one is made per message, and frozen costs a microsecond
class _Reading:
    """What one message does to the view, worked out before the view changes
    (:meth:`FleetView._read`)."""

    #: The state of the event it is about (None: about none the view knows or could make).
    state: EventState | None
    #: ``state`` is new: the view puts it in.
    new: bool = False
    #: A transition's report that replaces the VM's last one.
    report: VmReport | None = None
    #: A transition's content, newer than the view's and other, and its version.
    content: ScheduledEvent | None = None
    version: str | None = None


def _now() -> datetime:
    return datetime.now(UTC)


class FleetView:
    """Merges lifecycle messages into per-event and per-agent state. Not thread-safe; feed it
    from one task (a :class:`~consumers.FleetStream` handler).

    ``liveness_timeout``: an agent is live while it was heard from within this long (an agent
    sends a message at least every 60 s by default, a heartbeat when it has nothing else to
    say, so the default allows one to be lost), or within 2.5 of the heartbeat intervals its
    own messages declare, if that is longer (:meth:`liveness_of`).
    ``retention``: how long a completed or canceled event is kept before :meth:`prune`
    forgets it; ``expiry``: how long an open event nobody reports on is kept; ``clock_skew``:
    how far ahead of ``clock`` a message's time is believed (see :meth:`apply`).
    """

    def __init__(
        self,
        *,
        liveness_timeout: timedelta = timedelta(seconds=150),
        retention: timedelta = timedelta(hours=1),
        expiry: timedelta = timedelta(days=1),
        clock: Callable[[], datetime] = _now,
        clock_skew: timedelta = timedelta(minutes=5),
    ) -> None:
        self.clock_skew = clock_skew
        self.liveness_timeout = liveness_timeout
        self.retention = retention
        self.expiry = expiry
        self.clock = clock
        self._events: dict[str, EventState] = {}
        self._agents: dict[str, AgentState] = {}
        #: VM (casefolded) -> the open events that make it unavailable.
        self._down: dict[str, set[str]] = {}
        #: Group -> its members, and its unavailable members (casefolded names).
        self._members: dict[Group, set[str]] = {}
        self._down_members: dict[Group, set[str]] = {}
        #: Since :meth:`take_changes`: groups that may have room again (a VM there became
        #: available, or left it while down, or joined it available), and VMs whose held events
        #: are to be decided again (they became unavailable, or left a group: casefolded).
        self._freed: set[Group] = set()
        self._downed: set[str] = set()
        #: Events a VM reported over that another VM, live, still reports running.
        self._ending: set[str] = set()
        #: While messages are replayed (:meth:`replaying`), ends wait for the last of them.
        self._replaying = False
        #: Messages taken so far (:meth:`give_back` takes back only the last one).
        self._serial = 0

    # ------------------------------------------------------------------------------ feeding

    def apply(self, message: LifecycleMessage) -> EventState | None:
        """Take one message into account; returns the event it concerns, if any. Applying a
        message twice changes nothing.

        A message's time is its sender's word: one dated ahead of this view's clock by more
        than ``clock_skew`` is taken as sent then (its sender could otherwise stay live, and its
        reports newest, for as long as it pleased).

        A message is taken whole or not at all. What it does is worked out first, changing
        nothing (:meth:`_read`: the event's state, a new one's version, the VM's report, newer
        content and its version); then the view changes, by steps that only put those values
        in place, so what can fail on what a message says fails before the view changes and
        leaves it as it was. Half taken (its agent heard, its report kept, its content not),
        the view was neither before nor after it, and that is what its retry, the next
        message, or nothing at all (it was dead-lettered) was judged against."""
        return self._apply(message, None)

    def take(self, message: LifecycleMessage) -> tuple[EventState | None, Taken]:
        """:meth:`apply`, and what :meth:`give_back` needs to take the message back out: for a
        consumer that may yet not take a message the view took (the approver, whose handling
        of a message can fail after the view took it: a message the stream then dead-letters
        is one it did not take, and its retry is to find the view as before it)."""
        taken = Taken(message.vm.name.casefold())
        return self._apply(message, taken), taken

    def _apply(self, message: LifecycleMessage, taken: Taken | None) -> EventState | None:
        at = min(message.time, self.clock() + self.clock_skew)
        reading = self._read(message, at)
        # From here on the view changes: whatever below could fail on the message belongs in
        # _read.
        self._serial += 1
        if taken is not None:
            self._hold(taken, reading)
        self._seen_agent(message, at)
        state = reading.state
        if taken is not None:
            taken.agent_after = self._agents.get(taken.vm)
            taken.event_after = state
        if state is None:
            return None
        if reading.new:
            self._events[state.event_id] = state
        if isinstance(message, TransitionMessage):
            self._transition(message, state, reading, at)
        elif isinstance(message, HookResultMessage):
            key = f"{message.data.transition}/{message.data.hook}"
            results = state.hooks.setdefault(message.vm.name.casefold(), {})
            results.pop(key, None)  # the newest last
            results[key] = message
            if len(results) > MAX_HOOKS_PER_VM:  # a VM inventing hook after hook
                del results[next(iter(results))]
            state.last_update = max(state.last_update, at)
        elif isinstance(message, ApprovalOutcomeMessage):
            vm = message.vm.name.casefold()
            state.outcomes[(vm, message.id)] = message
            if len(state.outcomes) > MAX_OUTCOMES_PER_VM:
                _bound_outcomes(state, vm)
        self.refresh(state)
        return state

    def _hold(self, taken: Taken, reading: _Reading) -> None:
        """Keep in ``taken`` what the message read as ``reading`` is about to change."""
        agent = self._agents.get(taken.vm)
        taken.agent = None if agent is None else _copy_agent(agent)
        state = reading.state
        if state is not None and not reading.new:
            taken.event = _copy_event(state, taken.vm)
            taken.ending = state.event_id in self._ending
        taken.serial = self._serial

    def give_back(self, taken: Taken) -> None:
        """Take a message :meth:`take` took back out, as if it had never come: its agent and
        its event are as they were before it, and who is unavailable is counted again (what
        that changes, a VM down again or a group with room again, :meth:`take_changes` reports
        like any change). Only before the view takes another message: what that one changed
        would go with it. What happened to the event or the agent since without a message
        stays (the approver's decisions are its own to take back; an event or agent a prune
        forgot stays forgotten)."""
        if taken.serial != self._serial:
            raise RuntimeError("only the last message the view took can be given back")
        self._serial -= 1
        state = taken.event_after
        if state is not None and self._events.get(state.event_id) is not state:
            state = None  # forgotten since (a prune)
        if state is not None:
            self._set_down(state, False)  # counted again below, as it was before
        agent = self._agents.get(taken.vm)
        if agent is not None and agent is taken.agent_after:
            before = taken.agent
            if before is None or before.identity != agent.identity:
                self._move(taken.vm, agent.identity, None if before is None else before.identity)
            if before is None:
                del self._agents[taken.vm]
            else:
                _put_agent(agent, before)
        if state is None:
            return
        if taken.event is None:  # the message made it
            del self._events[state.event_id]
            self._ending.discard(state.event_id)
            return
        _put_event(state, taken.event)
        if taken.ending:
            self._ending.add(state.event_id)
            if not self._replaying:  # as the message before it left it, judged now
                self._end_if_over(state)
        else:
            self._ending.discard(state.event_id)
        self.refresh(state)

    def _read(self, message: LifecycleMessage, at: datetime) -> _Reading:
        """What ``message`` does to the view, worked out without changing it (see
        :meth:`apply`): the state of the event it is about (a new one, not yet in the view,
        for an event the view does not know: its version is computed here), and for a
        transition the VM's report, when it is newer than the VM's last, and the event's
        content and version, when it is newer than the view's and other."""
        event: ScheduledEvent | None
        if isinstance(message, TransitionMessage | HookResultMessage):
            event = message.data.event
        elif isinstance(message, ApprovalOutcomeMessage):
            known = self._events.get(message.data.event_id)
            if known is not None:
                return _Reading(known)
            event = message.data.event
        else:  # an agent's own message: about no event
            return _Reading(None)
        if event is None:
            return _Reading(None)
        state = self._events.get(event.event_id)
        new = state is None
        if state is None:
            phase = EventPhase.STARTED if event.is_started else EventPhase.SCHEDULED
            state = EventState(
                event_id=event.event_id, event=event, phase=phase, first_seen=at, last_update=at
            )
        if not isinstance(message, TransitionMessage):
            return _Reading(state, new)
        vm = message.vm.name
        report: VmReport | None = None
        previous = state.reports.get(vm)
        if previous is None or at >= previous.at:
            report = VmReport(
                vm=vm,
                kind=message.kind,
                status=event.event_status,
                at=at,
                message_id=message.id,
                listed=event.affects(vm),
                resources=frozenset(resource.casefold() for resource in event.resources),
            )
        if at >= state.last_update and state.event != event:  # the newest content wins
            return _Reading(state, new, report, event, event_version(event))
        return _Reading(state, new, report)

    def _seen_agent(self, message: LifecycleMessage, at: datetime) -> None:
        data = message.data
        key = message.vm.name.casefold()
        agent = self._agents.get(key)
        if agent is None:
            agent = self._agents[key] = AgentState(
                identity=data.vm, reply_to=data.reply_to, last_seen=at
            )
            self._move(key, None, data.vm)
        elif at >= agent.last_seen:
            if agent.identity != data.vm:  # a redeploy, a metadata correction
                self._move(key, agent.identity, data.vm)
            agent.identity = data.vm
            agent.reply_to = data.reply_to
            agent.last_seen = at
        else:  # an older message arriving late says nothing about now
            return
        if isinstance(message, AgentMessage):
            agent.agent_version = message.data.agent_version or agent.agent_version
            agent.heartbeat_interval = message.data.heartbeat_interval
            if message.kind is MessageType.AGENT_OFFLINE:
                agent.online = False
                agent.offline_reason = message.data.reason
            else:
                agent.online = True
                agent.offline_reason = None
                if message.kind is MessageType.AGENT_HEARTBEAT:
                    agent.last_heartbeat = message.time
        else:
            agent.online = True

    def _transition(
        self, message: TransitionMessage, state: EventState, reading: _Reading, at: datetime
    ) -> None:
        event = message.data.event
        if reading.report is not None:
            state.reports[message.vm.name] = reading.report
        if at >= state.last_update:  # the newest content wins
            if reading.content is not None:
                state.set_event(reading.content, reading.version)
            state.last_update = at
        listed = _listed(state)
        if listed != state.listed:
            self._set_down(state, False)  # counted again, with these, by refresh()
            state.listed = listed
        phase = _PHASE_OF.get(message.kind)
        if message.kind is MessageType.UPDATED:
            phase = EventPhase.STARTED if event.is_started else EventPhase.SCHEDULED
        if phase is not None and _RANK[phase] > _RANK[state.phase]:
            if phase.is_over:
                self._ending.add(state.event_id)
            else:
                state.phase = phase
        if state.event_id in self._ending and not self._replaying:
            self._end_if_over(state)

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Apply stored messages (a standby rebuilding the view) as they were received: who is
        live is judged once the last of them is applied, as the view that received them live
        judged it then, not at each older message on the way."""
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False
            for event_id in list(self._ending):
                state = self._events.get(event_id)
                if state is not None:
                    self._end_if_over(state)
                    self.refresh(state)

    def _end_if_over(self, state: EventState, now: datetime | None = None) -> None:
        """End the event once no VM it hits still reports it: each VM speaks for itself, so one
        VM's report of the end (its own, or a lie about another's event) ends it only when
        every VM that reported it as one of its Resources reported the end too, or its agent is
        no longer live (it went offline or silent, and cannot report the end)."""
        moment = now or self.clock()
        ends = [r for r in state.reports.values() if r.kind in _ENDS]
        if not ends:
            self._ending.discard(state.event_id)
            return
        if any(
            r.kind not in _ENDS and r.listed and self.is_live(r.vm, moment)
            for r in state.reports.values()
        ):
            return  # a VM it hits still reports it, and its agent is live: that VM decides
        phase = max((_PHASE_OF[r.kind] for r in ends), key=_RANK.__getitem__)
        if _RANK[phase] > _RANK[state.phase]:
            state.phase = phase
        self._ending.discard(state.event_id)

    # ------------------------------------------------------------------- the unavailable index

    def refresh(self, state: EventState) -> set[Group]:
        """Bring the unavailable index up to date with ``state`` (after a message, or after the
        approver sent or voided an approval); returns the groups whose count changed."""
        return self._set_down(state, state.unavailable)

    def _set_down(self, state: EventState, down: bool) -> set[Group]:
        if state.counted_down == down:
            return set()
        state.counted_down = down
        changed: set[Group] = set()
        for vm in state.listed:
            events = self._down.setdefault(vm, set())
            before = bool(events)
            if down:
                events.add(state.event_id)
            else:
                events.discard(state.event_id)
            if bool(events) != before:
                groups = self._mark(vm, bool(events))
                changed |= groups
                if events:
                    self._downed.add(vm)
                else:
                    self._freed |= groups
            if not events:
                del self._down[vm]
        return changed

    def take_changes(self) -> tuple[set[Group], set[str]]:
        """Since the last call: the groups that may have room again, and the VMs whose held
        events are to be decided again. What a guard holds can change only with these: room
        freed in a group (a VM there became available, a VM down left it, or a VM available
        joined it: a cap in percent of its VMs allows more), or a VM of a held event that is
        down now anyway (it costs no more room) or left a group (its events are guarded by its
        new groups, and no longer count it in the old ones)."""
        freed, self._freed = self._freed, set()
        downed, self._downed = self._downed, set()
        return freed, downed

    def _groups_of(self, identity: VmIdentity | None) -> list[Group]:
        if identity is None:
            return []
        return [(key, value) for key in GROUP_KEYS if (value := getattr(identity, key)) is not None]

    def _mark(self, vm: str, down: bool) -> set[Group]:
        agent = self._agents.get(vm)
        groups = self._groups_of(None if agent is None else agent.identity)
        for group in groups:
            members = self._down_members.setdefault(group, set())
            if down:
                members.add(vm)
            else:
                members.discard(vm)
        return set(groups)

    def _move(self, vm: str, before: VmIdentity | None, after: VmIdentity | None) -> None:
        """VM ``vm`` (casefolded) is in ``after``'s groups now, no longer in ``before``'s
        (None: in none; its agent is new, or forgotten), and what that frees is reported
        (:meth:`take_changes`). A group it leaves while down has one VM down fewer: room for
        the events held there, at once, not at the group's next change (a redeploy moved a VM
        in maintenance to another scale set or domain, and its old group's held events waited
        for their NotBefore). A group it joins available may have room under a cap in percent
        of its VMs; one it joins down has one more VM down (it frees nothing there). And the
        VM's own held events are decided again when it leaves a group: what held them may have
        been that group. Costs the groups of one VM."""
        old, new = self._groups_of(before), self._groups_of(after)
        down = vm in self._down
        left = False
        for group in old:
            if group in new:
                continue
            left = True
            _discard(self._members, group, vm)
            _discard(self._down_members, group, vm)
            if down:
                self._freed.add(group)
        for group in new:
            if group in old:
                continue
            self._members.setdefault(group, set()).add(vm)
            if down:
                self._down_members.setdefault(group, set()).add(vm)
            else:
                self._freed.add(group)
        if left:
            self._downed.add(vm)

    def members(self, group_by: str, value: object) -> set[str]:
        """The VMs (casefolded names) known to be in a group."""
        return self._members.get((group_by, value), set())

    def down_in(self, group_by: str, value: object) -> set[str]:
        """The VMs of a group that are unavailable now (casefolded names)."""
        return self._down_members.get((group_by, value), set())

    def is_down(self, vm: str) -> bool:
        return vm.casefold() in self._down

    def groups(self, vm: str) -> list[Group]:
        agent = self._agents.get(vm.casefold())
        return self._groups_of(None if agent is None else agent.identity)

    # ------------------------------------------------------------------------------ reading

    def event(self, event_id: str) -> EventState | None:
        return self._events.get(event_id)

    def events(self, *, open_only: bool = False) -> Iterator[EventState]:
        for state in list(self._events.values()):
            if not (open_only and state.phase.is_over):
                yield state

    def agent(self, vm: str) -> AgentState | None:
        return self._agents.get(vm.casefold())

    def agents(self) -> Iterator[AgentState]:
        yield from list(self._agents.values())

    def is_live(self, vm: str, now: datetime | None = None) -> bool:
        """Heard from within its liveness (:meth:`liveness_of`) and not announced offline."""
        agent = self._agents.get(vm.casefold())
        if agent is None or not agent.online:
            return False
        return (now or self.clock()) - agent.last_seen <= self.liveness_of(agent)

    def liveness_of(self, agent: AgentState) -> timedelta:
        """How long ``agent`` counts as live after it was last heard from: ``liveness_timeout``,
        or :data:`~schemas.LIVENESS_PER_HEARTBEAT` of the heartbeat interval it declared if
        that is longer (the contract bounds what it may declare to an hour)."""
        interval = agent.heartbeat_interval
        if interval is None:
            return self.liveness_timeout
        return max(self.liveness_timeout, timedelta(seconds=LIVENESS_PER_HEARTBEAT * interval))

    def live_vms(self, event_id: str, now: datetime | None = None) -> tuple[str, ...]:
        """The VMs of the event's ``Resources`` whose agents are live, in Resources order."""
        state = self._events.get(event_id)
        if state is None:
            return ()
        return tuple(vm for vm in state.resources if self.is_live(vm, now))

    def reply_address(self, vm: str) -> ReplyAddress | None:
        agent = self._agents.get(vm.casefold())
        return None if agent is None else agent.reply_to

    def identity(self, vm: str) -> VmIdentity | None:
        agent = self._agents.get(vm.casefold())
        return None if agent is None else agent.identity

    # ------------------------------------------------------------------------------ pruning

    def expired(self, state: EventState, now: datetime) -> bool:
        """Over for longer than ``retention``, or open with no report for ``expiry`` and a
        NotBefore (if any) that far in the past."""
        if state.phase.is_over:
            return state.last_update < now - self.retention
        if state.last_update >= now - self.expiry:
            return False
        not_before = state.event.not_before
        return not_before is None or not_before < now - self.expiry

    def prune(self, now: datetime | None = None) -> list[str]:
        """Forget the events :meth:`expired` says are done with (and agents silent for
        ``expiry`` with no open event); returns the ids of the events forgotten."""
        moment = now or self.clock()
        for event_id in list(self._ending):  # the agents they waited for may be silent now
            waiting = self._events.get(event_id)
            if waiting is None:
                self._ending.discard(event_id)
                continue
            self._end_if_over(waiting, moment)
            self.refresh(waiting)
        gone = [event_id for event_id, state in self._events.items() if self.expired(state, moment)]
        for event_id in gone:
            self.forget(event_id)
        horizon = moment - self.expiry
        for key, agent in list(self._agents.items()):
            if agent.last_seen < horizon and key not in self._down:
                self._move(key, agent.identity, None)
                del self._agents[key]
        return gone

    def forget(self, event_id: str) -> None:
        self._ending.discard(event_id)
        state = self._events.pop(event_id, None)
        if state is not None:
            self._set_down(state, False)


def _discard(index: dict[Group, set[str]], group: Group, vm: str) -> None:
    """Take ``vm`` out of ``group`` in ``index``, and the group out once it has no VM left (a
    VM sending a new group in every heartbeat must not grow the index)."""
    members = index.get(group)
    if members is not None:
        members.discard(vm)
        if not members:
            del index[group]


def affected_groups(view: FleetView, vms: Iterable[str]) -> set[Group]:
    """Every group any of ``vms`` belongs to."""
    return {group for vm in vms for group in view.groups(vm)}
