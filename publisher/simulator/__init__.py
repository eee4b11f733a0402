"""A faithful Azure IMDS Scheduled Events simulator: a fleet, many events, real life cycles, and
the ways IMDS fails.

In-process (tests, demo)::

    from publisher.simulator import EventSpec, EventType, Simulator, SimulatorConfig, serve

    sim = Simulator(SimulatorConfig(speed=60), vms=["WestNO_0", "WestNO_1"])
    async with serve(sim) as server:            # uvicorn on 127.0.0.1, a free port
        url = server.vm_url("WestNO_0") + "/metadata/scheduledevents?api-version=2020-07-01"
        event = sim.add_event(EventSpec(event_type=EventType.FREEZE, duration_in_seconds=5))
        ...                                     # poll url with the header Metadata: true

A fleet with a topology: an event reaches every VM of the availability sets and placement
groups of its ``Resources``, and any of them may approve it::

    sim = Simulator(topology=Topology.fleet(2000, scale_sets=20, zones=3))
    sim.add_event(EventSpec(event_type=EventType.REBOOT, resources=("fleet-3_7",)))
    sim.group_of("fleet-3_7")                   # the VMs whose documents list it

And the rest, in-process and under ``/admin``: ``sim.update_event(id, ...)`` (PATCH
/admin/events/{id}); scale-set deletes as one Terminate per VM sharing an ``OperationId``;
hostile faults (``FaultSpec(stale=1)``, ``reset``, ``drip_seconds``, ``huge_mb``); attested data
signed by ``sim.attestation_ca_pem``'s CA; ``sim.request_stats(vm)`` (GET /admin/requests/stats);
``SimulatorConfig(shard=Shard(k, n), seed=...)`` to split a fleet over processes.

From a shell: ``python -m publisher.simulator --help``.

Serving over HTTP (:func:`serve`, :func:`create_app`, :class:`SimulatorServer`) needs the
``[simulator]`` extra (Starlette, uvicorn), imported on first use; the in-process simulator
does not.
"""

import importlib as _importlib
import typing as _typing

from ._accounting import RequestStats
from ._attestation import AttestationCa
from ._clock import Clock, ManualClock, SystemClock
from ._config import Shard, SimulatorConfig
from ._errors import (
    ConfigError,
    DuplicateVmError,
    EventStateError,
    InvalidEventError,
    InvalidVmNameError,
    ScenarioError,
    SimulatorError,
    UnknownEventError,
    UnknownVmError,
)
from ._events import (
    DEFAULT_NOTICE_SECONDS,
    Approval,
    EventInfo,
    EventSource,
    EventSpec,
    EventState,
    EventStatus,
    EventType,
    EventUpdate,
)
from ._faults import FaultInfo, FaultSpec
from ._identity import DEFAULT_SUBSCRIPTION_ID, Placement, VmIdentity
from ._requestlog import RequestRecord
from ._scenario import Scenario, load_scenario, shipped_scenarios
from ._scenario_runner import run_scenario
from ._simulator import Simulator
from ._topology import AvailabilitySetSpec, Membership, ScaleSetSpec, Topology
from ._versions import (
    INSTANCE_VERSIONS,
    LATEST_INSTANCE_VERSION,
    LATEST_SCHEDULED_EVENTS_VERSION,
    SCHEDULED_EVENTS_VERSIONS,
)

if _typing.TYPE_CHECKING:
    from ._app import create_app
    from ._server import SimulatorServer, serve

__all__ = [
    "DEFAULT_NOTICE_SECONDS",
    "DEFAULT_SUBSCRIPTION_ID",
    "INSTANCE_VERSIONS",
    "LATEST_INSTANCE_VERSION",
    "LATEST_SCHEDULED_EVENTS_VERSION",
    "SCHEDULED_EVENTS_VERSIONS",
    "Approval",
    "AttestationCa",
    "AvailabilitySetSpec",
    "Clock",
    "ConfigError",
    "DuplicateVmError",
    "EventInfo",
    "EventSource",
    "EventSpec",
    "EventState",
    "EventStateError",
    "EventStatus",
    "EventType",
    "EventUpdate",
    "FaultInfo",
    "FaultSpec",
    "InvalidEventError",
    "InvalidVmNameError",
    "ManualClock",
    "Membership",
    "Placement",
    "RequestRecord",
    "RequestStats",
    "ScaleSetSpec",
    "Scenario",
    "ScenarioError",
    "Shard",
    "Simulator",
    "SimulatorConfig",
    "SimulatorError",
    "SimulatorServer",
    "SystemClock",
    "Topology",
    "UnknownEventError",
    "UnknownVmError",
    "VmIdentity",
    "create_app",
    "load_scenario",
    "run_scenario",
    "serve",
    "shipped_scenarios",
]

# Loaded on first use: they need Starlette and uvicorn, the in-process simulator does not.
_HTTP = {"create_app": "._app", "serve": "._server", "SimulatorServer": "._server"}


def __getattr__(name: str) -> _typing.Any:
    home = _HTTP.get(name)
    if home is None:
        raise AttributeError(f"module 'publisher.simulator' has no attribute {name!r}")
    value = getattr(_importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value
