"""The in-process simulator: the fleet, its events, faults, throttling and the request log.

Everything the HTTP app does goes through this object, and in-process callers (tests, demo,
scenarios) use the same methods, so nothing needs HTTP to drive the simulation::

    sim = Simulator(SimulatorConfig(speed=60), vms=["WestNO_0", "WestNO_1"])
    freeze = sim.add_event(EventSpec(event_type=EventType.FREEZE, duration_in_seconds=5))
    sim.scheduled_events_document("WestNO_0")["Events"][0]["EventStatus"]   # "Scheduled"
    sim.approve("WestNO_1", [freeze.event_id])                               # Started for both

It is not thread-safe: use it from the event loop that serves it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from ._clock import Clock, SystemClock
from ._config import SimulatorConfig
from ._events import EventInfo, EventSpec, EventState, EventType
from ._faults import Endpoint, FaultBook, FaultInfo, FaultSpec
from ._identity import VmIdentity
from ._ledger import Ledger
from ._requestlog import RequestLog, RequestRecord
from ._throttle import RateLimiter
from ._versions import LATEST_SCHEDULED_EVENTS_VERSION, event_fields

__all__ = ["Simulator"]

log = logging.getLogger(__name__)


class Simulator:
    """A fleet of simulated VMs behind one IMDS.

    ``vms`` adds VMs at once (more with :meth:`add_vm`); the first VM added is also the one served
    without a ``/vm/{name}`` prefix.
    """

    def __init__(
        self,
        config: SimulatorConfig | None = None,
        *,
        clock: Clock | None = None,
        vms: Iterable[str] = (),
    ) -> None:
        self._config = config if config is not None else SimulatorConfig()
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._ledger = Ledger(
            clock=self._clock,
            speed=self._config.speed,
            placement=self._config.placement,
            seed=self._config.seed,
            finished_kept=self._config.finished_events_kept,
        )
        self._faults = FaultBook()
        self._limiter = RateLimiter(self._config.rate_limit, self._clock)
        self._requests = RequestLog(self._config.request_log_size)
        self._first_call_waiting: set[str] = set()
        self.add_vms(vms)

    @property
    def config(self) -> SimulatorConfig:
        return self._config

    @property
    def clock(self) -> Clock:
        return self._clock

    def to_real(self, simulated_seconds: float) -> float:
        """Real seconds for a simulated duration (divided by ``speed``)."""
        return simulated_seconds / self._config.speed

    # -- VMs ---------------------------------------------------------------------------------

    def add_vm(self, name: str) -> VmIdentity:
        """Add a VM; raises DuplicateVmError or InvalidVmNameError."""
        self.add_vms([name])
        return self._ledger.identity(name)

    def add_vms(self, names: Iterable[str]) -> None:
        """Add VMs in order (their identities are computed on first use: fleets start fast)."""
        for name in names:
            self._ledger.add_vm(name)
            if self._config.first_call_delay > 0:
                self._first_call_waiting.add(name)

    def has_vm(self, name: str) -> bool:
        return self._ledger.has_vm(name)

    def vm_names(self) -> list[str]:
        """Every VM, in the order added."""
        return self._ledger.vm_names()

    @property
    def vm_count(self) -> int:
        return self._ledger.vm_count()

    @property
    def default_vm(self) -> str | None:
        """The first VM added: IMDS serves it at ``/metadata/...`` without a prefix."""
        return self._ledger.first_vm()

    def identity(self, name: str) -> VmIdentity:
        return self._ledger.identity(name)

    def incarnation(self, name: str) -> int:
        """The VM's current DocumentIncarnation."""
        return self._ledger.incarnation(name)

    # -- events ------------------------------------------------------------------------------

    def add_event(self, spec: EventSpec) -> EventInfo:
        """Create an event; raises InvalidEventError (unknown VMs, EventId taken)."""
        return self._ledger.add_event(spec).snapshot()

    def get_event(self, event_id: str) -> EventInfo:
        """Any event still remembered (Completed/Canceled ones too); raises UnknownEventError."""
        return self._ledger.get(event_id).snapshot()

    def events(self, state: EventState | None = None) -> list[EventInfo]:
        """Every remembered event, oldest first, optionally only those in ``state``."""
        return [
            e.snapshot() for e in self._ledger.all_events() if state is None or e.state is state
        ]

    def approve(self, vm: str, event_ids: Iterable[str]) -> None:
        """What ``POST {"StartRequests": [...]}`` from ``vm`` does; UnknownEventError if any id
        is unknown to that VM (then nothing is approved)."""
        self._ledger.approve(vm, list(event_ids))

    def start_event(self, event_id: str) -> EventInfo:
        """Force a Scheduled event to Started now; EventStateError otherwise."""
        return self._ledger.start(event_id).snapshot()

    def complete_event(self, event_id: str) -> EventInfo:
        """Force a Started event to end now; EventStateError otherwise."""
        return self._ledger.complete(event_id).snapshot()

    def cancel_event(self, event_id: str) -> EventInfo:
        """Cancel a Scheduled event (it disappears, no impact); EventStateError otherwise."""
        return self._ledger.cancel(event_id).snapshot()

    def advance(self) -> None:
        """Apply every transition that is due. Every read does this already."""
        self._ledger.advance()

    async def wait_for_state(
        self, event_id: str, state: EventState, *, within: float, poll: float = 0.01
    ) -> EventInfo:
        """Wait until the event reaches ``state``; TimeoutError after ``within`` seconds."""
        async with asyncio.timeout(within):
            while True:
                info = self.get_event(event_id)
                if info.state is state:
                    return info
                await asyncio.sleep(poll)

    # -- documents ---------------------------------------------------------------------------

    def scheduled_events_document(
        self, vm: str, api_version: str = LATEST_SCHEDULED_EVENTS_VERSION
    ) -> dict[str, Any]:
        """The body IMDS returns to ``vm`` for ``GET /metadata/scheduledevents``.

        Raises ValueError for an unknown api-version, UnknownVmError for an unknown VM.
        """
        fields = event_fields(api_version)
        self._ledger.advance()
        documents: list[dict[str, Any]] = []
        for event in self._ledger.live_events_of(vm):
            if event.event_type is EventType.PREEMPT and not fields.preempt:
                continue
            if event.event_type is EventType.TERMINATE and not fields.terminate:
                continue
            started = event.state is EventState.STARTED
            resources = (
                ["_" + r for r in event.resources]
                if fields.underscore_names
                else list(event.resources)
            )
            item: dict[str, Any] = {
                "EventId": event.event_id,
                "EventStatus": "Started" if started else "Scheduled",
                "EventType": event.event_type.value,
                "ResourceType": "VirtualMachine",
                "Resources": resources,
                "NotBefore": "" if started else event.not_before,
            }
            if fields.description:
                item["Description"] = event.description
            if fields.event_source:
                item["EventSource"] = event.event_source.value
            if fields.duration:
                item["DurationInSeconds"] = event.duration_in_seconds
            documents.append(item)
        return {"DocumentIncarnation": self._ledger.incarnation(vm), "Events": documents}

    def instance_document(self, vm: str) -> dict[str, Any]:
        """The body of ``GET /metadata/instance`` for ``vm``."""
        identity = self._ledger.identity(vm)
        return {"compute": identity.compute(), "network": identity.network()}

    # -- faults, throttling, first call, request log ----------------------------------------

    def add_fault(self, spec: FaultSpec) -> FaultInfo:
        """Inject a fault into the IMDS endpoints (never the admin API)."""
        log.info("fault added: %s", spec.model_dump(exclude_none=True))
        return self._faults.add(spec)

    def faults(self) -> list[FaultInfo]:
        return self._faults.list()

    def clear_faults(self) -> int:
        return self._faults.clear()

    def take_fault(self, vm: str, endpoint: Endpoint) -> FaultSpec | None:
        """The fault (if any) for this request, counted down."""
        return self._faults.take(vm, endpoint)

    def admit(self, vm: str) -> bool:
        """Count a request against ``vm``'s rate limit; False means answer 429."""
        return self._limiter.admit(vm)

    def take_first_call_delay(self, vm: str) -> float:
        """Real seconds this VM's first Scheduled Events call must wait; 0 after the first."""
        if vm in self._first_call_waiting:
            self._first_call_waiting.discard(vm)
            return self.to_real(self._config.first_call_delay)
        return 0.0

    def record_request(self, vm: str | None, method: str, path: str, status: int) -> None:
        self._requests.add(RequestRecord(vm, method, path, status, self._clock.time()))

    def requests(self, *, vm: str | None = None, limit: int | None = None) -> list[RequestRecord]:
        """The recent IMDS requests, oldest first."""
        return self._requests.recent(vm=vm, limit=limit)
