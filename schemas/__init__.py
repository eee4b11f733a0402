"""The contract between the VM agents and the central services.

- :mod:`schemas.imds`: the IMDS Scheduled Events document, every API version.
- :mod:`schemas.transitions`: what changed between two documents (one pure function).
- :mod:`schemas.fingerprints`: content digests and the event version an approval is bound to.
- :mod:`schemas.messages`: the lifecycle messages (CloudEvents 1.0, structured JSON).
- :mod:`schemas.approvals`: signed approvals, central service -> one VM.
- :mod:`schemas.channels`: the channels on RabbitMQ and Service Bus.
- :mod:`schemas.transport`: the transport interface and its implementations.
"""

from ._errors import (
    ApprovalRejected,
    ConfigError,
    ImdsError,
    ImdsThrottled,
    MessageRefused,
    PublishNotConfirmed,
    RejectReason,
    RelayError,
    SchemaError,
    TransportError,
    VersionMismatch,
)
from .approvals import (
    Approval,
    check_lifetime,
    key_id,
    load_public_keys,
    load_signing_key,
    new_approval,
    sign,
    verify,
)
from .channels import (
    DEFAULT_CHANNELS,
    TYPE_PREFIX,
    ChannelNames,
    MessageType,
    ReplyAddress,
    routing_key,
    vm_word,
)
from .fingerprints import content_fingerprint, event_version
from .identity import MAX_KEY_LENGTH, VmIdentity
from .imds import (
    API_VERSIONS,
    DEFAULT_API_VERSION,
    EventSource,
    EventStatus,
    EventType,
    ScheduledEvent,
    ScheduledEventsDocument,
)
from .messages import (
    CLOUDEVENTS_CONTENT_TYPE,
    LIVENESS_PER_HEARTBEAT,
    MAX_HEARTBEAT_INTERVAL,
    AgentData,
    AgentMessage,
    ApprovalOutcomeData,
    ApprovalOutcomeMessage,
    HookOutcome,
    HookResultData,
    HookResultMessage,
    LifecycleMessage,
    NewerMessage,
    TransitionData,
    TransitionMessage,
    UnknownMessageType,
    decode,
    decode_newer,
)
from .transitions import Transition, TransitionKind, diff, revisions_after
from .versioning import SCHEMA_VERSION, check_version

__all__ = [
    "API_VERSIONS",
    "CLOUDEVENTS_CONTENT_TYPE",
    "DEFAULT_API_VERSION",
    "DEFAULT_CHANNELS",
    "LIVENESS_PER_HEARTBEAT",
    "MAX_HEARTBEAT_INTERVAL",
    "MAX_KEY_LENGTH",
    "SCHEMA_VERSION",
    "TYPE_PREFIX",
    "AgentData",
    "AgentMessage",
    "Approval",
    "ApprovalOutcomeData",
    "ApprovalOutcomeMessage",
    "ApprovalRejected",
    "ChannelNames",
    "ConfigError",
    "EventSource",
    "EventStatus",
    "EventType",
    "HookOutcome",
    "HookResultData",
    "HookResultMessage",
    "ImdsError",
    "ImdsThrottled",
    "LifecycleMessage",
    "MessageRefused",
    "MessageType",
    "NewerMessage",
    "PublishNotConfirmed",
    "RejectReason",
    "RelayError",
    "ReplyAddress",
    "ScheduledEvent",
    "ScheduledEventsDocument",
    "SchemaError",
    "Transition",
    "TransitionData",
    "TransitionKind",
    "TransitionMessage",
    "TransportError",
    "UnknownMessageType",
    "VersionMismatch",
    "VmIdentity",
    "check_lifetime",
    "check_version",
    "content_fingerprint",
    "decode",
    "decode_newer",
    "diff",
    "event_version",
    "key_id",
    "load_public_keys",
    "load_signing_key",
    "new_approval",
    "revisions_after",
    "routing_key",
    "sign",
    "verify",
    "vm_word",
]
