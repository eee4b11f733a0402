"""The IMDS Scheduled Events document and its events, from every API version since 2017-08-01.

Fields a version did not have take their documented meaning (``DurationInSeconds`` -1, no
``Description``, no ``EventSource``). Unknown future values of ``EventType``, ``EventStatus`` and
``EventSource`` and unknown extra fields are kept, never rejected: an agent must not crash because
Azure added something. :meth:`ScheduledEvent.to_imds` gives back the exact wire shape.

An item of ``Events`` that is not a valid event (a required field missing, an EventId over
:data:`MAX_KEY_LENGTH` characters, Resources that are not names...) costs that item, not the
document: the document keeps the valid events and records what can be said of each unreadable
one (:class:`UnreadableEvent`). Only the document's own structure (an object, its
DocumentIncarnation, an Events list) decides whether an answer is a document at all.

>>> doc = ScheduledEventsDocument.from_imds({"DocumentIncarnation": 1, "Events": []})
>>> doc.events
()
"""

from __future__ import annotations

import email.utils
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from functools import cached_property
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_serializer,
)

from ._errors import SchemaError
from .identity import MAX_KEY_LENGTH

__all__ = [
    "API_VERSIONS",
    "DEFAULT_API_VERSION",
    "EventSource",
    "EventStatus",
    "EventType",
    "ScheduledEvent",
    "ScheduledEventsDocument",
    "UnreadableEvent",
    "format_not_before",
    "parse_not_before",
]

#: Every api-version of the Scheduled Events endpoint, oldest first (2017-03-01 was a preview).
API_VERSIONS: tuple[str, ...] = (
    "2017-08-01",
    "2017-11-01",
    "2019-01-01",
    "2019-04-01",
    "2019-08-01",
    "2020-07-01",
)
DEFAULT_API_VERSION = "2020-07-01"


class EventType(StrEnum):
    """Known event types. The model keeps any other string Azure may add."""

    FREEZE = "Freeze"
    REBOOT = "Reboot"
    REDEPLOY = "Redeploy"
    PREEMPT = "Preempt"
    TERMINATE = "Terminate"


class EventStatus(StrEnum):
    """Known statuses. There is no "Completed": a finished event disappears from the document."""

    SCHEDULED = "Scheduled"
    STARTED = "Started"


class EventSource(StrEnum):
    PLATFORM = "Platform"
    USER = "User"


def parse_not_before(value: str) -> datetime | None:
    """RFC 1123 (``Mon, 11 Apr 2022 22:26:58 GMT``) to an aware UTC datetime; ``""`` to None."""
    if value.strip() == "":
        return None
    try:
        parsed = email.utils.parsedate_to_datetime(value)
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        # A date at the edge of the calendar in another zone ("31 Dec 9999 23:00 -0500") has
        # no UTC equivalent: OverflowError, not a date either.
        return parsed.astimezone(UTC)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"NotBefore {value!r} is not an RFC 1123 date") from exc


def format_not_before(value: datetime | None) -> str:
    """The IMDS form of NotBefore: RFC 1123 in GMT, or ``""`` when there is none."""
    if value is None:
        return ""
    if value.tzinfo is None:
        raise ValueError("NotBefore must be timezone-aware")
    return email.utils.format_datetime(value.astimezone(UTC), usegmt=True)


# Fields that some API versions do not send: serialised back only when IMDS sent them.
_OPTIONAL_WIRE_FIELDS = ("Description", "EventSource", "DurationInSeconds")


class ScheduledEvent(BaseModel):
    """One event of the document, with IMDS field names on the wire."""

    model_config = ConfigDict(
        frozen=True, extra="allow", populate_by_name=True, serialize_by_alias=True
    )

    event_id: str = Field(alias="EventId", min_length=1, max_length=MAX_KEY_LENGTH)
    event_status: str = Field(alias="EventStatus")
    event_type: str = Field(alias="EventType")
    resource_type: str = Field(default="VirtualMachine", alias="ResourceType")
    resources: tuple[str, ...] = Field(default=(), alias="Resources")
    #: ``NotBefore`` exactly as IMDS sent it: RFC 1123 in GMT, ``""`` once Started. A value that
    #: is not a date is kept as sent (see :attr:`not_before_valid`): one bad field must not
    #: blind the agent to every other event of the document.
    not_before_text: Annotated[
        str,
        WithJsonSchema(
            {
                "type": "string",
                "description": 'RFC 1123 in GMT ("Mon, 11 Apr 2022 22:26:58 GMT"), or "" once '
                "the event started",
            }
        ),
    ] = Field(default="", alias="NotBefore")
    description: str | None = Field(default=None, alias="Description")
    event_source: str | None = Field(default=None, alias="EventSource")
    duration_in_seconds: int = Field(default=-1, alias="DurationInSeconds")

    @field_validator("not_before_text", mode="before")
    @classmethod
    def _keep_not_before(cls, value: object) -> object:
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        # Not a string at all: kept as its JSON text, and not a valid date.
        return json.dumps(value)

    @cached_property
    def _parsed_not_before(self) -> tuple[datetime | None, bool]:
        try:
            return parse_not_before(self.not_before_text), True
        except ValueError:
            return None, False

    @property
    def not_before(self) -> datetime | None:
        """NotBefore as an aware UTC datetime; None when there is none or it is not a date."""
        return self._parsed_not_before[0]

    @property
    def not_before_valid(self) -> bool:
        """False when IMDS sent a NotBefore that is not an RFC 1123 date (it is kept as sent)."""
        return self._parsed_not_before[1]

    @property
    def not_before_key(self) -> str:
        """NotBefore normalised for comparison: the date in the canonical RFC 1123 form, or the
        text as sent when it is not a date."""
        parsed, valid = self._parsed_not_before
        return format_not_before(parsed) if valid else self.not_before_text

    @model_serializer(mode="wrap")
    def _wire_shape(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for field_name, alias in zip(
            ("description", "event_source", "duration_in_seconds"),
            _OPTIONAL_WIRE_FIELDS,
            strict=True,
        ):
            if field_name not in self.model_fields_set:
                data.pop(alias, None)
        return data

    @classmethod
    def from_imds(cls, data: object) -> ScheduledEvent:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise SchemaError(f"not a Scheduled Events event: {exc}") from exc

    def to_imds(self) -> dict[str, Any]:
        """The event exactly as IMDS sends it (field names, NotBefore format, extra fields)."""
        return self.model_dump(mode="json")

    @property
    def is_scheduled(self) -> bool:
        return self.event_status == EventStatus.SCHEDULED

    @property
    def is_started(self) -> bool:
        return self.event_status == EventStatus.STARTED

    def affects(self, vm_name: str) -> bool:
        """Whether ``vm_name`` is listed in ``Resources`` (names compare case-insensitively)."""
        wanted = vm_name.casefold()
        return any(resource.casefold() == wanted for resource in self.resources)


#: The longest reason kept for an unreadable event (IMDS may send megabytes in one item).
MAX_REASON_LENGTH = 200
#: How many of an unreadable item's errors its reason names.
_ERRORS_NAMED = 3


@dataclass(frozen=True, slots=True)
class UnreadableEvent:
    """An item of ``Events`` that is not a valid event: all that is kept of it.

    ``event_id`` is its EventId when that can be read as the contract takes one (a string of 1
    to :data:`MAX_KEY_LENGTH` characters), else None: such an item could be any event.
    ``reason`` says why it is not an event, in at most :data:`MAX_REASON_LENGTH` printable
    characters. The item itself is not kept (it may be megabytes)."""

    event_id: str | None
    reason: str

    @classmethod
    def of(cls, item: object, error: ValidationError) -> UnreadableEvent:
        """What is kept of ``item``, which is not a valid event (``error`` says why)."""
        event_id = item.get("EventId") if isinstance(item, dict) else None
        readable = isinstance(event_id, str) and 1 <= len(event_id) <= MAX_KEY_LENGTH
        return cls(event_id if readable else None, _reason(error))

    @classmethod
    def not_an_object(cls, item: object) -> UnreadableEvent:
        """What is kept of ``item``, which is not even an object (it has no EventId)."""
        return cls(None, f"not an object: a JSON {_json_kind(item)}")


def _reason(error: ValidationError) -> str:
    """Why an item is not an event, short and printable: the fields at fault and what is wrong
    with each (pydantic's own words, which name what was expected, not what IMDS sent)."""
    errors = error.errors(include_url=False, include_input=False)
    text = "; ".join(
        f"{'.'.join(str(part) for part in e['loc']) or 'the event'}: {e['msg']}"
        for e in errors[:_ERRORS_NAMED]
    )
    if len(errors) > _ERRORS_NAMED:
        text += f"; and {len(errors) - _ERRORS_NAMED} more"
    printable = "".join(c if c.isprintable() else "?" for c in text)
    if len(printable) > MAX_REASON_LENGTH:
        printable = printable[: MAX_REASON_LENGTH - 3] + "..."
    return printable


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "list"
    return type(value).__name__


class ScheduledEventsDocument(BaseModel):
    """The whole answer of ``GET /metadata/scheduledevents``.

    Only a successful IMDS answer becomes a document: an error or a timeout is an
    :class:`~schemas.ImdsError`, never an empty document. ``events`` holds the valid events;
    ``unreadable`` what can be said of the items that are not (never on the wire: what the
    document gives back, and what the agent stores, are its valid events).
    """

    model_config = ConfigDict(
        frozen=True, extra="allow", populate_by_name=True, serialize_by_alias=True
    )

    document_incarnation: int = Field(alias="DocumentIncarnation", ge=0)
    events: tuple[ScheduledEvent, ...] = Field(alias="Events")
    _unreadable: tuple[UnreadableEvent, ...] = PrivateAttr(default=())

    @classmethod
    def from_imds(cls, data: object) -> ScheduledEventsDocument:
        """Validate a decoded JSON document; :class:`SchemaError` when it is not one (not an
        object, no valid DocumentIncarnation, no Events list). An item of Events that is not a
        valid event is recorded in :attr:`unreadable` instead of failing the document."""
        try:
            return cls.model_validate(data)  # every event valid: the usual answer, at once
        except ValidationError as exc:
            structure = exc
        items = data.get("Events") if isinstance(data, dict) else None
        if not isinstance(data, dict) or not isinstance(items, list | tuple):
            raise SchemaError(f"not a Scheduled Events document: {structure}") from structure
        events: list[ScheduledEvent] = []
        unreadable: list[UnreadableEvent] = []
        # Equal records are one object: a document of a million broken items holds a few.
        records: dict[UnreadableEvent, UnreadableEvent] = {}
        for item in items:
            if isinstance(item, dict | ScheduledEvent):
                try:
                    events.append(ScheduledEvent.model_validate(item))
                    continue
                except ValidationError as exc:
                    record = UnreadableEvent.of(item, exc)
            else:  # not worth pydantic's error, which costs more than the rest of the item
                record = UnreadableEvent.not_an_object(item)
            unreadable.append(records.setdefault(record, record))
        try:
            document = cls.model_validate({**data, "Events": events})
        except ValidationError as exc:
            raise SchemaError(f"not a Scheduled Events document: {exc}") from exc
        document._unreadable = tuple(unreadable)
        return document

    @classmethod
    def from_json(cls, raw: str | bytes) -> ScheduledEventsDocument:
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise SchemaError(f"the Scheduled Events document is not JSON: {exc}") from exc
        return cls.from_imds(data)

    def to_imds(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @property
    def unreadable(self) -> tuple[UnreadableEvent, ...]:
        """The items of Events that are not valid events, in document order."""
        return self._unreadable

    @property
    def unreadable_ids(self) -> frozenset[str]:
        """The EventIds of the unreadable items whose EventId can be read."""
        return frozenset(u.event_id for u in self._unreadable if u.event_id is not None)

    @property
    def unidentified(self) -> bool:
        """Whether an unreadable item has no readable EventId: it could be any event."""
        return any(u.event_id is None for u in self._unreadable)

    def with_events(self, extra: Iterable[ScheduledEvent]) -> ScheduledEventsDocument:
        """This document's valid events followed by ``extra``, as a document that lists nothing
        unreadable (see :func:`schemas.transitions.kept_after`)."""
        copy = self.model_copy(update={"events": (*self.events, *extra)})
        copy._unreadable = ()
        return copy

    def event(self, event_id: str) -> ScheduledEvent | None:
        """The valid event ``event_id``; None when there is none (an unreadable one included:
        see :attr:`unreadable_ids`)."""
        for event in self.events:
            if event.event_id == event_id:
                return event
        return None
