"""Scenarios: timed admin actions, from a JSON or TOML file or a shipped name.

A scenario names the VMs it needs and lists actions, each at a time in simulated seconds from
the start (``--speed`` divides them). Actions that create events may carry a ``ref`` that later
actions use. Shape (TOML)::

    name = "live-migration"
    description = "..."
    vms = ["WestNO_0", "WestNO_1"]

    [[actions]]
    at = 0
    action = "create_event"          # create_event | update_event | cancel_event |
    ref = "freeze"                   # start_event | complete_event | approve | fault | add_vms
    event = { EventType = "Freeze", DurationInSeconds = 5 }   # the POST /admin/events body

    [[actions]]
    at = 30
    action = "approve"
    event = "freeze"
    vm = "WestNO_1"

``update_event`` takes ``event = "ref"`` and ``changes = { DurationInSeconds = 30, ... }`` (the
``PATCH /admin/events/{id}`` body). ``create_event`` may select its VMs with
``update_domain = N`` instead of ``Resources``, and ``per_vm = true`` makes one event per
selected VM (with an ``OperationId``, a scale-set delete: one Terminate per VM, waiting for each
other). A ``[topology]`` table (the shape of ``--topology``) adds scale sets and availability
sets besides ``vms``.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ._errors import ScenarioError, describe_validation_error
from ._events import EventSpec, EventUpdate
from ._faults import FaultSpec
from ._topology import Topology

__all__ = [
    "AddFault",
    "AddVms",
    "Approve",
    "CancelEvent",
    "CompleteEvent",
    "CreateEvent",
    "Scenario",
    "ScenarioAction",
    "StartEvent",
    "UpdateEvent",
    "load_scenario",
    "shipped_scenarios",
]

_SUFFIXES = (".toml", ".json")


class _Action(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    at: float = Field(ge=0, description="simulated seconds after the scenario starts")


class CreateEvent(_Action):
    action: Literal["create_event"]
    event: EventSpec
    ref: str | None = None
    update_domain: int | None = Field(default=None, ge=0)
    per_vm: bool = False

    @model_validator(mode="after")
    def _one_selector(self) -> Self:
        if self.update_domain is not None and self.event.resources is not None:
            raise ValueError("give either update_domain or event.Resources, not both")
        return self


class _OnEvent(_Action):
    event: str = Field(description="the ref of an earlier create_event")


class UpdateEvent(_OnEvent):
    action: Literal["update_event"]
    changes: EventUpdate


class CancelEvent(_OnEvent):
    action: Literal["cancel_event"]


class StartEvent(_OnEvent):
    action: Literal["start_event"]


class CompleteEvent(_OnEvent):
    action: Literal["complete_event"]


class Approve(_OnEvent):
    action: Literal["approve"]
    vm: str


class AddFault(_Action):
    action: Literal["fault"]
    fault: FaultSpec


class AddVms(_Action):
    action: Literal["add_vms"]
    names: list[str] = Field(min_length=1)


ScenarioAction = Annotated[
    CreateEvent
    | UpdateEvent
    | CancelEvent
    | StartEvent
    | CompleteEvent
    | Approve
    | AddFault
    | AddVms,
    Field(discriminator="action"),
]


class Scenario(BaseModel):
    """A validated scenario; :meth:`ordered` gives its actions in the order they run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str = ""
    vms: list[str] = Field(default_factory=list)
    topology: Topology | None = None
    actions: list[ScenarioAction] = Field(min_length=1)

    def all_vms(self) -> list[str]:
        """``vms``, then the VMs of ``topology``."""
        names = list(self.vms)
        if self.topology is not None:
            names += [name for name, _ in self.topology.members()]
        return names

    def ordered(self) -> list[tuple[int, ScenarioAction]]:
        """(index in the file, action), by time; ties keep the file's order."""
        return sorted(enumerate(self.actions), key=lambda pair: (pair[1].at, pair[0]))

    @model_validator(mode="after")
    def _refs_defined_before_use(self) -> Self:
        defined: set[str] = set()
        for index, action in self.ordered():
            if isinstance(action, CreateEvent) and action.ref is not None:
                if action.ref in defined:
                    raise ValueError(f"actions[{index}].ref: {action.ref!r} is used twice")
                defined.add(action.ref)
            elif isinstance(action, _OnEvent) and action.event not in defined:
                raise ValueError(
                    f"actions[{index}].event: no earlier create_event has ref {action.event!r}"
                )
        return self

    def check_vms(self, known: Iterable[str]) -> None:
        """Raise ScenarioError naming the field when an action names a VM that will not exist.

        ``known`` is the VMs the simulator has besides the scenario's own ``vms``.
        """
        names = set(known) | set(self.all_vms())
        for _, action in self.ordered():
            if isinstance(action, AddVms):
                names.update(action.names)
        for index, action in enumerate(self.actions):
            where = f"{self.name}: actions[{index}]"
            missing: list[str] = []
            if isinstance(action, CreateEvent) and action.event.resources is not None:
                missing = [n for n in action.event.resources if n not in names]
                where += ".event.Resources"
            elif isinstance(action, UpdateEvent) and action.changes.resources is not None:
                missing = [n for n in action.changes.resources if n not in names]
                where += ".changes.Resources"
            elif isinstance(action, Approve) and action.vm not in names:
                missing, where = [action.vm], where + ".vm"
            elif isinstance(action, AddFault) and action.fault.vm is not None:
                missing = [action.fault.vm] if action.fault.vm not in names else []
                where += ".fault.vm"
            if missing:
                raise ScenarioError(f"{where}: unknown VM(s) {', '.join(map(repr, missing))}")


def _scenario_dir() -> Traversable:
    return resources.files("publisher.simulator").joinpath("scenarios")


def shipped_scenarios() -> dict[str, Scenario]:
    """The scenarios shipped in ``publisher/simulator/scenarios``, by name."""
    shipped: dict[str, Scenario] = {}
    for entry in sorted(_scenario_dir().iterdir(), key=lambda e: e.name):
        if entry.is_file() and entry.name.endswith(_SUFFIXES):
            scenario = _parse(entry.read_text(encoding="utf-8"), entry.name)
            shipped[scenario.name] = scenario
    return shipped


def load_scenario(source: str | Path) -> Scenario:
    """A scenario from a file (``.json`` or ``.toml``) or by the name of a shipped one.

    Raises ScenarioError with a message naming the file and the bad field.
    """
    path = Path(source)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ScenarioError(f"{path}: cannot read: {exc}") from exc
        return _parse(text, str(path))
    shipped = {p.name.rsplit(".", 1)[0]: p for p in _scenario_dir().iterdir() if p.is_file()}
    entry = shipped.get(str(source))
    if entry is None:
        names = ", ".join(sorted(n for n in shipped if not n.startswith("_")))
        raise ScenarioError(f"{source}: no such file, nor a shipped scenario ({names})")
    return _parse(entry.read_text(encoding="utf-8"), entry.name)


def _parse(text: str, origin: str) -> Scenario:
    document: Any
    try:
        if origin.endswith(".json"):
            document = json.loads(text)
        elif origin.endswith(".toml"):
            document = tomllib.loads(text)
        else:
            raise ScenarioError(f"{origin}: a scenario file ends in .json or .toml")
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ScenarioError(
            f"{origin}: not valid {origin.rsplit('.', 1)[-1].upper()}: {exc}"
        ) from exc
    if not isinstance(document, dict):
        raise ScenarioError(f"{origin}: a scenario is an object with vms and actions")
    document.setdefault("name", Path(origin).name.rsplit(".", 1)[0])
    try:
        return Scenario.model_validate(document)
    except ValidationError as exc:
        raise ScenarioError(f"{origin}: {describe_validation_error(exc)}") from exc
