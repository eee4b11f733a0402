"""The IMDS Scheduled Events document and its events, from every API version since 2017-08-01.

Fields a version did not have take their documented meaning (``DurationInSeconds`` -1, no
``Description``, no ``EventSource``). Unknown future values of ``EventType``, ``EventStatus`` and
``EventSource`` and unknown extra fields are kept, never rejected: an agent must not crash because
Azure added something. :meth:`ScheduledEvent.to_imds` gives back the exact wire shape.

>>> doc = ScheduledEventsDocument.from_imds({"DocumentIncarnation": 1, "Events": []})
>>> doc.events
()
"""

from __future__ import annotations

import email.utils
import json
from datetime import UTC, datetime
from enum import StrEnum
from functools import cached_property
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
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


class ScheduledEventsDocument(BaseModel):
    """The whole answer of ``GET /metadata/scheduledevents``.

    Only a successful IMDS answer becomes a document: an error or a timeout is an
    :class:`~schemas.ImdsError`, never an empty document.
    """

    model_config = ConfigDict(
        frozen=True, extra="allow", populate_by_name=True, serialize_by_alias=True
    )

    document_incarnation: int = Field(alias="DocumentIncarnation", ge=0)
    events: tuple[ScheduledEvent, ...] = Field(alias="Events")

    @classmethod
    def from_imds(cls, data: object) -> ScheduledEventsDocument:
        """Validate a decoded JSON document; :class:`SchemaError` when it is not one."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise SchemaError(f"not a Scheduled Events document: {exc}") from exc

    @classmethod
    def from_json(cls, raw: str | bytes) -> ScheduledEventsDocument:
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise SchemaError(f"the Scheduled Events document is not JSON: {exc}") from exc
        return cls.from_imds(data)

    def to_imds(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def event(self, event_id: str) -> ScheduledEvent | None:
        for event in self.events:
            if event.event_id == event_id:
                return event
        return None
