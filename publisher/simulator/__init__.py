"""A faithful Azure IMDS Scheduled Events simulator: a fleet, many events, real life cycles, and
the ways IMDS fails.

In-process (tests, demo)::

    from publisher.simulator import EventSpec, EventType, Simulator, SimulatorConfig, serve

    sim = Simulator(SimulatorConfig(speed=60), vms=["WestNO_0", "WestNO_1"])
    async with serve(sim) as server:            # uvicorn on 127.0.0.1, a free port
        url = server.vm_url("WestNO_0") + "/metadata/scheduledevents?api-version=2020-07-01"
        event = sim.add_event(EventSpec(event_type=EventType.FREEZE, duration_in_seconds=5))
        ...                                     # poll url with the header Metadata: true

From a shell: ``python -m publisher.simulator --help``.
"""

from ._app import create_app
from ._clock import Clock, ManualClock, SystemClock
from ._config import SimulatorConfig
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
)
from ._faults import FaultInfo, FaultSpec
from ._identity import DEFAULT_SUBSCRIPTION_ID, Placement, VmIdentity
from ._requestlog import RequestRecord
from ._scenario import Scenario, load_scenario, shipped_scenarios
from ._scenario_runner import run_scenario
from ._server import SimulatorServer, serve
from ._simulator import Simulator
from ._versions import (
    INSTANCE_VERSIONS,
    LATEST_INSTANCE_VERSION,
    LATEST_SCHEDULED_EVENTS_VERSION,
    SCHEDULED_EVENTS_VERSIONS,
)

__all__ = [
    "DEFAULT_NOTICE_SECONDS",
    "DEFAULT_SUBSCRIPTION_ID",
    "INSTANCE_VERSIONS",
    "LATEST_INSTANCE_VERSION",
    "LATEST_SCHEDULED_EVENTS_VERSION",
    "SCHEDULED_EVENTS_VERSIONS",
    "Approval",
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
    "FaultInfo",
    "FaultSpec",
    "InvalidEventError",
    "InvalidVmNameError",
    "ManualClock",
    "Placement",
    "RequestRecord",
    "Scenario",
    "ScenarioError",
    "Simulator",
    "SimulatorConfig",
    "SimulatorError",
    "SimulatorServer",
    "SystemClock",
    "UnknownEventError",
    "UnknownVmError",
    "VmIdentity",
    "create_app",
    "load_scenario",
    "run_scenario",
    "serve",
    "shipped_scenarios",
]
