"""The project's exception tree. Every error the relay raises derives from :class:`RelayError`.

::

    RelayError
    ├── SchemaError (ValueError)            a message or document does not match the contract
    │   └── VersionMismatch                 an unknown major schema version
    ├── ApprovalRejected                    an approval failed verification (``.reason``)
    ├── ConfigError (ValueError)            bad settings, bad key files, bad URLs
    ├── TransportError (ConnectionError)    the broker is unreachable or refused an operation
    │   └── PublishNotConfirmed             the broker did not confirm (nack, unroutable, timeout)
    │       └── MessageRefused              the broker will never take this message (too large)
    └── ImdsError                           IMDS answered with an error or not at all
        └── ImdsThrottled                   429: asked too often

Third-party errors (aio-pika, azure-servicebus, httpx, cryptography) are converted at the
boundary with ``raise ... from exc``; nothing above a transport catches a library's own types.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "ApprovalRejected",
    "ConfigError",
    "ImdsError",
    "ImdsThrottled",
    "MessageRefused",
    "PublishNotConfirmed",
    "RejectReason",
    "RelayError",
    "SchemaError",
    "TransportError",
    "VersionMismatch",
]


class RelayError(Exception):
    """The root of every error this project raises."""


class SchemaError(RelayError, ValueError):
    """A message, document or approval that does not match the contract."""


class VersionMismatch(SchemaError):
    """A message of a major schema version this code does not know."""

    def __init__(self, found: str, supported: str) -> None:
        super().__init__(
            f"schema version {found!r} is not supported: this code reads major version "
            f"{supported.split('.')[0]} (it writes {supported!r})"
        )
        self.found = found
        self.supported = supported


class ConfigError(RelayError, ValueError):
    """A setting, URL or key file that cannot be used; the message names it."""


class TransportError(RelayError, ConnectionError):
    """The broker could not be reached, or refused an operation."""


class PublishNotConfirmed(TransportError):
    """The broker did not confirm a message (negative ack, unroutable, or no answer in time)."""


class MessageRefused(PublishNotConfirmed):
    """The broker will never take this message, however often it is sent (over its size
    limit, say): the sender sets it aside instead of trying again."""


class ImdsError(RelayError):
    """IMDS answered with an error, with garbage, or not at all. Never an empty event list."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        kind: str = "error",
        unanswered: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        #: The request went out and no answer came back (a timeout, a connection lost after
        #: sending): IMDS may have acted on it. A POST StartRequests so failed may have started
        #: the event.
        self.unanswered = unanswered


class ImdsThrottled(ImdsError):
    """IMDS answered 429: this VM asked more often than the service allows."""


class RejectReason(StrEnum):
    """Why an approval was not applied. Each reason is reported as such in ``approval.rejected``."""

    MISSING_SIGNATURE = "missing-signature"
    BAD_SIGNATURE = "bad-signature"
    UNKNOWN_KEY = "unknown-key"
    EXPIRED = "expired"
    NOT_FOR_THIS_VM = "not-for-this-vm"
    MALFORMED = "malformed"
    EVENT_NOT_FOUND = "event-not-found"
    EVENT_NOT_SCHEDULED = "event-not-scheduled"
    #: (1.1) The live event is not the version the approval was decided on.
    EVENT_CHANGED = "event-changed"
    #: (1.1) The approval names no event version (a 1.0 approver sent it).
    UNBOUND = "unbound"
    OBSERVE_ONLY = "observe-only"
    IMDS_REFUSED = "imds-refused"


class ApprovalRejected(RelayError):
    """An approval that must not be applied; ``reason`` says why, ``detail`` explains."""

    def __init__(self, reason: RejectReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
