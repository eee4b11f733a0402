"""The state machine: VMs, their events, and every transition, with exact incarnations.

An event is listed for its *audience*: every VM of the availability sets and scale-set placement
groups of the VMs in its ``Resources`` (a VM in no set: itself only), as Azure delivers it. Any
VM of the audience may approve it, and one approval starts it for all (unless it waits for every
listed VM, ``RequireAllApprovals``). Events of one operation (a scale-set delete: one Terminate
per VM) wait for each other: an approved one stays Scheduled while another of the operation is
Scheduled and unapproved, until that one is approved, canceled or reaches its NotBefore.

Each VM keeps the ids of the events listed for it (creation order) and its DocumentIncarnation,
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
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from ._clock import Clock
from ._documents import ShownSnapshot
from ._errors import EventStateError, InvalidEventError, UnknownEventError
from ._events import (
    Approval,
    EventInfo,
    EventSource,
    EventSpec,
    EventState,
    EventStatus,
    EventType,
    EventUpdate,
    rfc1123,
)
from ._fleet import Fleet

__all__ = ["Ledger", "LiveEvent"]

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class LiveEvent:
    """An event as the ledger holds it (mutable; callers get :class:`EventInfo` snapshots)."""

    event_id: str
    event_type: EventType
    event_source: EventSource
    resources: tuple[str, ...]
    resource_set: frozenset[str]
    audience: tuple[str, ...]
    audience_set: frozenset[str]
    operation_id: str | None
    sequence: int
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
    _frozen: tuple[tuple[object, ...], ShownSnapshot] | None = None

    def frozen(self) -> ShownSnapshot:
        """What documents show of it now, immutable; one object while that stays the same."""
        shown = self.shown()
        if self._frozen is None or self._frozen[0] != shown:
            snapshot = ShownSnapshot(
                self.event_id,
                self.event_type,
                self.event_source,
                self.state,
                self.resources,
                self.not_before,
                self.description,
                self.duration_in_seconds,
            )
            self._frozen = (shown, snapshot)
        return self._frozen[1]

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
            seen_by=self.audience,
            operation_id=self.operation_id,
        )

    def shown(self) -> tuple[object, ...]:
        """What a document shows of it (any api-version): a change here is a new incarnation."""
        return (
            self.event_type,
            self.state,
            self.resources,
            self.not_before,
            self.description,
            self.event_source,
            self.duration_in_seconds,
        )


class Ledger:
    """VMs and events, advanced lazily against ``clock``; ``speed`` divides simulated times."""

    def __init__(
        self,
        *,
        fleet: Fleet,
        clock: Clock,
        speed: float,
        seed: int | None,
        finished_kept: int,
    ) -> None:
        self._fleet = fleet
        self._clock = clock
        self._speed = speed
        self._rng = random.Random(seed)
        self._finished_kept = finished_kept
        self._operations: dict[str, list[str]] = {}  # operation id -> its event ids
        self._events: dict[str, LiveEvent] = {}
        self._finished: deque[str] = deque()
        # (deadline on the monotonic clock, tie-breaker, event id, generation it was set for)
        self._deadlines: list[tuple[float, int, str, int]] = []
        self._sequence = 0

    # -- what VMs see ------------------------------------------------------------------------

    def incarnation(self, name: str) -> int:
        self.advance()
        return self._fleet.get(name).incarnation

    def live_events_of(self, name: str) -> Iterator[LiveEvent]:
        """The events listed for ``name`` now, oldest first (call :meth:`advance` first)."""
        events = self._events
        return (events[event_id] for event_id in self._fleet.get(name).events)

    # -- events ------------------------------------------------------------------------------

    def add_event(self, spec: EventSpec) -> LiveEvent:
        self.advance()
        fleet = self._fleet
        resources = spec.resources if spec.resources is not None else tuple(fleet.names())
        if not resources:
            raise InvalidEventError("Resources: there is no VM to list")
        unknown = [name for name in resources if name not in fleet]
        if unknown:
            raise InvalidEventError(f"Resources: unknown VM(s) {', '.join(map(repr, unknown))}")
        event_id = (spec.event_id or self._new_id()).upper()
        if event_id in self._events:
            raise InvalidEventError(f"EventId: {event_id} is taken")
        now_mono, now_wall = self._clock.monotonic(), self._clock.time()
        born_started = spec.event_status is EventStatus.STARTED
        notice_real = 0.0 if born_started else spec.notice_seconds() / self._speed
        audience = fleet.audience(resources)
        self._sequence += 1
        event = LiveEvent(
            event_id=event_id,
            event_type=spec.event_type,
            event_source=spec.event_source,
            resources=tuple(resources),
            resource_set=frozenset(resources),
            audience=audience,
            audience_set=frozenset(audience),
            operation_id=spec.operation_id,
            sequence=self._sequence,
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
        if spec.operation_id is not None:
            self._operations.setdefault(spec.operation_id, []).append(event_id)
        for name in audience:
            vm = fleet.get(name)
            vm.events[event_id] = None
            vm.incarnation += 1
        if born_started:
            self._schedule(event, now_mono + event.run_real)
        else:
            self._schedule(event, now_mono + notice_real)
        log.info(
            "event %s %s %s for %d VM(s), seen by %d",
            event_id,
            event.event_type.value,
            event.state.value,
            len(resources),
            len(audience),
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
        """``vm`` sends StartRequests for ``event_ids``: all seen by it, or nothing happens."""
        self.advance()
        self._fleet.get(vm)
        chosen: list[LiveEvent] = []
        for raw in event_ids:
            event = self._events.get(raw.upper())
            if event is None or vm not in event.audience_set:
                raise UnknownEventError(raw, vm)
            chosen.append(event)
        now_mono, now_wall = self._clock.monotonic(), self._clock.time()
        for event in chosen:
            if event.state is not EventState.SCHEDULED:
                continue
            event.approvals.setdefault(vm, now_wall)
            if not self._approved(event):
                log.info(
                    "event %s approved by %s: %d of %d approvals",
                    event.event_id,
                    vm,
                    len(event.resource_set & event.approvals.keys()),
                    len(event.resource_set),
                )
            elif event.operation_id is None:
                log.info("event %s approved by %s: starting", event.event_id, vm)
                self._start(event, now_mono, now_wall)
            elif not self._release(event.operation_id, now_mono, now_wall):
                log.info(
                    "event %s approved by %s: waits for the rest of operation %s",
                    event.event_id,
                    vm,
                    event.operation_id,
                )

    @staticmethod
    def _approved(event: LiveEvent) -> bool:
        if event.require_all_approvals:
            return event.resource_set <= event.approvals.keys()
        return bool(event.approvals)

    def _release(self, operation_id: str, mono: float, wall: float) -> bool:
        """Start the operation's approved Scheduled events if none of it is left unapproved;
        whether they started."""
        events = self._events
        waiting = [
            event
            for event_id in self._operations.get(operation_id, ())
            if (event := events.get(event_id)) is not None and event.state is EventState.SCHEDULED
        ]
        if any(not self._approved(event) for event in waiting):
            return False
        for event in waiting:
            log.info("event %s of operation %s: starting", event.event_id, operation_id)
            self._start(event, mono, wall)
        return True

    def start(self, event_id: str) -> LiveEvent:
        event = self.get(event_id)
        if event.state is not EventState.SCHEDULED:
            raise EventStateError(f"event {event.event_id} is {event.state.value}, not Scheduled")
        mono, wall = self._clock.monotonic(), self._clock.time()
        self._start(event, mono, wall)
        if event.operation_id is not None:
            self._release(event.operation_id, mono, wall)
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
        mono, wall = self._clock.monotonic(), self._clock.time()
        self._finish(event, EventState.CANCELED, wall)
        if event.operation_id is not None:
            self._release(event.operation_id, mono, wall)
        return event

    def update(self, event_id: str, update: EventUpdate) -> LiveEvent:
        """Change a Scheduled event in place; every VM that sees it (before or after) gets a new
        incarnation when what it shows changes."""
        event = self.get(event_id)
        if event.state is not EventState.SCHEDULED:
            raise EventStateError(
                f"event {event.event_id} is {event.state.value}: only a Scheduled event can be"
                " updated"
            )
        if update.resources is not None:
            unknown = [name for name in update.resources if name not in self._fleet]
            if unknown:
                raise InvalidEventError(f"Resources: unknown VM(s) {', '.join(map(repr, unknown))}")
        if (
            update.event_type is not None
            and update.event_type is not EventType.TERMINATE
            and event.operation_id is not None
        ):
            raise InvalidEventError(
                f"EventType: event {event.event_id} belongs to operation {event.operation_id}"
                " and stays a Terminate"
            )
        before = event.shown()
        old_audience = event.audience
        if update.event_type is not None:
            event.event_type = update.event_type
        if update.duration_in_seconds is not None:
            event.duration_in_seconds = update.duration_in_seconds
        if update.description is not None:
            event.description = update.description
        if update.resources is not None:
            event.resources = update.resources
            event.resource_set = frozenset(update.resources)
            event.audience = self._fleet.audience(update.resources)
            event.audience_set = frozenset(event.audience)
        if update.not_before_seconds is not None:
            notice_real = update.not_before_seconds / self._speed
            event.not_before = rfc1123(self._clock.time() + notice_real)
            event.generation += 1
            self._schedule(event, self._clock.monotonic() + notice_real)
        if event.shown() == before:
            return event
        self._relist(event, old_audience)
        log.info("event %s updated", event.event_id)
        return event

    def _relist(self, event: LiveEvent, old_audience: tuple[str, ...]) -> None:
        """List ``event`` for its (new) audience, drop it for VMs that left it; bump them all."""
        fleet, event_id = self._fleet, event.event_id
        for name in old_audience:
            if name not in event.audience_set:
                vm = fleet.get(name)
                del vm.events[event_id]
                vm.incarnation += 1
        for name in event.audience:
            vm = fleet.get(name)
            if event_id not in vm.events:
                vm.events[event_id] = None
                # Keep the list oldest first: the newcomer may be older than what it lists.
                order = sorted(vm.events, key=lambda i: self._events[i].sequence)
                vm.events = dict.fromkeys(order)
            vm.incarnation += 1

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
                if event.operation_id is not None:
                    self._release(event.operation_id, due, wall)
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
        fleet = self._fleet
        for name in event.audience:
            vm = fleet.get(name)
            del vm.events[event.event_id]
            vm.incarnation += 1
        self._forget_operation(event)
        self._finished.append(event.event_id)
        while len(self._finished) > self._finished_kept:
            self._events.pop(self._finished.popleft(), None)
        log.info("event %s %s", event.event_id, state.value)

    def _forget_operation(self, event: LiveEvent) -> None:
        operation = event.operation_id
        if operation is None:
            return
        events = self._events
        if all(
            (e := events.get(i)) is None or e.state in (EventState.COMPLETED, EventState.CANCELED)
            for i in self._operations.get(operation, ())
        ):
            self._operations.pop(operation, None)

    def _bump(self, event: LiveEvent) -> None:
        fleet = self._fleet
        for name in event.audience:
            fleet.get(name).incarnation += 1

    def _new_id(self) -> str:
        while True:
            event_id = str(uuid.UUID(int=self._rng.getrandbits(128), version=4)).upper()
            if event_id not in self._events:
                return event_id
