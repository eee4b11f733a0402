"""The lifecycle messages: CloudEvents 1.0, structured JSON mode.

Every message an agent publishes is one of four envelopes, chosen by its ``type``:

- :class:`TransitionMessage`: ``scheduled``, ``started``, ``updated``, ``completed``, ``canceled``
- :class:`ApprovalOutcomeMessage`: ``approval.applied``, ``approval.rejected``
- :class:`AgentMessage`: ``agent.online``, ``agent.heartbeat``, ``agent.offline``
- :class:`HookResultMessage`: ``hook.completed`` (a local hook ran on a transition)

Ids are deterministic: the same transition of the same event on the same VM always gets the same
id, across agent restarts, so consumers and Service Bus duplicate detection drop repeats.

>>> message = decode(raw_bytes)            # doctest: +SKIP
>>> message.kind, message.data.vm.name     # doctest: +SKIP
(<MessageType.STARTED: 'started'>, 'web-7')
"""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import datetime
from typing import Any, ClassVar, Literal, Self, TypeAlias

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
)

from ._errors import SchemaError
from .channels import MessageType, ReplyAddress, routing_key
from .identity import VmIdentity
from .imds import ScheduledEvent
from .transitions import Transition
from .versioning import SCHEMA_VERSION, check_version

__all__ = [
    "CLOUDEVENTS_CONTENT_TYPE",
    "AgentData",
    "AgentMessage",
    "ApprovalOutcomeData",
    "ApprovalOutcomeMessage",
    "HookResultData",
    "HookResultMessage",
    "LifecycleMessage",
    "TransitionData",
    "TransitionMessage",
    "UnknownMessageType",
    "decode",
    "encode",
    "message_id",
]

#: The content type of a structured-mode CloudEvent (CloudEvents AMQP binding).
CLOUDEVENTS_CONTENT_TYPE = "application/cloudevents+json"

_ID_NAMESPACE = uuid.UUID("5c1d7a3e-94a4-4b0e-8f35-3a7d0c2b9e61")


class UnknownMessageType(SchemaError):
    """A well-formed CloudEvent whose ``type`` this code does not know (maybe a newer minor)."""


def message_id(*parts: str) -> str:
    """A deterministic UUID from the parts that identify one happening."""
    return str(uuid.uuid5(_ID_NAMESPACE, "\x1f".join(parts)))


def dataschema_uri(name: str) -> str:
    return f"https://scheduled-events-relay.github.io/schemas/{SCHEMA_VERSION}/{name}.json"


# ---------------------------------------------------------------------------------------- data


class _Data(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class TransitionData(_Data):
    vm: VmIdentity
    #: The event exactly as IMDS gave it (IMDS field names); for ``completed`` and
    #: ``canceled`` the last version seen before it disappeared.
    event: ScheduledEvent
    previous_status: str | None
    document_incarnation: int
    reply_to: ReplyAddress


class ApprovalOutcomeData(_Data):
    vm: VmIdentity
    event_id: str
    approval_id: str
    decided_by: str
    applied: bool
    #: A :class:`~schemas.RejectReason` value when ``applied`` is false.
    reason: str | None = None
    detail: str = ""
    dry_run: bool = False
    event: ScheduledEvent | None = None
    reply_to: ReplyAddress


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

    @property
    def succeeded(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


# ----------------------------------------------------------------------------------- envelopes


class _Envelope(BaseModel):
    """The CloudEvents 1.0 context attributes, plus the extensions ``sequence`` and
    ``schemaversion``."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    kinds: ClassVar[frozenset[MessageType]] = frozenset()
    schema_name: ClassVar[str] = ""

    specversion: Literal["1.0"] = "1.0"
    id: str = Field(min_length=1)
    source: str = Field(min_length=1)
    type: str
    subject: str | None = None
    time: AwareDatetime
    datacontenttype: Literal["application/json"] = "application/json"
    dataschema: str
    #: Per-agent counter that never goes backwards: a consumer can see gaps.
    sequence: int = Field(ge=0)
    schemaversion: str = SCHEMA_VERSION

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        kind = MessageType.from_cloudevents_type(value)
        if kind is None or kind not in cls.kinds:
            raise ValueError(f"type {value!r} is not one of {sorted(k.value for k in cls.kinds)}")
        return value

    @field_validator("schemaversion")
    @classmethod
    def _readable_version(cls, value: str) -> str:
        return check_version(value)

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
        parts = [vm.source, event.event_id, kind.value]
        if kind is MessageType.UPDATED:
            # Several updates of one event are distinct happenings: the content tells them apart.
            parts.append(_fingerprint(event.to_imds()))
        return cls(
            id=message_id(*parts),
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
            id=message_id(data.vm.source, data.approval_id, kind.value),
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
        return cls(
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
            id=message_id(
                data.vm.source,
                data.event.event_id,
                MessageType.HOOK_COMPLETED.value,
                data.transition,
                data.hook,
            ),
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


def _fingerprint(value: object) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def encode(message: LifecycleMessage) -> bytes:
    """The structured-mode JSON of a message (content type :data:`CLOUDEVENTS_CONTENT_TYPE`)."""
    return message.to_bytes()


def decode(raw: bytes | str) -> LifecycleMessage:
    """Parse and validate one lifecycle message.

    Raises :class:`SchemaError` (not JSON, not a CloudEvent, invalid), :class:`VersionMismatch`
    (another major version) or :class:`UnknownMessageType`.
    """
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SchemaError(f"not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise SchemaError("not a CloudEvent: the JSON is not an object")
    if data.get("specversion") != "1.0":
        raise SchemaError(f"not a CloudEvents 1.0 event (specversion={data.get('specversion')!r})")
    check_version(data.get("schemaversion"))
    type_ = data.get("type")
    if not isinstance(type_, str):
        raise SchemaError("not a CloudEvent: no type")
    kind = MessageType.from_cloudevents_type(type_)
    if kind is None:
        raise UnknownMessageType(f"unknown message type {type_!r}")
    envelope = _BY_KIND[kind]
    try:
        message = envelope.model_validate(data)
    except ValidationError as exc:
        raise SchemaError(f"invalid {kind.value} message: {exc}") from exc
    assert isinstance(message, LifecycleMessage)
    return message
