"""The state machine: VMs, their events, and every transition, with exact incarnations.

Each VM keeps the ids of the events that list it (creation order) and its DocumentIncarnation,
which grows by one whenever that list or one of its events' visible state changes, and only
then. Deadlines (NotBefore, end of run) sit in one heap, so catching up with the clock costs
O(log n) per due transition and nothing when none is due; a document costs O(events of that VM).
Transitions are stamped with their *logical* time (the deadline), not the time someone looked,
so the life of an event does not depend on who polls when.
"""

from __future__ import annotations

import heapq
import logging
import random
import re
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from ._clock import Clock
from ._errors import (
    DuplicateVmError,
    EventStateError,
    InvalidEventError,
    InvalidVmNameError,
    UnknownEventError,
    UnknownVmError,
)
from ._events import (
    Approval,
    EventInfo,
    EventSource,
    EventSpec,
    EventState,
    EventStatus,
    EventType,
    rfc1123,
)
from ._identity import Placement, VmIdentity, identity_for

__all__ = ["VM_NAME_PATTERN", "Ledger", "LiveEvent"]

log = logging.getLogger(__name__)

VM_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")


@dataclass(slots=True)
class _Vm:
    name: str
    index: int
    identity: VmIdentity | None = None
    incarnation: int = 1
    events: dict[str, None] = field(default_factory=dict)  # an ordered set of live event ids


@dataclass(slots=True, eq=False)
class LiveEvent:
    """An event as the ledger holds it (mutable; callers get :class:`EventInfo` snapshots)."""

    event_id: str
    event_type: EventType
    event_source: EventSource
    resources: tuple[str, ...]
    resource_set: frozenset[str]
    description: str
    duration_in_seconds: int
    run_seconds: float
    run_real: float
    require_all_approvals: bool
    state: EventState
    not_before: str
    created_at: float
    started_at: float | None = None
    ended_at: float | None = None
    approvals: dict[str, float] = field(default_factory=dict)
    generation: int = 0

    def snapshot(self) -> EventInfo:
        return EventInfo(
            event_id=self.event_id,
            event_type=self.event_type,
            event_source=self.event_source,
            resources=self.resources,
            description=self.description,
            duration_in_seconds=self.duration_in_seconds,
            run_seconds=self.run_seconds,
            require_all_approvals=self.require_all_approvals,
            state=self.state,
            not_before=self.not_before,
            created_at=self.created_at,
            started_at=self.started_at,
            ended_at=self.ended_at,
            approvals=tuple(Approval(vm, t) for vm, t in self.approvals.items()),
        )


class Ledger:
    """VMs and events, advanced lazily against ``clock``; ``speed`` divides simulated times."""

    def __init__(
        self,
        *,
        clock: Clock,
        speed: float,
        placement: Placement,
        seed: int | None,
        finished_kept: int,
    ) -> None:
        self._clock = clock
        self._speed = speed
        self._placement = placement
        self._rng = random.Random(seed)
        self._finished_kept = finished_kept
        self._vms: dict[str, _Vm] = {}
        self._events: dict[str, LiveEvent] = {}
        self._finished: deque[str] = deque()
        # (deadline on the monotonic clock, tie-breaker, event id, generation it was set for)
        self._deadlines: list[tuple[float, int, str, int]] = []
        self._sequence = 0

    # -- VMs ---------------------------------------------------------------------------------

    def add_vm(self, name: str) -> None:
        if not VM_NAME_PATTERN.match(name):
            raise InvalidVmNameError(
                f"bad VM name {name!r}: use letters, digits, '.', '_' or '-' (at most 80)"
            )
        if name in self._vms:
            raise DuplicateVmError(f"VM {name!r} exists already")
        self._vms[name] = _Vm(name, len(self._vms))

    def has_vm(self, name: str) -> bool:
        return name in self._vms

    def vm_names(self) -> list[str]:
        return list(self._vms)

    def vm_count(self) -> int:
        return len(self._vms)

    def first_vm(self) -> str | None:
        return next(iter(self._vms), None)

    def identity(self, name: str) -> VmIdentity:
        vm = self._vm(name)
        if vm.identity is None:  # computed on first use: 10,000 VMs start instantly
            vm.identity = identity_for(vm.name, vm.index, self._placement)
        return vm.identity

    def incarnation(self, name: str) -> int:
        self.advance()
        return self._vm(name).incarnation

    def live_events_of(self, name: str) -> Iterator[LiveEvent]:
        """The events listed for ``name`` now, oldest first (call :meth:`advance` first)."""
        events = self._events
        return (events[event_id] for event_id in self._vm(name).events)

    def _vm(self, name: str) -> _Vm:
        try:
            return self._vms[name]
        except KeyError:
            raise UnknownVmError(name) from None

    # -- events ------------------------------------------------------------------------------

    def add_event(self, spec: EventSpec) -> LiveEvent:
        self.advance()
        resources = spec.resources if spec.resources is not None else tuple(self._vms)
        if not resources:
            raise InvalidEventError("Resources: there is no VM to list")
        unknown = [name for name in resources if name not in self._vms]
        if unknown:
            raise InvalidEventError(f"Resources: unknown VM(s) {', '.join(map(repr, unknown))}")
        event_id = (spec.event_id or self._new_id()).upper()
        if event_id in self._events:
            raise InvalidEventError(f"EventId: {event_id} is taken")
        now_mono, now_wall = self._clock.monotonic(), self._clock.time()
        born_started = spec.event_status is EventStatus.STARTED
        notice_real = 0.0 if born_started else spec.notice_seconds() / self._speed
        event = LiveEvent(
            event_id=event_id,
            event_type=spec.event_type,
            event_source=spec.event_source,
            resources=tuple(resources),
            resource_set=frozenset(resources),
            description=spec.describe(),
            duration_in_seconds=spec.duration(),
            run_seconds=spec.run(),
            run_real=spec.run() / self._speed,
            require_all_approvals=spec.require_all_approvals,
            state=EventState.STARTED if born_started else EventState.SCHEDULED,
            not_before="" if born_started else rfc1123(now_wall + notice_real),
            created_at=now_wall,
            started_at=now_wall if born_started else None,
        )
        self._events[event_id] = event
        for name in resources:
            vm = self._vms[name]
            vm.events[event_id] = None
            vm.incarnation += 1
        if born_started:
            self._schedule(event, now_mono + event.run_real)
        else:
            self._schedule(event, now_mono + notice_real)
        log.info(
            "event %s %s %s for %d VM(s)",
            event_id,
            event.event_type.value,
            event.state.value,
            len(resources),
        )
        return event

    def get(self, event_id: str) -> LiveEvent:
        self.advance()
        try:
            return self._events[event_id.upper()]
        except KeyError:
            raise UnknownEventError(event_id) from None

    def all_events(self) -> list[LiveEvent]:
        self.advance()
        return list(self._events.values())

    def approve(self, vm: str, event_ids: Iterable[str]) -> None:
        """``vm`` sends StartRequests for ``event_ids``: all known to it, or nothing happens."""
        self.advance()
        self._vm(vm)
        chosen: list[LiveEvent] = []
        for raw in event_ids:
            event = self._events.get(raw.upper())
            if event is None or vm not in event.resource_set:
                raise UnknownEventError(raw, vm)
            chosen.append(event)
        now_mono, now_wall = self._clock.monotonic(), self._clock.time()
        for event in chosen:
            if event.state is not EventState.SCHEDULED:
                continue
            event.approvals.setdefault(vm, now_wall)
            if not event.require_all_approvals or event.resource_set <= event.approvals.keys():
                log.info("event %s approved by %s: starting", event.event_id, vm)
                self._start(event, now_mono, now_wall)
            else:
                log.info(
                    "event %s approved by %s: %d of %d approvals",
                    event.event_id,
                    vm,
                    len(event.approvals),
                    len(event.resource_set),
                )

    def start(self, event_id: str) -> LiveEvent:
        event = self.get(event_id)
        if event.state is not EventState.SCHEDULED:
            raise EventStateError(f"event {event.event_id} is {event.state.value}, not Scheduled")
        self._start(event, self._clock.monotonic(), self._clock.time())
        return event

    def complete(self, event_id: str) -> LiveEvent:
        event = self.get(event_id)
        if event.state is not EventState.STARTED:
            raise EventStateError(f"event {event.event_id} is {event.state.value}, not Started")
        self._finish(event, EventState.COMPLETED, self._clock.time())
        return event

    def cancel(self, event_id: str) -> LiveEvent:
        event = self.get(event_id)
        if event.state is not EventState.SCHEDULED:
            raise EventStateError(
                f"event {event.event_id} is {event.state.value}: only a Scheduled event can be"
                " canceled"
            )
        self._finish(event, EventState.CANCELED, self._clock.time())
        return event

    # -- time --------------------------------------------------------------------------------

    def advance(self) -> None:
        """Apply every transition whose deadline has passed, in deadline order."""
        deadlines = self._deadlines
        if not deadlines:
            return
        now = self._clock.monotonic()
        while deadlines and deadlines[0][0] <= now:
            due, _, event_id, generation = heapq.heappop(deadlines)
            event = self._events.get(event_id)
            if event is None or event.generation != generation:
                continue  # superseded: approved, canceled or forced since
            # Stamp with the logical time the deadline fell on, not the time we noticed.
            wall = self._clock.time() - (now - due)
            if event.state is EventState.SCHEDULED:
                self._start(event, due, wall)
            elif event.state is EventState.STARTED:
                self._finish(event, EventState.COMPLETED, wall)

    def _schedule(self, event: LiveEvent, deadline: float) -> None:
        self._sequence += 1
        heapq.heappush(
            self._deadlines, (deadline, self._sequence, event.event_id, event.generation)
        )

    def _start(self, event: LiveEvent, mono: float, wall: float) -> None:
        event.state = EventState.STARTED
        event.started_at = wall
        event.generation += 1
        self._bump(event)
        self._schedule(event, mono + event.run_real)
        log.info("event %s Started", event.event_id)

    def _finish(self, event: LiveEvent, state: EventState, wall: float) -> None:
        event.state = state
        event.ended_at = wall
        event.generation += 1
        for name in event.resources:
            vm = self._vms[name]
            del vm.events[event.event_id]
            vm.incarnation += 1
        self._finished.append(event.event_id)
        while len(self._finished) > self._finished_kept:
            self._events.pop(self._finished.popleft(), None)
        log.info("event %s %s", event.event_id, state.value)

    def _bump(self, event: LiveEvent) -> None:
        vms = self._vms
        for name in event.resources:
            vms[name].incarnation += 1

    def _new_id(self) -> str:
        while True:
            event_id = str(uuid.UUID(int=self._rng.getrandbits(128), version=4)).upper()
            if event_id not in self._events:
                return event_id
