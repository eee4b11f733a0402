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
import json
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import ValidationError

from ._accounting import RequestAccounting, RequestStats
from ._attestation import AttestationCa, Attestor, attested_content, valid_nonce
from ._clock import Clock, SystemClock
from ._config import SimulatorConfig
from ._documents import DocumentHistory, render_events
from ._errors import (
    DuplicateVmError,
    InvalidEventError,
    InvalidVmNameError,
    describe_validation_error,
)
from ._events import EventInfo, EventSpec, EventState, EventType, EventUpdate
from ._faults import Endpoint, FaultBook, FaultInfo, FaultSpec
from ._fleet import VM_NAME_PATTERN, Fleet
from ._identity import VmIdentity
from ._ledger import Ledger
from ._requestlog import RequestLog, RequestRecord
from ._throttle import RateLimiter
from ._topology import Membership, Topology, standalone_membership
from ._versions import (
    ATTESTED_VERSIONS,
    LATEST_INSTANCE_VERSION,
    LATEST_SCHEDULED_EVENTS_VERSION,
    event_fields,
)

__all__ = ["Simulator"]

log = logging.getLogger(__name__)


class Simulator:
    """A fleet of simulated VMs behind one IMDS.

    ``vms`` adds VMs by name, then ``topology`` adds scale sets, availability sets and standalone
    VMs (more with :meth:`add_vm` and :meth:`add_topology`); the first VM added is also the one
    served without a ``/vm/{name}`` prefix.
    """

    def __init__(
        self,
        config: SimulatorConfig | None = None,
        *,
        clock: Clock | None = None,
        vms: Iterable[str] = (),
        topology: Topology | None = None,
    ) -> None:
        self._config = config if config is not None else SimulatorConfig()
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._fleet = Fleet(self._config.placement)
        self._ledger = Ledger(
            fleet=self._fleet,
            clock=self._clock,
            speed=self._config.speed,
            seed=self._config.seed,
            finished_kept=self._config.finished_events_kept,
        )
        self._faults = FaultBook()
        self._limiter = RateLimiter(self._config.rate_limit, self._clock)
        self._requests = RequestLog(self._config.request_log_size)
        self._accounting = RequestAccounting(self._clock.time())
        self._first_call_waiting: set[str] = set()
        self._history = DocumentHistory()
        self._attestor: Attestor | None = None
        self._default: str | None = None
        self._bodies: dict[str, tuple[int, str, bytes]] = {}  # vm -> (incarnation, version, body)
        self.add_vms(vms)
        if topology is not None:
            self.add_topology(topology)

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
        return self._fleet.identity(name)

    def add_vms(self, names: Iterable[str]) -> None:
        """Add VMs in order (their identities are computed on first use: fleets start fast).

        A name alone says where the VM sits: ``web_3`` is instance 3 of scale set ``web``, any
        other name a standalone VM (see :class:`Topology` for sets of any shape).
        """
        for name in names:
            self._add(name, None)

    def add_topology(self, topology: Topology) -> list[str]:
        """Add the VMs of ``topology``, in its order; their names. Raises DuplicateVmError (and
        adds nothing) when one of them exists already."""
        members = list(topology.members())
        names = [name for name, _ in members]
        bad = [name for name in names if not VM_NAME_PATTERN.match(name)]
        if bad:
            raise InvalidVmNameError(
                f"bad VM name(s) {', '.join(map(repr, bad[:5]))}: letters, digits, '.', '_' or"
                " '-', at most 80"
            )
        taken = [name for name in names if self.has_vm(name)]
        taken += [name for name, n in Counter(names).items() if n > 1]
        if taken:
            raise DuplicateVmError(f"VM(s) {', '.join(map(repr, taken[:5]))} exist already")
        for name, membership in members:
            if membership is None:
                membership = standalone_membership(len(self._fleet))
            self._add(name, membership)
        return names

    def _add(self, name: str, membership: Membership | None) -> None:
        self._fleet.add(name, membership)
        if self._config.first_call_delay > 0:
            self._first_call_waiting.add(name)
        if self._default is None and self.serves(name):
            self._default = name

    def serves(self, name: str) -> bool:
        """Whether this simulator answers IMDS requests for ``name`` (a VM of its shard)."""
        shard = self._config.shard
        if shard is None:
            return name in self._fleet
        return name in self._fleet and self._fleet.get(name).slot % shard.count == shard.index

    def shard_of(self, name: str) -> int:
        """The shard that serves ``name`` (0 without shards); UnknownVmError for an unknown VM."""
        shard = self._config.shard
        slot = self._fleet.get(name).slot
        return 0 if shard is None else slot % shard.count

    def served_vm_names(self) -> list[str]:
        """The VMs this simulator answers for, in the order added (all of them without shards)."""
        return [name for name in self._fleet.names() if self.serves(name)]

    def has_vm(self, name: str) -> bool:
        return name in self._fleet

    def vm_names(self) -> list[str]:
        """Every VM, in the order added."""
        return self._fleet.names()

    @property
    def vm_count(self) -> int:
        return len(self._fleet)

    @property
    def default_vm(self) -> str | None:
        """The first VM added (of this shard): IMDS serves it at ``/metadata/...`` too."""
        return self._default

    def identity(self, name: str) -> VmIdentity:
        return self._fleet.identity(name)

    def membership(self, name: str) -> Membership:
        """Where the VM sits: scale set, placement group, availability set, zone, domains."""
        return self._fleet.get(name).membership

    def group_of(self, name: str) -> tuple[str, ...]:
        """The VMs that see every event of ``name`` (its availability set or placement group;
        itself alone when it is in no set), ``name`` included."""
        return self._fleet.group_of(name)

    def describe_topology(self) -> dict[str, Any]:
        """The fleet by scale set, placement group and availability set (the body of
        ``GET /admin/topology``)."""
        return self._fleet.describe()

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

    def state_counts(self) -> dict[EventState, int]:
        """How many remembered events are in each state (none copied: cheap to ask often)."""
        return dict(Counter(e.state for e in self._ledger.all_events()))

    def approve(self, vm: str, event_ids: Iterable[str]) -> None:
        """What ``POST {"StartRequests": [...]}`` from ``vm`` does: any VM that sees an event (its
        Resources and the rest of their sets) may approve it for all of Resources.
        UnknownEventError if ``vm`` does not see one of them (then nothing is approved)."""
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

    def update_event(
        self,
        event_id: str,
        *,
        event_type: EventType | None = None,
        resources: Sequence[str] | None = None,
        not_before_seconds: float | None = None,
        duration_in_seconds: int | None = None,
        description: str | None = None,
    ) -> EventInfo:
        """Change a Scheduled event in place, as Azure may; every VM that sees it (before or
        after the change) gets a new DocumentIncarnation.

        ``not_before_seconds`` is a new notice from now (simulated). Raises EventStateError when
        the event is not Scheduled, InvalidEventError for unknown VMs, values out of range or no
        change given, UnknownEventError for an unknown event.

        >>> # sim.update_event(event.event_id, duration_in_seconds=30, not_before_seconds=600)
        """
        try:
            update = EventUpdate(
                event_type=event_type,
                resources=None if resources is None else tuple(resources),
                not_before_seconds=not_before_seconds,
                duration_in_seconds=duration_in_seconds,
                description=description,
            )
        except ValidationError as exc:
            raise InvalidEventError(describe_validation_error(exc)) from exc
        return self.apply_update(event_id, update)

    def apply_update(self, event_id: str, update: EventUpdate) -> EventInfo:
        """:meth:`update_event` with the change as one object (admin API, scenarios)."""
        return self._ledger.update(event_id, update).snapshot()

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
        ledger = self._ledger
        incarnation = ledger.incarnation(vm)  # catches up with the clock first
        if not self._history.knows(vm, incarnation):
            snapshot = tuple(e.frozen() for e in ledger.live_events_of(vm))
            self._history.record(vm, incarnation, snapshot)
        return {
            "DocumentIncarnation": incarnation,
            "Events": render_events(ledger.live_events_of(vm), fields),
        }

    def scheduled_events_body(
        self, vm: str, api_version: str = LATEST_SCHEDULED_EVENTS_VERSION
    ) -> bytes:
        """:meth:`scheduled_events_document` as the compact JSON IMDS sends.

        Kept per VM while its DocumentIncarnation stays (which is exactly while its document
        stays): most polls find nothing new, and a fleet's documents are rendered once per change.
        """
        incarnation = self._ledger.incarnation(vm)
        cached = self._bodies.get(vm)
        if cached is not None and cached[0] == incarnation and cached[1] == api_version:
            return cached[2]
        body = json.dumps(
            self.scheduled_events_document(vm, api_version),
            ensure_ascii=False,
            separators=(",", ":"),
        ).encode()
        self._bodies[vm] = (incarnation, api_version, body)
        return body

    def stale_document(
        self, vm: str, steps: int, api_version: str = LATEST_SCHEDULED_EVENTS_VERSION
    ) -> dict[str, Any]:
        """A document IMDS produced for ``vm`` earlier: ``steps`` documents before the current
        one (the oldest remembered, when there are fewer), as it was then. What a ``stale``
        fault serves."""
        fields = event_fields(api_version)
        self.scheduled_events_document(vm)  # the current one counts as a step
        incarnation, events = self._history.back(vm, steps)
        return {"DocumentIncarnation": incarnation, "Events": render_events(events, fields)}

    def instance_document(self, vm: str) -> dict[str, Any]:
        """The body of ``GET /metadata/instance`` for ``vm``."""
        identity = self._fleet.identity(vm)
        return {"compute": identity.compute(), "network": identity.network()}

    # -- attested data -----------------------------------------------------------------------

    def attested_document(
        self, vm: str, nonce: str | None = None, api_version: str = LATEST_INSTANCE_VERSION
    ) -> dict[str, str]:
        """The body of ``GET /metadata/attested/document`` for ``vm``: ``{"encoding": "pkcs7",
        "signature": ...}`` (the format is in ``_attestation``'s docstring).

        Raises ValueError for a nonce that is not 1 to 32 letters and digits, or an api-version
        without attested data; UnknownVmError for an unknown VM.
        """
        if nonce is not None and not valid_nonce(nonce):
            raise ValueError(f"nonce {nonce!r}: use up to 32 letters and digits")
        if api_version not in ATTESTED_VERSIONS:
            raise ValueError(f"no attested data in api-version {api_version!r}")
        content = attested_content(
            self._fleet.identity(vm), nonce=nonce, api_version=api_version, now=self._clock.time()
        )
        return {"encoding": "pkcs7", "signature": self._attestation().sign(content)}

    @property
    def attestation_ca(self) -> AttestationCa:
        """The CA that issued the certificate signing attested documents."""
        return self._attestation().ca

    @property
    def attestation_ca_pem(self) -> bytes:
        """That CA's certificate, PEM: what a verifier trusts."""
        return self.attestation_ca.certificate_pem()

    def _attestation(self) -> Attestor:
        if self._attestor is None:  # made on first use: most simulators never sign anything
            config = self._config
            ca = config.attestation_ca or AttestationCa.generate(seed=config.seed)
            self._attestor = Attestor(ca, location=config.placement.location, seed=config.seed)
        return self._attestor

    # -- faults, throttling, first call, request log ----------------------------------------

    def add_fault(self, spec: FaultSpec) -> FaultInfo:
        """Inject a fault into the IMDS endpoints (never the admin API)."""
        log.info("fault added: %s", spec.model_dump(exclude_none=True))
        return self._faults.add(spec)

    def faults(self) -> list[FaultInfo]:
        return self._faults.list()

    def clear_faults(self) -> int:
        return self._faults.clear()

    def take_fault(self, vm: str, endpoint: Endpoint, method: str = "GET") -> FaultSpec | None:
        """The fault (if any) for this request, counted down."""
        return self._faults.take(vm, endpoint, method)

    def admit(self, vm: str) -> bool:
        """Count a request against ``vm``'s rate limit; False means answer 429."""
        return self._limiter.admit(vm)

    def take_first_call_delay(self, vm: str) -> float:
        """Real seconds this VM's first Scheduled Events call must wait; 0 after the first."""
        if vm in self._first_call_waiting:
            self._first_call_waiting.discard(vm)
            return self.to_real(self._config.first_call_delay)
        return 0.0

    def request_arrived(self, vm: str) -> None:
        """Count a request of ``vm`` as it arrives (its busiest one-second window)."""
        self._accounting.arrive(vm, self._clock.monotonic(), self._clock.time())

    def record_request(
        self,
        vm: str | None,
        method: str,
        path: str,
        status: int,
        *,
        endpoint: Endpoint | None = None,
    ) -> None:
        """Log an answered request (and count its status against ``vm``'s endpoint)."""
        self._requests.add(RequestRecord(vm, method, path, status, self._clock.time()))
        if vm is not None and endpoint is not None:
            self._accounting.answered(vm, endpoint, method, status)

    def request_stats(self, vm: str) -> RequestStats:
        """``vm``'s requests since the last reset: total, the most in any one-second window,
        and counts by endpoint, method and status.

        >>> # assert sim.request_stats("web_1").max_per_second <= 2
        >>> # assert sim.request_stats("web_1").count(method="POST", status=429) == 0
        """
        self._fleet.identity(vm)  # UnknownVmError for an unknown VM
        return self._accounting.stats(vm)

    def all_request_stats(self) -> list[RequestStats]:
        """:meth:`request_stats` of every VM that asked since the last reset."""
        return [self._accounting.stats(vm) for vm in self._accounting.vms()]

    def reset_request_stats(self) -> None:
        """Start a new accounting period now."""
        self._accounting.reset(self._clock.time())

    def requests(self, *, vm: str | None = None, limit: int | None = None) -> list[RequestRecord]:
        """The recent IMDS requests, oldest first."""
        return self._requests.recent(vm=vm, limit=limit)
