"""The Scheduled Events document as IMDS renders it for one api-version, and the documents it
produced for each VM (what a stale answer serves).

A document is a function of the VM's events and the api-version asked: older versions leave out
the fields and event types they did not have (see ``_versions``). The history keeps, per VM, the
last few distinct documents (by DocumentIncarnation) as immutable snapshots, so an older one can
be rendered again, for any api-version, exactly as it was.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from ._events import EventSource, EventState, EventType
from ._versions import EventFields

__all__ = ["DocumentHistory", "ShownEvent", "ShownSnapshot", "render_events"]

_KEPT = 16


class ShownEvent(Protocol):
    """What a document shows of an event (a live one, or a snapshot of it)."""

    @property
    def event_id(self) -> str: ...
    @property
    def event_type(self) -> EventType: ...
    @property
    def event_source(self) -> EventSource: ...
    @property
    def state(self) -> EventState: ...
    @property
    def resources(self) -> tuple[str, ...]: ...
    @property
    def not_before(self) -> str: ...
    @property
    def description(self) -> str: ...
    @property
    def duration_in_seconds(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ShownSnapshot:
    """What a document showed of an event at one moment: shared by every VM that saw it."""

    event_id: str
    event_type: EventType
    event_source: EventSource
    state: EventState
    resources: tuple[str, ...]
    not_before: str
    description: str
    duration_in_seconds: int


def render_events(events: Iterable[ShownEvent], fields: EventFields) -> list[dict[str, Any]]:
    """The ``Events`` array of a document, for the api-version whose ``fields`` these are."""
    rendered: list[dict[str, Any]] = []
    for event in events:
        if event.event_type is EventType.PREEMPT and not fields.preempt:
            continue
        if event.event_type is EventType.TERMINATE and not fields.terminate:
            continue
        started = event.state is EventState.STARTED
        resources = (
            ["_" + r for r in event.resources] if fields.underscore_names else list(event.resources)
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
        rendered.append(item)
    return rendered


class DocumentHistory:
    """Per VM, the last documents produced, oldest first: (DocumentIncarnation, events).

    Every VM starts at incarnation 1 with no events, so that one is always known.
    """

    def __init__(self, kept: int = _KEPT) -> None:
        self._kept = kept
        self._by_vm: dict[str, list[tuple[int, tuple[ShownEvent, ...]]]] = {}

    def knows(self, vm: str, incarnation: int) -> bool:
        """Whether the last document recorded for ``vm`` is at ``incarnation``."""
        documents = self._by_vm.get(vm)
        last = documents[-1][0] if documents else 1
        return last == incarnation

    def record(self, vm: str, incarnation: int, events: tuple[ShownEvent, ...]) -> None:
        """Remember a document (events as immutable snapshots); call when it is new."""
        documents = self._by_vm.setdefault(vm, [(1, ())])
        if documents[-1][0] == incarnation:
            return
        documents.append((incarnation, events))
        if len(documents) > self._kept:
            del documents[0]

    def back(self, vm: str, steps: int) -> tuple[int, tuple[ShownEvent, ...]]:
        """The document ``steps`` before the last recorded one (the oldest kept, if fewer)."""
        documents = self._by_vm.get(vm, [(1, ())])
        return documents[max(0, len(documents) - 1 - steps)]
