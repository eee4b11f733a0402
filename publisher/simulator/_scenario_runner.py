"""Play a scenario against a simulator in-process, at the simulator's speed."""

from __future__ import annotations

import asyncio
import logging

from ._errors import SimulatorError
from ._scenario import (
    AddFault,
    AddVms,
    Approve,
    CancelEvent,
    CompleteEvent,
    CreateEvent,
    Scenario,
    ScenarioAction,
    StartEvent,
    UpdateEvent,
)
from ._simulator import Simulator

__all__ = ["run_scenario"]

log = logging.getLogger(__name__)


async def run_scenario(simulator: Simulator, scenario: Scenario) -> dict[str, list[str]]:
    """Add the scenario's VMs (those missing; its topology unless its VMs are there), then
    apply each action at its time.

    Returns the EventIds created, by ref. An action the simulator refuses (say, cancelling an
    event that approvals already started) is logged and skipped: the scenario goes on.
    """
    scenario.check_vms(simulator.vm_names())
    for name in scenario.vms:
        if not simulator.has_vm(name):
            simulator.add_vm(name)
    topology = scenario.topology
    if topology is not None and not all(simulator.has_vm(n) for n, _ in topology.members()):
        simulator.add_topology(topology)
    loop = asyncio.get_running_loop()
    start = loop.time()
    refs: dict[str, list[str]] = {}
    log.info("scenario %s: %d action(s)", scenario.name, len(scenario.actions))
    for index, action in scenario.ordered():
        delay = start + simulator.to_real(action.at) - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            _apply(simulator, action, refs)
        except SimulatorError as exc:
            log.warning(
                "scenario %s: actions[%d] (%s) refused: %s; going on",
                scenario.name,
                index,
                action.action,
                exc,
            )
        else:
            log.info("scenario %s: actions[%d] %s done", scenario.name, index, action.action)
    return refs


def _apply(sim: Simulator, action: ScenarioAction, refs: dict[str, list[str]]) -> None:
    if isinstance(action, CreateEvent):
        spec = action.event
        if action.update_domain is not None:
            wanted = action.update_domain
            chosen = tuple(
                n for n in sim.vm_names() if sim.identity(n).platform_update_domain == wanted
            )
            if not chosen:
                raise SimulatorError(f"no VM in update domain {wanted}")
            spec = spec.model_copy(update={"resources": chosen})
        if action.per_vm:
            targets = spec.resources if spec.resources is not None else tuple(sim.vm_names())
            specs = [spec.model_copy(update={"resources": (n,), "event_id": None}) for n in targets]
        else:
            specs = [spec]
        ids = [sim.add_event(s).event_id for s in specs]
        if action.ref is not None:
            refs[action.ref] = ids
    elif isinstance(action, AddVms):
        sim.add_vms(n for n in action.names if not sim.has_vm(n))
    elif isinstance(action, AddFault):
        sim.add_fault(action.fault)
    else:
        for event_id in refs.get(action.event, []):
            if isinstance(action, UpdateEvent):
                sim.apply_update(event_id, action.changes)
            elif isinstance(action, CancelEvent):
                sim.cancel_event(event_id)
            elif isinstance(action, StartEvent):
                sim.start_event(event_id)
            elif isinstance(action, CompleteEvent):
                sim.complete_event(event_id)
            elif isinstance(action, Approve):
                sim.approve(action.vm, [event_id])
