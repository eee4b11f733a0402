"""Events as the simulator keeps them: what a caller asks for, what it holds, what it shows.

Defaults per EventType (simulated seconds; ``--speed`` divides them):

============  ===========  ===================  ================================
EventType     notice       DurationInSeconds    RunSeconds (time spent Started)
============  ===========  ===================  ================================
Freeze        900 (15 m)   5                    DurationInSeconds if > 0, else 60
Reboot        900 (15 m)   -1                   same rule
Redeploy      600 (10 m)   -1                   same rule
Preempt       30           -1                   same rule
Terminate     300 (5 m)    -1                   same rule
============  ===========  ===================  ================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import formatdate
from enum import StrEnum
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The contract's names for what IMDS shows; the simulator adds the admin API's EventState.
from schemas.imds import EventSource, EventStatus, EventType

__all__ = [
    "DEFAULT_NOTICE_SECONDS",
    "Approval",
    "EventInfo",
    "EventSource",
    "EventSpec",
    "EventState",
    "EventStatus",
    "EventType",
    "EventUpdate",
    "iso_time",
    "rfc1123",
]


class EventState(StrEnum):
    """Where an event is in its life, as the admin API tells it."""

    SCHEDULED = "Scheduled"
    STARTED = "Started"
    COMPLETED = "Completed"
    CANCELED = "Canceled"


DEFAULT_NOTICE_SECONDS: dict[EventType, float] = {
    EventType.FREEZE: 900.0,
    EventType.REBOOT: 900.0,
    EventType.REDEPLOY: 600.0,
    EventType.PREEMPT: 30.0,
    EventType.TERMINATE: 300.0,
}
_DEFAULT_RUN_SECONDS = 60.0
_DESCRIPTIONS: dict[EventType, str] = {
    EventType.FREEZE: (
        "Virtual machine is being paused because of a memory-preserving Live Migration operation."
    ),
    EventType.REBOOT: "Virtual machine is going to be restarted as part of host maintenance.",
    EventType.REDEPLOY: "Virtual machine is going to be redeployed to another host.",
    EventType.PREEMPT: "Virtual machine is going to be evicted: Spot capacity is reclaimed.",
    EventType.TERMINATE: "Virtual machine is going to be deleted by its scale set.",
}
_OPERATION_ID = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_GUID = re.compile(r"^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$")


class EventSpec(BaseModel):
    """What to create: the body of ``POST /admin/events``, a scenario's ``event``, or in-process.

    JSON uses the PascalCase names (``EventType``, ``NotBeforeSeconds``...); Python uses the
    snake_case ones. Times are simulated seconds.

    >>> EventSpec(event_type=EventType.FREEZE, resources=["WestNO_0"], duration_in_seconds=5)
    ... # doctest: +ELLIPSIS
    EventSpec(event_type=<EventType.FREEZE: 'Freeze'>, ...)
    """

    model_config = ConfigDict(populate_by_name=True, frozen=True, extra="forbid")

    event_type: EventType = Field(alias="EventType")
    resources: tuple[str, ...] | None = Field(default=None, alias="Resources", min_length=1)
    event_status: EventStatus = Field(default=EventStatus.SCHEDULED, alias="EventStatus")
    not_before_seconds: float | None = Field(default=None, alias="NotBeforeSeconds", ge=0)
    duration_in_seconds: int | None = Field(default=None, alias="DurationInSeconds", ge=-1)
    event_source: EventSource = Field(default=EventSource.PLATFORM, alias="EventSource")
    description: str | None = Field(default=None, alias="Description")
    run_seconds: float | None = Field(default=None, alias="RunSeconds", ge=0)
    require_all_approvals: bool = Field(default=False, alias="RequireAllApprovals")
    event_id: str | None = Field(default=None, alias="EventId", pattern=_GUID.pattern)
    operation_id: str | None = Field(default=None, alias="OperationId", pattern=_OPERATION_ID)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.event_status is EventStatus.STARTED and self.not_before_seconds is not None:
            raise ValueError("NotBeforeSeconds makes no sense for an event born Started")
        if self.resources is not None and len(set(self.resources)) != len(self.resources):
            raise ValueError("Resources lists a VM twice")
        if self.operation_id is not None and self.event_type is not EventType.TERMINATE:
            raise ValueError("OperationId: only Terminate events share an operation")
        return self

    def notice_seconds(self) -> float:
        if self.not_before_seconds is not None:
            return self.not_before_seconds
        return DEFAULT_NOTICE_SECONDS[self.event_type]

    def duration(self) -> int:
        if self.duration_in_seconds is not None:
            return self.duration_in_seconds
        return 5 if self.event_type is EventType.FREEZE else -1

    def run(self) -> float:
        if self.run_seconds is not None:
            return self.run_seconds
        duration = self.duration()
        return float(duration) if duration > 0 else _DEFAULT_RUN_SECONDS

    def describe(self) -> str:
        return self.description if self.description is not None else _DESCRIPTIONS[self.event_type]


class EventUpdate(BaseModel):
    """A change to a Scheduled event: the body of ``PATCH /admin/events/{id}``, a scenario's
    ``update_event``, or :meth:`publisher.simulator.Simulator.update_event`.

    Azure may change an event it already announced (a longer impact, a later NotBefore, more VMs).
    ``NotBeforeSeconds`` is a new notice from now (simulated seconds). Fields left out keep their
    value; at least one must be given.

    >>> EventUpdate(duration_in_seconds=10).duration_in_seconds
    10
    """

    model_config = ConfigDict(populate_by_name=True, frozen=True, extra="forbid")

    event_type: EventType | None = Field(default=None, alias="EventType")
    resources: tuple[str, ...] | None = Field(default=None, alias="Resources", min_length=1)
    not_before_seconds: float | None = Field(default=None, alias="NotBeforeSeconds", ge=0)
    duration_in_seconds: int | None = Field(default=None, alias="DurationInSeconds", ge=-1)
    description: str | None = Field(default=None, alias="Description")

    @model_validator(mode="after")
    def _something(self) -> Self:
        if self.resources is not None and len(set(self.resources)) != len(self.resources):
            raise ValueError("Resources lists a VM twice")
        if all(getattr(self, name) is None for name in type(self).model_fields):
            raise ValueError(
                "give at least one of EventType, Resources, NotBeforeSeconds, DurationInSeconds,"
                " Description"
            )
        return self


def rfc1123(wall: float) -> str:
    """``Mon, 11 Apr 2022 22:26:58 GMT``, the form of ``NotBefore``."""
    return formatdate(wall, usegmt=True)


def iso_time(wall: float) -> str:
    """ISO 8601 in UTC with milliseconds, the form of the admin API's times."""
    text = datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class Approval:
    """A VM's ``StartRequests`` for an event, first time only."""

    vm: str
    time: float

    def to_json(self) -> dict[str, Any]:
        return {"Vm": self.vm, "Time": iso_time(self.time)}


@dataclass(frozen=True, slots=True)
class EventInfo:
    """A snapshot of one event, for in-process callers and the admin API."""

    event_id: str
    event_type: EventType
    event_source: EventSource
    resources: tuple[str, ...]
    description: str
    duration_in_seconds: int
    run_seconds: float
    require_all_approvals: bool
    state: EventState
    not_before: str
    created_at: float
    started_at: float | None = None
    ended_at: float | None = None
    approvals: tuple[Approval, ...] = field(default=())
    #: Every VM whose document lists the event: those of ``resources`` and the rest of their
    #: availability sets or placement groups.
    seen_by: tuple[str, ...] = field(default=())
    operation_id: str | None = None

    @property
    def status(self) -> EventStatus | None:
        """The ``EventStatus`` IMDS shows now, or None once the event is gone."""
        if self.state is EventState.SCHEDULED:
            return EventStatus.SCHEDULED
        if self.state is EventState.STARTED:
            return EventStatus.STARTED
        return None

    def to_json(self) -> dict[str, Any]:
        """The body of ``GET /admin/events/{id}``."""
        status = self.status
        return {
            "EventId": self.event_id,
            "State": self.state.value,
            "EventType": self.event_type.value,
            "ResourceType": "VirtualMachine",
            "Resources": list(self.resources),
            "EventStatus": None if status is None else status.value,
            "NotBefore": self.not_before,
            "Description": self.description,
            "EventSource": self.event_source.value,
            "DurationInSeconds": self.duration_in_seconds,
            "RunSeconds": self.run_seconds,
            "RequireAllApprovals": self.require_all_approvals,
            "Approvals": [a.to_json() for a in self.approvals],
            "SeenBy": list(self.seen_by),
            "OperationId": self.operation_id,
            "CreatedAt": iso_time(self.created_at),
            "StartedAt": None if self.started_at is None else iso_time(self.started_at),
            "EndedAt": None if self.ended_at is None else iso_time(self.ended_at),
        }
