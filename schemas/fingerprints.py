"""Fingerprints: short, stable digests of content, defined once for both sides.

- :func:`content_fingerprint`: any JSON value, canonical encoding, SHA-256. Used where two
  pieces of content must compare equal exactly when they are equal (id conflicts, dedupe).
- :func:`event_version`: the version of one Scheduled Event *as a decider judges it*. An approval
  carries the version its decider saw; the agent applies it only while the live event still has
  that version, so an event that changed after it was judged is never started early.

The event version, for implementations in other languages: build the JSON object

==================== ==========================================================================
``EventId``          as IMDS gives it
``EventType``        as IMDS gives it (``"Freeze"``, ...)
``EventStatus``      as IMDS gives it (``"Scheduled"``, ...)
``Resources``        the names, each lower-cased (Unicode case folding), sorted
``NotBefore``        RFC 1123 in GMT (``"Mon, 11 Apr 2022 22:26:58 GMT"``), ``""`` when there is
                     none; a value that is not a date is taken as IMDS sent it
``DurationInSeconds`` an integer, ``-1`` when IMDS did not send it
``EventSource``      as IMDS gives it, ``null`` when IMDS did not send it
==================== ==========================================================================

encode it as JSON with keys sorted, no whitespace, non-ASCII characters as UTF-8 (not
escaped), take SHA-256 of the bytes and keep the first 32 lower-case hex digits.

>>> event_version(ScheduledEvent.from_imds({"EventId": "E", "EventStatus": "Scheduled",
...     "EventType": "Freeze", "Resources": ["B", "a"], "NotBefore": ""}))
'df43b667bf9c79e359ca7454d1369373'
"""

from __future__ import annotations

import hashlib
import json

from .imds import ScheduledEvent

__all__ = [
    "EVENT_VERSION_DEFINITION",
    "EVENT_VERSION_FIELDS",
    "content_fingerprint",
    "event_version",
]

#: The definition, in words, for the exported JSON Schema and AsyncAPI documents.
EVENT_VERSION_DEFINITION = (
    "The version of a Scheduled Event as a decider judged it: SHA-256 over the JSON object "
    "{EventId, EventType, EventStatus, Resources (each lower-cased, sorted), NotBefore (RFC 1123 "
    'GMT, "" when none; a value that is not a date as sent), DurationInSeconds (-1 when absent), '
    "EventSource (null when absent)}, keys sorted, no whitespace, UTF-8 not escaped; the first "
    "32 lower-case hex digits."
)

#: The IMDS fields an event version covers (a change of any of them is a new version).
EVENT_VERSION_FIELDS = (
    "EventId",
    "EventType",
    "EventStatus",
    "Resources",
    "NotBefore",
    "DurationInSeconds",
    "EventSource",
)


def canonical_json(value: object) -> bytes:
    """``value`` as JSON with sorted keys and no spaces: equal values, equal bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def content_fingerprint(value: object, *, digits: int = 32) -> str:
    """SHA-256 of the canonical JSON of ``value``, as ``digits`` lower-case hex digits."""
    return hashlib.sha256(canonical_json(value)).hexdigest()[:digits]


def event_version(event: ScheduledEvent) -> str:
    """The version of ``event`` a decision is bound to (see the module docstring)."""
    return content_fingerprint(
        {
            "EventId": event.event_id,
            "EventType": event.event_type,
            "EventStatus": event.event_status,
            "Resources": sorted(resource.casefold() for resource in event.resources),
            "NotBefore": event.not_before_key,
            "DurationInSeconds": event.duration_in_seconds,
            "EventSource": event.event_source,
        }
    )
