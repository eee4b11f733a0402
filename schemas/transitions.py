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

The agent knows one thing the documents do not: whether its own StartRequests for an event
succeeded. An event it started that is gone while the last document still showed it Scheduled
ran between two polls, and the agent reports it ``completed`` (``publisher/_watch.py``), not
``canceled``.

``current`` must be a document IMDS really returned: an IMDS error or timeout is an exception
in the caller, never an empty document, so it can never cancel or complete every event.

An event IMDS lists but describes in a way that cannot be read (``current.unreadable``: a field
missing, an EventId over 200 characters...) is never taken for gone. One whose EventId can be
read is **held** at its last readable state: no transition, whatever it became. An unreadable
item whose EventId cannot be read could be any event: while one is listed, **no** event of
``previous`` is taken for gone, and the disappearances wait for an answer without one. New
readable events and changes to readable events are reported as usual. The events held this way
stay in :func:`kept_after`, the document to diff the next answer against, so a later readable
answer is compared with their last readable state: an event that turns readable again
unchanged gives nothing, one that went meanwhile gives its end once.

Every transition carries the event's **revision**: 0 for the first transition an agent reports
about an event, then one more for each next one. With the event and the VM it identifies the
point of the event's life, so two different transitions never share a message id (an
``updated`` back to earlier content is a new revision), while the same transition computed
again from the same stored state keeps its id. :func:`revisions_after` carries the counters from
one document to the next; the agent stores them with the document, in the same transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from .imds import EventStatus, ScheduledEvent, ScheduledEventsDocument

__all__ = [
    "GONE_REVISIONS_KEPT",
    "Transition",
    "TransitionKind",
    "diff",
    "held",
    "kept_after",
    "revisions_after",
]


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
    #: The event's revision this transition makes (see the module docstring).
    revision: int = 0


def _compared(event: ScheduledEvent) -> tuple[object, ...]:
    return (
        event.not_before_key,
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
    previous: ScheduledEventsDocument | None,
    current: ScheduledEventsDocument,
    revisions: Mapping[str, int] | None = None,
) -> list[Transition]:
    """The transitions from ``previous`` (None: nothing was known yet) to ``current``,
    new and changed events in document order first, then the ones that disappeared (never one
    that :func:`held` keeps).

    ``revisions`` holds the last revision reported for each event (from
    :func:`revisions_after`); an event it does not hold starts at revision 0."""
    last = revisions or {}
    before: dict[str, ScheduledEvent] = {e.event_id: e for e in _events(previous)}
    kept = {e.event_id for e in held(previous, current)}
    seen: set[str] = set()
    out: list[Transition] = []

    def add(kind: TransitionKind, event: ScheduledEvent, status: str | None) -> None:
        revision = last[event.event_id] + 1 if event.event_id in last else 0
        out.append(Transition(kind, event, status, current.document_incarnation, revision))

    for event in current.events:
        if event.event_id in seen:  # IMDS never repeats an id; if it did, the first one counts
            continue
        seen.add(event.event_id)
        old = before.get(event.event_id)
        if old is None:
            add(
                TransitionKind.STARTED if event.is_started else TransitionKind.SCHEDULED,
                event,
                None,
            )
            continue
        changed = _change(old, event)
        if changed is not None:
            add(changed, event, old.event_status)
    for event_id, old in before.items():
        if event_id not in seen and event_id not in kept:
            kind = TransitionKind.COMPLETED if old.is_started else TransitionKind.CANCELED
            add(kind, old, old.event_status)
    return out


#: How many events no longer in the document keep their revision counter (an EventId that
#: comes back continues its count instead of reusing the ids of its first life).
GONE_REVISIONS_KEPT = 1000


def revisions_after(
    revisions: Mapping[str, int] | None,
    transitions: Iterable[Transition],
    current: ScheduledEventsDocument,
    *,
    keep_gone: int = GONE_REVISIONS_KEPT,
) -> dict[str, int]:
    """The revision counters once ``transitions`` (from :func:`diff`) are reported: every event
    of ``current`` first (pass :func:`kept_after`, which holds the events not taken for gone),
    then the ``keep_gone`` most recently finished ones."""
    updated = dict(revisions or {})
    for transition in transitions:
        updated.pop(transition.event.event_id, None)  # re-inserted last: most recent
        updated[transition.event.event_id] = transition.revision
    live = {event.event_id for event in current.events} | current.unreadable_ids
    gone = [event_id for event_id in updated if event_id not in live]
    for event_id in gone[: max(len(gone) - keep_gone, 0)]:
        del updated[event_id]
    return updated


def held(
    previous: ScheduledEventsDocument | None, current: ScheduledEventsDocument
) -> tuple[ScheduledEvent, ...]:
    """The events of ``previous``, in their last readable state, that ``current`` does not list
    readably but that may not be taken for gone from it: every one while ``current`` lists an
    unreadable item whose EventId cannot be read (it could be any of them), else those it lists
    unreadable under their EventId."""
    if previous is None or not current.unreadable:
        return ()
    listed = {event.event_id for event in current.events}
    if current.unidentified:
        return tuple(e for e in previous.events if e.event_id not in listed)
    unreadable = current.unreadable_ids
    return tuple(
        e for e in previous.events if e.event_id in unreadable and e.event_id not in listed
    )


def kept_after(
    previous: ScheduledEventsDocument | None, current: ScheduledEventsDocument
) -> ScheduledEventsDocument:
    """What to trust, store and diff the next answer against once ``current`` is taken:
    ``current`` itself, or, when it lists unreadable events, its valid events followed by the
    events :func:`held` keeps at their last readable state (a copy that lists nothing
    unreadable: what is held is what was last read)."""
    if not current.unreadable:
        return current
    return current.with_events(held(previous, current))


def _events(document: ScheduledEventsDocument | None) -> Iterable[ScheduledEvent]:
    return () if document is None else document.events
