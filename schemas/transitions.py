"""Transitions: what changed between two Scheduled Events documents, as one pure function.

======================================  ===========
previous -> current                     transition
======================================  ===========
(absent) -> Scheduled                   scheduled
(absent) -> Started (hardware failure)  started
Scheduled -> Started                    started
same status, NotBefore, Resources,      updated
Description, DurationInSeconds or
EventType changed
Started -> (absent)                     completed
Scheduled -> (absent)                   canceled
the same document again, or a new       (nothing)
incarnation with the same events
======================================  ===========

``current`` must be a document IMDS really returned: an IMDS error or timeout is an exception
in the caller, never an empty document, so it can never cancel or complete every event.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from .imds import EventStatus, ScheduledEvent, ScheduledEventsDocument

__all__ = ["Transition", "TransitionKind", "diff"]


class TransitionKind(StrEnum):
    SCHEDULED = "scheduled"
    STARTED = "started"
    UPDATED = "updated"
    COMPLETED = "completed"
    CANCELED = "canceled"

    @property
    def is_terminal(self) -> bool:
        return self in (TransitionKind.COMPLETED, TransitionKind.CANCELED)


@dataclass(frozen=True, slots=True)
class Transition:
    """One change of one event. For ``completed`` and ``canceled`` ``event`` is the last version
    seen before it disappeared, and ``incarnation`` the document in which it was gone."""

    kind: TransitionKind
    event: ScheduledEvent
    previous_status: str | None
    incarnation: int


def _compared(event: ScheduledEvent) -> tuple[object, ...]:
    return (
        event.not_before,
        tuple(sorted(r.casefold() for r in event.resources)),
        event.description,
        event.duration_in_seconds,
        event.event_type,
    )


def _change(before: ScheduledEvent, after: ScheduledEvent) -> TransitionKind | None:
    if before.event_status != after.event_status:
        if after.event_status == EventStatus.STARTED:
            return TransitionKind.STARTED
        # A move to any other status (one Azure may add later) is reported, not guessed at.
        return TransitionKind.UPDATED
    if _compared(before) != _compared(after):
        return TransitionKind.UPDATED
    return None


def diff(
    previous: ScheduledEventsDocument | None, current: ScheduledEventsDocument
) -> list[Transition]:
    """The transitions from ``previous`` (None: nothing was known yet) to ``current``,
    new and changed events in document order first, then the ones that disappeared."""
    before: dict[str, ScheduledEvent] = {e.event_id: e for e in _events(previous)}
    seen: set[str] = set()
    out: list[Transition] = []
    for event in current.events:
        if event.event_id in seen:  # IMDS never repeats an id; if it did, the first one counts
            continue
        seen.add(event.event_id)
        old = before.get(event.event_id)
        if old is None:
            kind = TransitionKind.STARTED if event.is_started else TransitionKind.SCHEDULED
            out.append(Transition(kind, event, None, current.document_incarnation))
            continue
        changed = _change(old, event)
        if changed is not None:
            out.append(Transition(changed, event, old.event_status, current.document_incarnation))
    for event_id, old in before.items():
        if event_id not in seen:
            kind = TransitionKind.COMPLETED if old.is_started else TransitionKind.CANCELED
            out.append(Transition(kind, old, old.event_status, current.document_incarnation))
    return out


def _events(document: ScheduledEventsDocument | None) -> Iterable[ScheduledEvent]:
    return () if document is None else document.events
