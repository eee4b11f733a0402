"""The fleet view: every VM's reports on each event merged into one picture, and each agent's
liveness from its heartbeats.

One event (one EventId) is seen by every VM in its ``Resources``; each VM's agent reports what
*it* saw. The view answers what an operator asks: who is hit, who reported what and when, who is
silent, how long until NotBefore, and whether the event started, completed or was canceled.

>>> view = FleetView()
>>> view.apply(message)                       # doctest: +SKIP
>>> view.event("EVT-1").silent()              # doctest: +SKIP
('web-9',)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum

from schemas import (
    AgentMessage,
    ApprovalOutcomeMessage,
    HookResultMessage,
    LifecycleMessage,
    MessageType,
    ReplyAddress,
    ScheduledEvent,
    TransitionMessage,
    VmIdentity,
)

__all__ = ["AgentState", "EventPhase", "EventState", "FleetView", "VmReport"]


class EventPhase(StrEnum):
    """Where an event is, merged over its VMs' reports (the furthest any VM saw)."""

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
    #: ``approval.applied`` / ``approval.rejected`` outcomes, in arrival order.
    outcomes: list[ApprovalOutcomeMessage] = field(default_factory=list)
    #: When this process sent an approval for it (set by the approver service).
    approval_sent_at: datetime | None = None

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
        return any(outcome.data.applied for outcome in self.outcomes)

    @property
    def approved_or_sent(self) -> bool:
        return self.approval_sent_at is not None or self.approved

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

    @property
    def name(self) -> str:
        return self.identity.name


def _now() -> datetime:
    return datetime.now(UTC)


class FleetView:
    """Merges lifecycle messages into per-event and per-agent state. Not thread-safe; feed it
    from one task (a :class:`~consumers.FleetStream` handler).

    ``liveness_timeout``: an agent is live while it was heard from within this long (agents
    send a heartbeat every 30 s by default, so the default allows two to be lost).
    ``retention``: how long a completed or canceled event is kept before :meth:`prune`
    forgets it.
    """

    def __init__(
        self,
        *,
        liveness_timeout: timedelta = timedelta(seconds=95),
        retention: timedelta = timedelta(hours=1),
        clock: Callable[[], datetime] = _now,
    ) -> None:
        self.liveness_timeout = liveness_timeout
        self.retention = retention
        self.clock = clock
        self._events: dict[str, EventState] = {}
        self._agents: dict[str, AgentState] = {}

    # ------------------------------------------------------------------------------ feeding

    def apply(self, message: LifecycleMessage) -> EventState | None:
        """Take one message into account; returns the event it concerns, if any."""
        self._seen_agent(message)
        if isinstance(message, TransitionMessage):
            return self._transition(message)
        if isinstance(message, HookResultMessage):
            state = self._state_for(message.data.event, message.time)
            key = f"{message.data.transition}/{message.data.hook}"
            state.hooks.setdefault(message.vm.name.casefold(), {})[key] = message
            state.last_update = max(state.last_update, message.time)
            return state
        if isinstance(message, ApprovalOutcomeMessage):
            event = message.data.event
            known = self._events.get(message.data.event_id)
            if known is None and event is not None:
                known = self._state_for(event, message.time)
            if known is not None:
                known.outcomes.append(message)
            return known
        return None

    def _seen_agent(self, message: LifecycleMessage) -> None:
        data = message.data
        key = message.vm.name.casefold()
        agent = self._agents.get(key)
        if agent is None:
            agent = self._agents[key] = AgentState(
                identity=data.vm, reply_to=data.reply_to, last_seen=message.time
            )
        elif message.time >= agent.last_seen:
            agent.identity = data.vm
            agent.reply_to = data.reply_to
            agent.last_seen = message.time
        else:  # an older message arriving late says nothing about now
            return
        if isinstance(message, AgentMessage):
            agent.agent_version = message.data.agent_version or agent.agent_version
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

    def _state_for(self, event: ScheduledEvent, at: datetime) -> EventState:
        state = self._events.get(event.event_id)
        if state is None:
            phase = EventPhase.STARTED if event.is_started else EventPhase.SCHEDULED
            state = self._events[event.event_id] = EventState(
                event_id=event.event_id, event=event, phase=phase, first_seen=at, last_update=at
            )
        return state

    def _transition(self, message: TransitionMessage) -> EventState:
        event = message.data.event
        state = self._state_for(event, message.time)
        vm = message.vm.name
        previous = state.reports.get(vm)
        if previous is None or message.time >= previous.at:
            state.reports[vm] = VmReport(
                vm=vm,
                kind=message.kind,
                status=event.event_status,
                at=message.time,
                message_id=message.id,
            )
        if message.time >= state.last_update:  # the newest content wins
            state.event = event
            state.last_update = message.time
        phase = _PHASE_OF.get(message.kind)
        if message.kind is MessageType.UPDATED:
            phase = EventPhase.STARTED if event.is_started else EventPhase.SCHEDULED
        if phase is not None and _RANK[phase] > _RANK[state.phase]:
            state.phase = phase
        return state

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
        """Heard from within ``liveness_timeout`` and not announced offline."""
        agent = self._agents.get(vm.casefold())
        if agent is None or not agent.online:
            return False
        return (now or self.clock()) - agent.last_seen <= self.liveness_timeout

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

    def prune(self, now: datetime | None = None) -> int:
        """Forget events over for longer than ``retention``; returns how many went."""
        horizon = (now or self.clock()) - self.retention
        gone = [
            event_id
            for event_id, state in self._events.items()
            if state.phase.is_over and state.last_update < horizon
        ]
        for event_id in gone:
            del self._events[event_id]
        return len(gone)
