"""The lifecycle messages: CloudEvents 1.0, structured JSON mode.

Every message an agent publishes is one of four envelopes, chosen by its ``type``:

- :class:`TransitionMessage`: ``scheduled``, ``started``, ``updated``, ``completed``, ``canceled``
- :class:`ApprovalOutcomeMessage`: ``approval.applied``, ``approval.rejected``
- :class:`AgentMessage`: ``agent.online``, ``agent.heartbeat``, ``agent.offline``
- :class:`HookResultMessage`: ``hook.completed`` (a local hook ran on a transition)

Ids are deterministic: the same transition of the same event on the same VM at the same point
of the event's life (its revision) always gets the same id, across agent restarts, so consumers
and Service Bus duplicate detection drop repeats; two different transitions never share one.

:func:`decode` is the one way bytes become a message. It refuses what the contract does not
allow before anything else sees it: more than :data:`MAX_MESSAGE_BYTES`, text that is not UTF-8,
JSON nested deeper than the parser allows, the character U+0000 anywhere, a ``sequence`` above
2^63 - 1. Every failure is a :class:`SchemaError`; nothing else escapes.

>>> message = decode(raw_bytes)            # doctest: +SKIP
>>> message.kind, message.data.vm.name     # doctest: +SKIP
(<MessageType.STARTED: 'started'>, 'web-7')
"""

from __future__ import annotations

import hashlib
import re
import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, ClassVar, Literal, Self, TypeAlias

import pydantic_core
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from ._errors import SchemaError
from .channels import TYPE_PREFIX, MessageType, ReplyAddress, routing_key
from .fingerprints import EVENT_VERSION_DEFINITION, canonical_json, event_version
from .identity import MAX_KEY_LENGTH, VmIdentity
from .imds import ScheduledEvent
from .transitions import Transition
from .versioning import SCHEMA_VERSION, check_version

__all__ = [
    "CLOUDEVENTS_CONTENT_TYPE",
    "MAX_MESSAGE_BYTES",
    "MAX_SEQUENCE",
    "AgentData",
    "AgentMessage",
    "ApprovalOutcomeData",
    "ApprovalOutcomeMessage",
    "HookOutcome",
    "HookResultData",
    "HookResultMessage",
    "LifecycleMessage",
    "NewerMessage",
    "TransitionData",
    "TransitionMessage",
    "UnknownMessageType",
    "content_digest",
    "decode",
    "decode_newer",
    "encode",
    "expected_id",
    "loads",
    "message_id",
]

#: The content type of a structured-mode CloudEvent (CloudEvents AMQP binding).
CLOUDEVENTS_CONTENT_TYPE = "application/cloudevents+json"

_ID_NAMESPACE = uuid.UUID("5c1d7a3e-94a4-4b0e-8f35-3a7d0c2b9e61")

#: The largest message the contract allows (Service Bus Standard's limit; ours are ~2 KB).
MAX_MESSAGE_BYTES = 256 * 1024
#: The largest ``sequence``: a signed 64-bit integer, what every database and language stores.
MAX_SEQUENCE = 2**63 - 1
#: The longest heartbeat interval an agent may declare (seconds): an hour, so a consumer counts
#: an agent live for at most 2.5 hours without a word (see :data:`LIVENESS_PER_HEARTBEAT`).
MAX_HEARTBEAT_INTERVAL = 3600.0
#: A consumer counts an agent live for this many of its heartbeat intervals since it was last
#: heard from (one heartbeat may be lost and the next late), when that is longer than the
#: consumer's own liveness timeout (150 s: 2.5 of the agent's default minute).
LIVENESS_PER_HEARTBEAT = 2.5


class UnknownMessageType(SchemaError):
    """A well-formed CloudEvent whose ``type`` this code does not know (maybe a newer minor)."""


def message_id(*parts: str) -> str:
    """A deterministic UUID from the parts that identify one happening."""
    return str(uuid.uuid5(_ID_NAMESPACE, "\x1f".join(parts)))


def _outcome_id(data: ApprovalOutcomeData, kind: MessageType) -> str:
    parts = [data.vm.source, data.approval_id, kind.value]
    if data.epoch:
        parts.append(data.epoch)
    return message_id(*parts)


def _hook_id(data: HookResultData) -> str:
    # One run of one hook for one transition (the transition's id is unique to its point in the
    # event's life).
    about = data.transition_id or f"{data.event.event_id}/{data.transition}"
    return message_id(
        data.vm.source, about, MessageType.HOOK_COMPLETED.value, data.hook, str(data.attempt)
    )


def expected_id(message: LifecycleMessage) -> str | None:
    """The id a message must carry, computed from its own content: an agent derives every id
    from its VM's ``source`` and what happened, so a message whose id is not this one was not
    built by an agent of that VM (or was changed after). None where the message does not say
    enough to tell (messages of schema 1.0)."""
    data = message.data
    if isinstance(message, TransitionMessage):
        if message.data.revision is None:
            return None
        return message_id(
            message.source,
            message.data.event.event_id,
            message.kind.value,
            f"r{message.data.revision}",
        )
    if isinstance(message, ApprovalOutcomeMessage):
        if message.data.epoch is None:
            return None
        return _outcome_id(message.data, message.kind)
    if isinstance(message, HookResultMessage):
        if message.data.transition_id is None:
            return None
        return _hook_id(message.data)
    assert isinstance(data, AgentData)
    if data.instance is None:
        return None
    return message_id(message.source, message.kind.value, data.instance, message.time.isoformat())


#: Data fields that say when, not what: two messages that differ only there are one happening.
#: (A set, not a frozenset: the type pydantic's ``exclude`` takes.)
_VOLATILE: set[str] = {"document_incarnation", "uptime_seconds", "outbox_depth"}


def content_digest(message: LifecycleMessage | NewerMessage) -> str:
    """What a message says, as a digest: its type, source, subject and data, without the fields
    that only say when it was observed (the sequence, the time, the document incarnation). A
    repeat of a happening (a redelivery, a replay, the same transition announced again after
    the agent's state was lost) has the same digest; another message under the same id does
    not, and is an id conflict.

    Computed for every message a consumer handles, so it serializes the validated data once, in
    pydantic's core (field order is the model's, hence stable within a process: digests are kept
    in memory and compared only with digests made by this same function)."""
    if isinstance(message, NewerMessage):
        data = {k: v for k, v in message.data.items() if k not in _VOLATILE}
        said = canonical_json(data)
    else:
        said = message.data.model_dump_json(exclude=_VOLATILE).encode()
    digest = hashlib.sha256(pydantic_core.to_json([message.type, message.source, message.subject]))
    digest.update(b"\n")
    digest.update(said)
    return digest.hexdigest()[:32]


def dataschema_uri(name: str) -> str:
    return f"https://scheduled-events-relay.github.io/schemas/{SCHEMA_VERSION}/{name}.json"


# ---------------------------------------------------------------------------------------- data


class _Data(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)


class TransitionData(_Data):
    vm: VmIdentity
    #: The event exactly as IMDS gave it (IMDS field names); for ``completed`` and
    #: ``canceled`` the last version seen before it disappeared.
    event: ScheduledEvent
    previous_status: str | None
    document_incarnation: int
    reply_to: ReplyAddress
    #: (1.1) :func:`~schemas.fingerprints.event_version` of ``event``: what an approval of this
    #: version must name. Consumers may recompute it from ``event``.
    event_version: str | None = Field(
        default=None,
        description="(1.1) The version of `event` an approval must name. "
        + EVENT_VERSION_DEFINITION,
    )
    #: (1.1) The event's revision on this VM: 0 for the first report, then one more each time.
    revision: int | None = Field(default=None, ge=0, le=MAX_SEQUENCE)


class ApprovalOutcomeData(_Data):
    vm: VmIdentity
    event_id: str = Field(min_length=1, max_length=MAX_KEY_LENGTH)
    approval_id: str = Field(max_length=MAX_KEY_LENGTH)
    decided_by: str
    applied: bool
    #: A :class:`~schemas.RejectReason` value when ``applied`` is false.
    reason: str | None = None
    detail: str = ""
    dry_run: bool = False
    event: ScheduledEvent | None = None
    reply_to: ReplyAddress
    #: (1.1) The version of the event the approval named.
    event_version: str | None = Field(
        default=None, description="(1.1) The event version the approval named."
    )
    #: (1.1) True when this approval (or another one of this event) may have been applied before:
    #: the POST was repeated, which IMDS takes as a no-op.
    repeat: bool = False
    #: (1.1) Names the agent's state store: an approval handled again after the state was lost
    #: is a new happening (its outcome gets a new id).
    epoch: str | None = None


class AgentData(_Data):
    vm: VmIdentity
    agent_version: str
    reply_to: ReplyAddress
    #: ``agent.online`` only: the agent's settings, without secrets.
    settings: dict[str, Any] = Field(default_factory=dict)
    uptime_seconds: float = 0.0
    outbox_depth: int = 0
    #: ``agent.heartbeat`` and ``agent.offline``: the IMDS document the agent last saw.
    document_incarnation: int | None = None
    #: ``agent.offline`` only: why it stops (``SIGTERM``, ...).
    reason: str | None = None
    #: (1.1) Names this run of the agent (with ``time`` it makes the message's id).
    instance: str | None = None
    #: (1.2) The longest the agent stays quiet (seconds): it sends a heartbeat once this long
    #: went by without another message. Consumers count it live for
    #: :data:`LIVENESS_PER_HEARTBEAT` of these since they last heard from it, or for their own
    #: liveness timeout if that is longer; None (older agents): their own timeout alone.
    heartbeat_interval: float | None = Field(
        default=None,
        strict=True,  # a number: never a string or a boolean read as one
        gt=0,
        le=MAX_HEARTBEAT_INTERVAL,
        description="(1.2) The longest the agent stays quiet, in seconds: it sends a heartbeat "
        "once this long went by without another message. Consumers count the agent live for "
        f"{LIVENESS_PER_HEARTBEAT:g} of these since they last heard from it, or for their own "
        "liveness timeout if that is longer. Absent: their own timeout alone.",
    )


class HookOutcome(StrEnum):
    """How a local hook run ended."""

    OK = "ok"
    FAILED = "failed"
    TIMED_OUT = "timed-out"
    #: The command could not be started at all.
    NOT_STARTED = "not-started"
    #: The agent stopped (crash, kill -9, power loss) while the hook ran: its result is unknown.
    INTERRUPTED = "interrupted"


class HookResultData(_Data):
    vm: VmIdentity
    event: ScheduledEvent
    transition: str
    hook: str
    exit_code: int | None
    timed_out: bool
    duration_seconds: float
    #: The last lines of the hook's output, for a person reading the audit.
    output_tail: str = ""
    reply_to: ReplyAddress
    #: (1.1) How the run ended; absent in 1.0 messages (then read ``exit_code`` and ``timed_out``).
    outcome: str | None = None
    #: (1.1) The id of the transition message the hook ran for.
    transition_id: str | None = None
    #: (1.1) Which run of this hook for this transition (a run cut off by a crash may be repeated).
    attempt: int = Field(default=1, ge=1)

    @property
    def succeeded(self) -> bool:
        if self.outcome is not None:
            return self.outcome == HookOutcome.OK
        return self.exit_code == 0 and not self.timed_out


# ----------------------------------------------------------------------------------- envelopes


def _exists_in_utc(value: datetime) -> datetime:
    """A time that has a UTC equivalent (year 1 at +01:00 has none): the ledgers store UTC."""
    try:
        value.astimezone(UTC)
    except OverflowError as exc:
        raise ValueError(f"time {value.isoformat()} lies outside years 1 to 9999 in UTC") from exc
    return value


class _Envelope(BaseModel):
    """The CloudEvents 1.0 context attributes, plus the extensions ``sequence`` and
    ``schemaversion``."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)
    kinds: ClassVar[frozenset[MessageType]] = frozenset()
    schema_name: ClassVar[str] = ""

    specversion: Literal["1.0"]
    id: str = Field(min_length=1, max_length=MAX_KEY_LENGTH)
    source: str = Field(min_length=1)
    type: str
    #: The EventId of the event the message is about (None for the agent's own messages):
    #: what the audit files it under, checked against the data by :meth:`_about`.
    subject: str | None = Field(
        default=None,
        max_length=MAX_KEY_LENGTH,
        description="The EventId of the event the message is about (data.event.EventId, or "
        "data.event_id of an approval outcome); absent from the agent's own messages.",
    )
    time: AwareDatetime
    datacontenttype: Literal["application/json"] = "application/json"
    dataschema: str
    #: Per-agent counter that never goes backwards: a consumer can see gaps.
    sequence: int = Field(ge=0, le=MAX_SEQUENCE)
    schemaversion: str
    #: The bytes this message was decoded from (None for one built here).
    _received: bytes | None = PrivateAttr(default=None)

    @field_validator("time")
    @classmethod
    def _time_in_utc(cls, value: datetime) -> datetime:
        return _exists_in_utc(value)

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        # A string lookup: this runs for every message a consumer decodes.
        if _ENVELOPE_OF_TYPE.get(value) is not cls:
            raise ValueError(f"type {value!r} is not one of {sorted(k.value for k in cls.kinds)}")
        return value

    @field_validator("schemaversion")
    @classmethod
    def _readable_version(cls, value: str) -> str:
        return check_version(value)

    @model_validator(mode="after")
    def _about(self) -> Self:
        # The subject is the EventId the data is about: a message of one event filed under
        # another's would be that event's newest report to the audit (and to `approve --db`).
        if self.subject != self._subject_of_data():
            raise ValueError(
                f"subject {self.subject!r} is not the event the message is about "
                f"({self._subject_of_data()!r})"
            )
        return self

    def _subject_of_data(self) -> str | None:
        data = self.__dict__.get("data")
        event = getattr(data, "event", None)
        if isinstance(data, ApprovalOutcomeData):
            return data.event_id
        return event.event_id if isinstance(event, ScheduledEvent) else None

    @model_serializer(mode="wrap")
    def _no_null_attributes(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # CloudEvents: an optional attribute is absent, never null.
        data: dict[str, Any] = handler(self)
        if data.get("subject") is None:
            data.pop("subject", None)
        return data

    @property
    def kind(self) -> MessageType:
        kind = MessageType.from_cloudevents_type(self.type)
        assert kind is not None  # checked by the validator
        return kind

    @property
    def vm(self) -> VmIdentity:
        vm: VmIdentity = self.data.vm  # type: ignore[attr-defined]
        return vm

    @property
    def event_type(self) -> str | None:
        event = getattr(self.data, "event", None)  # type: ignore[attr-defined]
        return event.event_type if isinstance(event, ScheduledEvent) else None

    @property
    def routing_key(self) -> str:
        return routing_key(self.kind, self.event_type, self.vm.name)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @property
    def received_bytes(self) -> bytes | None:
        """The bytes :func:`decode` read, with every field of a newer minor version; None for a
        message built in this process."""
        return self._received

    def __eq__(self, other: object) -> bool:
        # The same message whether it was built here or decoded (the received bytes aside).
        if not isinstance(other, _Envelope):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash((type(self), self.id))

    def with_sequence(self, sequence: int) -> Self:
        return self.model_copy(update={"sequence": sequence})


class TransitionMessage(_Envelope):
    kinds = frozenset(k for k in MessageType if k.is_transition)
    schema_name = "transition"
    data: TransitionData

    @classmethod
    def build(
        cls,
        transition: Transition,
        *,
        vm: VmIdentity,
        reply_to: ReplyAddress,
        observed_at: datetime,
        sequence: int = 0,
    ) -> TransitionMessage:
        kind = MessageType(transition.kind.value)
        event = transition.event
        return cls(
            specversion="1.0",
            schemaversion=SCHEMA_VERSION,
            # The revision tells apart every point of the event's life, updates included.
            id=message_id(vm.source, event.event_id, kind.value, f"r{transition.revision}"),
            source=vm.source,
            type=kind.cloudevents_type,
            subject=event.event_id,
            time=observed_at,
            dataschema=dataschema_uri(cls.schema_name),
            sequence=sequence,
            data=TransitionData(
                vm=vm,
                event=event,
                previous_status=transition.previous_status,
                document_incarnation=transition.incarnation,
                reply_to=reply_to,
                event_version=event_version(event),
                revision=transition.revision,
            ),
        )


class ApprovalOutcomeMessage(_Envelope):
    kinds = frozenset({MessageType.APPROVAL_APPLIED, MessageType.APPROVAL_REJECTED})
    schema_name = "approval-outcome"
    data: ApprovalOutcomeData

    @classmethod
    def build(
        cls, data: ApprovalOutcomeData, *, observed_at: datetime, sequence: int = 0
    ) -> ApprovalOutcomeMessage:
        kind = MessageType.APPROVAL_APPLIED if data.applied else MessageType.APPROVAL_REJECTED
        return cls(
            specversion="1.0",
            schemaversion=SCHEMA_VERSION,
            id=_outcome_id(data, kind),
            source=data.vm.source,
            type=kind.cloudevents_type,
            subject=data.event_id,
            time=observed_at,
            dataschema=dataschema_uri(cls.schema_name),
            sequence=sequence,
            data=data,
        )


class AgentMessage(_Envelope):
    kinds = frozenset(k for k in MessageType if k.is_agent)
    schema_name = "agent"
    data: AgentData

    @classmethod
    def build(
        cls,
        kind: MessageType,
        data: AgentData,
        *,
        observed_at: datetime,
        instance: str,
        sequence: int = 0,
    ) -> AgentMessage:
        """``instance`` names this run of the agent; with ``observed_at`` it identifies the
        message, so a replay of the stored message keeps its id."""
        data = data.model_copy(update={"instance": instance})
        return cls(
            specversion="1.0",
            schemaversion=SCHEMA_VERSION,
            id=message_id(data.vm.source, kind.value, instance, observed_at.isoformat()),
            source=data.vm.source,
            type=kind.cloudevents_type,
            subject=None,
            time=observed_at,
            dataschema=dataschema_uri(cls.schema_name),
            sequence=sequence,
            data=data,
        )


class HookResultMessage(_Envelope):
    kinds = frozenset({MessageType.HOOK_COMPLETED})
    schema_name = "hook-result"
    data: HookResultData

    @classmethod
    def build(
        cls, data: HookResultData, *, observed_at: datetime, sequence: int = 0
    ) -> HookResultMessage:
        return cls(
            specversion="1.0",
            schemaversion=SCHEMA_VERSION,
            id=_hook_id(data),
            source=data.vm.source,
            type=MessageType.HOOK_COMPLETED.cloudevents_type,
            subject=data.event.event_id,
            time=observed_at,
            dataschema=dataschema_uri(cls.schema_name),
            sequence=sequence,
            data=data,
        )


#: Any one lifecycle message.
LifecycleMessage: TypeAlias = (
    TransitionMessage | ApprovalOutcomeMessage | AgentMessage | HookResultMessage
)

ENVELOPES: tuple[type[_Envelope], ...] = (
    TransitionMessage,
    ApprovalOutcomeMessage,
    AgentMessage,
    HookResultMessage,
)
_BY_KIND: dict[MessageType, type[_Envelope]] = {
    kind: envelope for envelope in ENVELOPES for kind in envelope.kinds
}


class NewerMessage(BaseModel):
    """A well-formed lifecycle message of a type this version does not know, in a major version
    it reads: a newer minor version added the type. Kept whole (``received_bytes``) for a
    consumer that records everything (the audit); the others skip it."""

    model_config = ConfigDict(frozen=True, extra="allow")

    specversion: Literal["1.0"]
    id: str = Field(min_length=1, max_length=MAX_KEY_LENGTH)
    source: str = Field(min_length=1)
    #: A type name as this project writes them (lower-case words joined by dots, dashes or
    #: underscores, at most 128 characters): anything else is no newer minor's, and refused.
    type: str = Field(max_length=128, pattern=r"^[a-z0-9]+(?:[._-][a-z0-9]+)*$")
    subject: str | None = Field(default=None, max_length=MAX_KEY_LENGTH)
    time: AwareDatetime
    sequence: int = Field(ge=0, le=MAX_SEQUENCE)
    schemaversion: str
    data: dict[str, Any] = Field(default_factory=dict)
    _received: bytes = PrivateAttr(default=b"")

    @field_validator("time")
    @classmethod
    def _time_in_utc(cls, value: datetime) -> datetime:
        return _exists_in_utc(value)

    @field_validator("schemaversion")
    @classmethod
    def _readable_version(cls, value: str) -> str:
        return check_version(value)

    @field_validator("type")
    @classmethod
    def _not_a_decision(cls, value: str) -> str:
        # The ledger's own records (an approver's decision, an operator's action) have kinds
        # ``decision.<action>``: a message of such a type would read as one in a history.
        if value.removeprefix(TYPE_PREFIX + ".").split(".")[0] == "decision":
            raise ValueError(f"type {value!r} names a decision: no message is one")
        return value

    @model_validator(mode="after")
    def _vm_name_is_a_key(self) -> Self:
        # The VM a consumer files it under (the data's vm.name, else the source) is a key of
        # the ledger, bounded like every VM name.
        if len(self.vm_name) > MAX_KEY_LENGTH:
            raise ValueError(f"the VM it names is longer than {MAX_KEY_LENGTH} characters")
        return self

    @property
    def kind_name(self) -> str:
        """The type without the project's prefix (``approval.expired``, say)."""
        return self.type.removeprefix(TYPE_PREFIX + ".")

    @property
    def vm_name(self) -> str:
        vm = self.data.get("vm")
        name = vm.get("name") if isinstance(vm, dict) else None
        return name if isinstance(name, str) and name else self.source

    @property
    def received_bytes(self) -> bytes:
        return self._received


def encode(message: LifecycleMessage) -> bytes:
    """The structured-mode JSON of a message (content type :data:`CLOUDEVENTS_CONTENT_TYPE`)."""
    return message.to_bytes()


#: The envelope of each CloudEvents ``type`` (its validator checks a message's type here).
_ENVELOPE_OF_TYPE: dict[str, type[_Envelope]] = {
    kind.cloudevents_type: envelope for kind, envelope in _BY_KIND.items()
}
# The type read off the bytes to pick the envelope for the one-pass parse (a hint only: the
# envelope validates the real top-level type, so a "type" elsewhere cannot fool it).
_TYPE = re.compile(rb'"type"\s*:\s*"([^"\\]{1,200})"')
_BY_TYPE: dict[bytes, type[_Envelope]] = {
    type_.encode(): envelope for type_, envelope in _ENVELOPE_OF_TYPE.items()
}
# U+0000 escaped in a JSON string (an odd number of backslashes before "u0000"): the character
# that no database text type stores. A raw NUL byte is not valid JSON in the first place.
_NUL = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


def _screen(raw: bytes | str) -> bytes:
    """The checks that come before any parsing; returns the bytes to parse."""
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    if len(data) > MAX_MESSAGE_BYTES:
        raise SchemaError(
            f"too large: {len(data)} bytes, the contract allows at most {MAX_MESSAGE_BYTES}"
        )
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SchemaError(f"not JSON: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    # The substring first: the pattern (a look-behind at every position) costs about 45 us on
    # a 1 KiB message, two thirds of a whole decode; the substring test about 1 us.
    if b"\\u0000" in data and _NUL.search(data):
        raise SchemaError("the character U+0000 is not allowed in a message")
    return data


def loads(raw: bytes | str) -> object:
    """JSON as the contract reads it: pydantic's parser (the one the one-pass path uses, so
    both paths agree), no NaN or Infinity, no lone surrogate, a bounded depth; the checks of
    :func:`decode` first. :class:`SchemaError` for anything else."""
    return parse_json(_screen(raw))


def parse_json(data: bytes) -> object:
    """The JSON parse itself, without :func:`loads`' screen (size, U+0000): pydantic's parser,
    no NaN or Infinity, no lone surrogate or bad UTF-8, a bounded depth; :class:`SchemaError`
    for anything else. For a caller that bounds its input otherwise (the agent's reader of the
    IMDS document)."""
    try:
        return pydantic_core.from_json(data, allow_inf_nan=False)
    except (ValueError, RecursionError) as exc:
        raise SchemaError(f"not JSON: {exc}") from exc


def decode(raw: bytes | str) -> LifecycleMessage:
    """Parse and validate one lifecycle message.

    Raises :class:`SchemaError` (too large, not JSON, not a CloudEvent, invalid),
    :class:`VersionMismatch` (another major version) or :class:`UnknownMessageType`; never
    anything else, whatever the input.
    """
    data = _screen(raw)
    match = _TYPE.search(data)
    envelope = _BY_TYPE.get(match.group(1)) if match is not None else None
    if envelope is not None:
        # The common case in one pass of pydantic's JSON parser. It checks everything the slow
        # path checks; on any failure the slow path decides what to say.
        try:
            fast = envelope.model_validate_json(data)
        except (ValueError, RecursionError):
            pass
        else:
            fast._received = data
            return fast  # type: ignore[return-value]
    return _decode_slowly(data)


def _decode_slowly(data: bytes) -> LifecycleMessage:
    parsed = loads(data)
    if not isinstance(parsed, dict):
        raise SchemaError("not a CloudEvent: the JSON is not an object")
    if parsed.get("specversion") != "1.0":
        raise SchemaError(
            f"not a CloudEvents 1.0 event (specversion={parsed.get('specversion')!r})"
        )
    check_version(parsed.get("schemaversion"))
    type_ = parsed.get("type")
    if not isinstance(type_, str):
        raise SchemaError("not a CloudEvent: no type")
    kind = MessageType.from_cloudevents_type(type_)
    if kind is None:
        raise UnknownMessageType(f"unknown message type {type_!r}")
    envelope = _BY_KIND[kind]
    try:
        message = envelope.model_validate(parsed)
    except (ValidationError, RecursionError) as exc:
        raise SchemaError(f"invalid {kind.value} message: {exc}") from exc
    message._received = data
    assert isinstance(message, LifecycleMessage)
    return message


def decode_newer(raw: bytes | str) -> NewerMessage:
    """A message :func:`decode` refused as :class:`UnknownMessageType`, read as a
    :class:`NewerMessage` when its type has our prefix; :class:`SchemaError` otherwise."""
    data = _screen(raw)
    parsed = loads(data)
    if not isinstance(parsed, dict) or not str(parsed.get("type", "")).startswith(
        TYPE_PREFIX + "."
    ):
        raise SchemaError("not a lifecycle message of this project")
    try:
        message = NewerMessage.model_validate(parsed)
    except (ValidationError, RecursionError) as exc:
        raise SchemaError(f"invalid message of a newer type: {exc}") from exc
    message._received = data
    return message
