"""The Azure Service Bus transport (azure-servicebus, async).

========================================  =================================================
lifecycle stream                          topic ``scheduled-events``; ``message_id`` = the
                                          CloudEvent id, with a digest of the sender's
                                          origin key when it signs (duplicate detection
                                          drops an agent's repeats, not a genuine message
                                          whose id a forger sent first);
                                          ``subject`` = the routing key; CloudEvents
                                          attributes as application properties
consumer group ``G``                      the topic's subscription ``G``; a group read by
                                          one consumer at a time, in order (``exclusive``),
                                          is a session-enabled subscription: every
                                          lifecycle message has the session id
                                          ``scheduled-events``
approvals                                 session-enabled queue ``scheduled-events-approvals``,
                                          ``session_id`` = the VM name (case-folded): each
                                          agent holds its own session, so it only ever
                                          receives its own approvals
========================================  =================================================

Settlement: ``ack`` completes, ``retry`` abandons (redelivered, delivery count + 1),
``dead_letter`` moves the message to the entity's dead-letter sub-queue with a reason and a
description. While a receiver is open, the transport renews the locks it holds: its session's
(the agent's approvals, an exclusive group's stream), or those of the messages it handed out and
that are not settled yet (a long handler's, for at most ``MESSAGE_RENEWAL_SECONDS``). It stops
renewing before it closes the receiver: the SDK's own ``AutoLockRenewer``, blind to a close,
renewed through a receiver being closed, and the SDK logged each such renewal as an unexpected
error with a traceback.

**What a client holds.** A namespace allows 5,000 concurrent AMQP connections and an entity
5,000 concurrent receive requests (an open receive link is one), and the SDK opens one
connection per sender and per receiver. So:

- a sender is opened by a send and closed ``sender_idle_timeout`` seconds after the last one;
  the next send opens a new one (about half a second: the SDK cannot reopen a closed sender).
  An agent that publishes a heartbeat a minute holds a connection about a tenth of the time;
- ``connect()`` opens the stream's sender, so a wrong address or key shows at start, and
  closes it at once;
- ``approvals(vm)`` holds one connection and one receive link while it is open, none after:
  the agent opens it only while it has an event to approve.

Options go in the connection string (``...;SharedAccessKey=KEY;sender_idle_timeout=10``) or in
the query of an ``sb://`` address (``sb://NAMESPACE?sender_idle_timeout=10``); the SDK never
sees them:

=========================  =====  ==========================================================
``sender_idle_timeout``    5 s    how long a sender stays open after its last send; 0 closes
                                  it after every send. Keep it well under the agent's
                                  heartbeat; a central service that sends all the time may
                                  set minutes
``connect_timeout``        15 s   opening a sender or a receiver: connection,
                                  authentication and link. An opening that timed
                                  out gives the next one twice as long (up to
                                  ``MAX_OPEN_TIMEOUT``); one that opened, twice what it
                                  took
``send_timeout``           10 s   the broker taking one message on an open sender
=========================  =====  ==========================================================

Application properties keep their types both ways. The SDK sends bytes values as text (it
decodes them as UTF-8) and receives text as bytes, so bytes values travel base64-encoded and
named in the property ``relay:binary`` (a JSON list), which the receiving side removes.

A message Service Bus will never take is :class:`~schemas.MessageRefused` (its sender sets it
aside rather than sending it again for ever): a body over Standard's 256 KiB (the contract's
cap; not sent on any tier); a whole message (body, properties and annotations) over the
entity's max message size, which Service Bus refuses as it arrives (Standard: 262,144 bytes;
the SDK's ``MessageSizeExceededError``); an id or a session id over 128 characters, which the
SDK refuses to build.

Other facts of the SDK this design follows: sessions need Standard or Premium; ``message_id``
is random unless set. Service Bus entities are not created over AMQP: create the topic, its
subscriptions and the session-enabled queue beforehand (the README has the az CLI commands). A
missing entity is a :class:`~schemas.ConfigError` that says which one.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import hashlib
import json
import logging
import math
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import certifi
from azure.servicebus import ServiceBusMessage, ServiceBusReceivedMessage, ServiceBusSubQueue
from azure.servicebus.aio import ServiceBusClient, ServiceBusReceiver, ServiceBusSender
from azure.servicebus.amqp import AmqpMessageBodyType
from azure.servicebus.exceptions import (
    MessageSizeExceededError,
    MessagingEntityNotFoundError,
    ServiceBusAuthenticationError,
    ServiceBusAuthorizationError,
    ServiceBusError,
    SessionCannotBeLockedError,
)

from .._backoff import Backoff, FailingSpell
from .._errors import ConfigError, MessageRefused, PublishNotConfirmed, TransportError
from ..channels import DEFAULT_CHANNELS, ChannelNames, ReplyAddress
from ..origin import KEY as ORIGIN_KEY
from . import redact
from ._base import AsyncResource, OutgoingMessage, PropertyValue
from .memory import DEAD_LETTER_DESCRIPTION, DEAD_LETTER_REASON, ORIGINAL_SENDER

__all__ = ["ServiceBusSettings", "ServiceBusTransport", "parse_servicebus_address"]

log = logging.getLogger(__name__)

#: Standard tier's cap on one message.
MAX_MESSAGE_BYTES = 256 * 1024
#: How long one receive call waits before the loop looks at ``close()`` again.
RECEIVE_WAIT_SECONDS = 1.0
#: A handler's message lock is renewed for at most this long (a session's, for as long as its
#: receiver is open).
MESSAGE_RENEWAL_SECONDS = 300.0
#: A lock is renewed once less than half of it is left, and at the latest this long before it
#: expires (the SDK's rule too: a renewal may take a few seconds on a busy link).
RENEW_BEFORE_SECONDS = 10.0
#: The longest pause between two looks at the locks a receiver holds.
RENEW_CHECK_SECONDS = 1.0
#: The longest one renewal is given.
RENEW_TIMEOUT_SECONDS = 10.0
RECONNECT_MIN, RECONNECT_MAX = 0.5, 15.0
#: A receiver that keeps failing is said once, then again every this long while it lasts.
FAILING_REMINDER_SECONDS = 300.0
CLOSE_TIMEOUT = 10.0
#: The longest an opening is given after openings timed out (see ``connect_timeout``).
MAX_OPEN_TIMEOUT = 120.0
#: How often a standby receiver asks for a session another receiver holds.
STANDBY_SECONDS = 1.0
#: The session id of every lifecycle message (see :meth:`ServiceBusTransport.publish`).
STREAM_SESSION = "scheduled-events"
#: The application property that names the properties sent as base64 (bytes values).
BINARY_PROPERTIES = "relay:binary"
#: The SDK's own retries of one operation; above it the agent's outbox and the consumers'
#: receive loops retry for as long as it takes, so a short ladder here keeps failures visible.
_RETRY: dict[str, Any] = {"retry_total": 2, "retry_backoff_factor": 0.5, "retry_backoff_max": 4}


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The one TLS context of this process, verifying as the SDK's own would (certifi's CA
    bundle, the server's certificate and name required). Left to itself the SDK builds a new
    context for every connection it opens, reading the CA bundle again (about 16 ms of CPU and
    0.7 MiB each), and the SDK opens a connection per sender and per receiver: once a minute
    on an idle agent (a heartbeat after the sender's idle close), and on every agent at once
    when a wave reaches them."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(certifi.where())
    return context


# ---- settings ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServiceBusSettings:
    """How the transport uses its namespace. Options in the address override these."""

    #: Seconds a sender stays open after its last send (0: closed after every send).
    sender_idle_timeout: float = 5.0
    #: Seconds to open a sender or a receiver (connection, authentication, link); the SDK
    #: alone would wait for ever on a silent link.
    connect_timeout: float = 15.0
    #: Seconds for the broker to take one message on an open sender.
    send_timeout: float = 10.0

    def __post_init__(self) -> None:
        idle = self.sender_idle_timeout
        if not (math.isfinite(idle) and idle >= 0):
            raise ConfigError(f"sender_idle_timeout must be 0 or more seconds, not {idle!r}")
        for name in ("connect_timeout", "send_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, not {value!r}")


_OPTIONS = frozenset(field.name for field in fields(ServiceBusSettings))


def parse_servicebus_address(
    address: str, base: ServiceBusSettings | None = None
) -> tuple[str, ServiceBusSettings]:
    """Split a connection string or ``sb://`` address into what the SDK gets and the settings.

    >>> address, settings = parse_servicebus_address("sb://contoso?sender_idle_timeout=2")
    >>> address, settings.sender_idle_timeout
    ('sb://contoso', 2.0)
    """
    text = address.strip()
    options: list[tuple[str, str]] = []
    if text.lower().startswith("endpoint="):
        # The SDK ignores keys it does not know: take ours out, leave the rest as it was.
        kept = []
        for part in text.split(";"):
            key, _, value = part.partition("=")
            if key.strip().lower() in _OPTIONS:
                options.append((key.strip().lower(), value.strip()))
            else:
                kept.append(part)
        text = ";".join(kept).rstrip(";")
    else:
        split = urlsplit(text)
        options = parse_qsl(split.query, keep_blank_values=True)
        text = split._replace(query="").geturl()
    changes: dict[str, float] = {}
    for key, value in options:
        if key not in _OPTIONS:
            known = ", ".join(sorted(_OPTIONS))
            raise ConfigError(f"unknown Service Bus option {key!r}; known options: {known}")
        try:
            changes[key] = float(value)
        except ValueError as exc:
            raise ConfigError(f"Service Bus option {key}={value!r} is not a number") from exc
    return text, replace(base or ServiceBusSettings(), **changes)


def _namespace(url: str) -> str:
    split = urlsplit(url.strip())
    host = split.netloc or split.path
    if not host:
        raise ConfigError(f"Service Bus URL {url!r} names no namespace (sb://NAMESPACE)")
    return host if "." in host else f"{host}.servicebus.windows.net"


# ---- messages ----------------------------------------------------------------------------------


def _entity_error(exc: ServiceBusError, entity: str) -> ConfigError | TransportError:
    if isinstance(exc, MessagingEntityNotFoundError):
        return ConfigError(
            f"the Service Bus entity {entity!r} does not exist: create it first "
            "(see the README, 'Azure Service Bus')"
        )
    if isinstance(exc, ServiceBusAuthenticationError | ServiceBusAuthorizationError):
        return ConfigError(f"Service Bus refused access to {entity!r}: {exc}")
    return TransportError(f"Service Bus failed on {entity!r}: {exc}")


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Take a background task's failure: whoever waited for it was told (a task whose waiter
    was cancelled would otherwise log "exception was never retrieved")."""
    if not task.cancelled():
        task.exception()


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _outgoing_properties(properties: Mapping[str, object]) -> dict[str | bytes, Any]:
    """Bytes values as base64 text, named in :data:`BINARY_PROPERTIES`."""
    out: dict[str | bytes, Any] = {}
    binary: list[str] = []
    for name, value in properties.items():
        if isinstance(value, bytes | bytearray):
            out[name] = base64.b64encode(value).decode("ascii")
            binary.append(name)
        else:
            out[name] = value
    if binary:
        out[BINARY_PROPERTIES] = json.dumps(binary)
    return out


def _binary_names(raw: Mapping[Any, Any]) -> set[str]:
    for key, value in raw.items():
        if _text(key) == BINARY_PROPERTIES:
            try:
                names = json.loads(_text(value))
            except ValueError:
                break
            if isinstance(names, list):
                return {str(name) for name in names}
    return set()


#: Where Service Bus says why it dead-lettered a message, and the contract's names for them.
_DEAD_LETTER_PROPERTIES = {
    "DeadLetterReason": DEAD_LETTER_REASON,
    "DeadLetterErrorDescription": DEAD_LETTER_DESCRIPTION,
}


def _received_properties(message: ServiceBusReceivedMessage) -> dict[str, PropertyValue]:
    """The SDK hands back keys and text values as ``bytes``: text again, except the values
    :func:`_outgoing_properties` sent as base64, which become bytes again."""
    raw: Mapping[Any, Any] = message.application_properties or {}
    binary = _binary_names(raw)
    out: dict[str, Any] = {}
    dead: dict[str, str] = {}
    for key, value in raw.items():
        name = _text(key)
        if name in (BINARY_PROPERTIES, ORIGINAL_SENDER):
            # Service Bus vouches for no sender: a property naming one is the publisher's word.
            continue
        if name in _DEAD_LETTER_PROPERTIES:
            # Read here, not with the SDK's dead_letter_reason, which raises on a value that
            # is not UTF-8 (a sender can set these on any message).
            dead[_DEAD_LETTER_PROPERTIES[name]] = _text(value)
            continue
        if name in binary:
            try:
                out[name] = base64.b64decode(_text(value), validate=True)
                continue
            except (binascii.Error, ValueError):
                log.debug("property %r is not the base64 it claims to be; kept as text", name)
        out[name] = value if isinstance(value, int | float | bool) else _text(value)
    if DEAD_LETTER_REASON in dead:
        out[DEAD_LETTER_REASON] = dead[DEAD_LETTER_REASON]
        out[DEAD_LETTER_DESCRIPTION] = dead.get(DEAD_LETTER_DESCRIPTION, "")
    return out


def _body(message: ServiceBusReceivedMessage) -> bytes:
    """The body's bytes: its data sections joined (or a text value, as UTF-8). Any other AMQP
    body (a value of another type, sequences), which a sender can choose, carries no message
    of the contract: it reads as empty, so a consumer dead-letters it, and Service Bus keeps
    the original in the dead-letter queue."""
    body: Any = message.body
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode(errors="replace")
    if message.body_type == AmqpMessageBodyType.DATA:
        return b"".join(body)  # data sections
    log.warning(
        "message %s has an AMQP %s body (%s), not data: read as empty",
        _text(message.message_id or "(no id)")[:200],
        str(message.body_type.value),
        type(body).__name__,
    )
    return b""


#: Between a message's id and its origin key's digest in the id Service Bus sees.
_ORIGIN_MARK = "~"


def _origin_digest(key: object) -> str | None:
    raw = key.encode() if isinstance(key, str) else key
    if not isinstance(raw, bytes) or not raw:
        return None
    return hashlib.sha256(raw).hexdigest()[:16]


def _broker_id(message: OutgoingMessage) -> str:
    """The id duplicate detection compares: the message's own, and for a signed message the
    digest of the signer's origin key. Lifecycle ids are predictable, so a forger holding a
    VM's credential could send its copy first and have the broker drop the genuine one (the
    consumers' origin check then rejects the copy, and nothing is left); with the key in the
    id, only the same signer's repeats collide."""
    digest = _origin_digest(message.properties.get(ORIGIN_KEY))
    return message.message_id if digest is None else f"{message.message_id}{_ORIGIN_MARK}{digest}"


def _message_id(broker_id: str, properties: Mapping[str, PropertyValue]) -> str:
    """The message's own id again (see :func:`_broker_id`)."""
    digest = _origin_digest(properties.get(ORIGIN_KEY))
    suffix = f"{_ORIGIN_MARK}{digest}"
    if digest is not None and broker_id.endswith(suffix):
        return broker_id[: -len(suffix)]
    return broker_id


def _outgoing(message: OutgoingMessage, *, session_id: str) -> ServiceBusMessage:
    """The SDK's message, or :class:`MessageRefused` for one Service Bus will never take: a
    body over Standard's cap (the contract's too), or a field the SDK refuses (an id or a
    session id over 128 characters: a VM name may have up to 200)."""
    if len(message.body) > MAX_MESSAGE_BYTES:
        raise MessageRefused(
            f"message {message.message_id} has {len(message.body)} bytes; Service Bus "
            f"Standard takes at most {MAX_MESSAGE_BYTES}: it is never sent"
        )
    # The SDK sends whole seconds (a TTL under 1 s would mean "never expires"): round up.
    ttl = (
        None
        if message.ttl_seconds is None
        else timedelta(seconds=max(1, math.ceil(message.ttl_seconds)))
    )
    try:
        return ServiceBusMessage(
            message.body,
            message_id=_broker_id(message),
            content_type=message.content_type,
            subject=message.routing_key or None,
            application_properties=_outgoing_properties(message.properties),
            session_id=session_id,
            time_to_live=ttl,
        )
    except ValueError as exc:
        raise MessageRefused(
            f"Service Bus will never take message {message.message_id} "
            f"(session id {session_id[:200]!r}): {exc}"
        ) from exc


# ---- sending -----------------------------------------------------------------------------------


class _OpenDeadline:
    """How long an opening (a sender's or a receiver's) is given: ``connect_timeout``, twice as
    long after each one that timed out (up to :data:`MAX_OPEN_TIMEOUT`), and once one opens,
    twice what it took (never less than ``connect_timeout``): a namespace that is slow now stays
    slow for a while. One per transport, shared by its senders and receivers, and kept when a
    failed start-up check closes them."""

    def __init__(self, base: float) -> None:
        self.base = base
        self.seconds = base

    def timed_out(self) -> float:
        self.seconds = min(2 * self.seconds, max(MAX_OPEN_TIMEOUT, self.base))
        return self.seconds

    def opened(self, took: float) -> None:
        self.seconds = max(self.base, min(2 * took, MAX_OPEN_TIMEOUT))

    async def bound(self, opening: Awaitable[object], what: str) -> None:
        """Await ``opening`` within the deadline, and learn from it: a :class:`TimeoutError`
        saying so (and what the next opening is given) if it took longer."""
        timeout = self.seconds
        began = time.monotonic()
        try:
            await asyncio.wait_for(opening, timeout)
        except TimeoutError as exc:
            raise TimeoutError(
                f"{what}: no answer within {timeout:g} s; the next opening is given "
                f"{self.timed_out():g} s"
            ) from exc
        self.opened(time.monotonic() - began)


class _Sender:
    """One entity's sender: opened by a send, closed ``sender_idle_timeout`` seconds after the
    last one.

    Facts of the SDK it follows: a closed sender cannot send again ("The handler has already
    been shutdown"), and the client holds no connection of its own, so each opening is a new
    :class:`ServiceBusSender`; and one sender must not run two operations at once (concurrent
    sends on an async sender fail: Azure/azure-sdk-for-python#36334), so its sends take turns.
    The idle timer starts when no send is running or waiting; a send cancels it. A sender whose
    send failed is closed and not used again (it may hold a dead link).

    An opening goes on when the send that began it is cancelled (a caller's own deadline, such as
    the outbox's publish timeout), bounded by ``connect_timeout``, and the next send waits for
    it. An opening that timed out gives the next one twice as long (:class:`_OpenDeadline`).
    When the namespace is
    slow to open links (thousands of agents connecting at once), any fixed deadline shorter
    than an opening would otherwise throw away every opening half done and begin the next one
    from nothing: no send would ever get through.
    """

    def __init__(
        self,
        make: Callable[[], ServiceBusSender],
        entity: str,
        settings: ServiceBusSettings,
        deadline: _OpenDeadline,
    ) -> None:
        self._make = make
        self.entity = entity
        self._settings = settings
        self._current: ServiceBusSender | None = None
        self._lock = asyncio.Lock()
        self._users = 0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._opening: asyncio.Task[None] | None = None
        self._deadline = deadline
        self._closing: set[asyncio.Task[None]] = set()

    async def check(self) -> None:
        """Connect, and let go at once unless a send is using the sender (the transport's
        start-up check: a wrong address or key shows now)."""
        await self._use(None)
        if not self._users:
            self._discard()

    async def send(self, message: ServiceBusMessage) -> None:
        await self._use(message)

    async def _use(self, message: ServiceBusMessage | None) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._users += 1
        try:
            async with self._lock:
                if self._current is None:
                    sender = self._current = self._make()
                    self._opening = asyncio.ensure_future(self._open(sender))
                    self._opening.add_done_callback(_retrieved)
                if (opening := self._opening) is not None:
                    # Shielded: a cancelled caller leaves it opening for the next send.
                    try:
                        await asyncio.shield(opening)
                    except asyncio.CancelledError:
                        task = asyncio.current_task()
                        if opening.cancelled() and task is not None and not task.cancelling():
                            # close() stopped the opening, not this send's caller
                            raise TransportError(
                                f"the sender to {self.entity} was closed while opening"
                            ) from None
                        raise
                sender = self._current
                if sender is None:  # closed meanwhile (the transport is closing)
                    raise TransportError(f"the sender to {self.entity} was closed")
                if message is not None:
                    try:
                        await self._bounded(
                            sender.send_messages(message), self._settings.send_timeout, "sending"
                        )
                    except BaseException:
                        self._discard()
                        raise
        finally:
            self._users -= 1
            self._idle_soon()

    async def _open(self, sender: ServiceBusSender) -> None:
        try:
            await self._deadline.bound(sender.__aenter__(), f"opening a sender to {self.entity}")
        except BaseException as exc:
            if self._current is sender:
                self._discard()
            if isinstance(exc, TimeoutError):
                log.info("%s", exc)  # its send may be gone (cancelled): said here
            raise
        finally:
            self._opening = None
        self._idle_soon()  # its send may be gone (cancelled): then the idle timer starts now

    def _idle_soon(self) -> None:
        """With no send running or waiting, close the open sender after the idle timeout."""
        if self._users or self._current is None or self._opening is not None:
            return
        if self._idle_timer is not None:
            return
        idle = self._settings.sender_idle_timeout
        if idle > 0:
            self._idle_timer = asyncio.get_running_loop().call_later(idle, self._discard)
        else:
            self._discard()

    async def _bounded(self, operation: Awaitable[object], seconds: float, what: str) -> None:
        try:
            await asyncio.wait_for(operation, seconds)
        except TimeoutError as exc:
            raise TimeoutError(f"{what} to {self.entity}: no answer within {seconds:g} s") from exc

    def _discard(self) -> None:
        """Close the current sender in the background; the next send opens a new one."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        sender, self._current = self._current, None
        if sender is None:
            return
        log.debug("closing the sender to %s", self.entity)
        task = asyncio.ensure_future(self._close_one(sender))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_one(self, sender: ServiceBusSender) -> None:
        try:
            await asyncio.wait_for(sender.close(), CLOSE_TIMEOUT)
        except (ServiceBusError, TimeoutError, OSError) as exc:
            log.debug("closing the sender to %s failed: %s", self.entity, exc)

    async def close(self) -> None:
        """Close it now, even under a running send or opening (which then fail)."""
        opening = self._opening
        if opening is not None:
            opening.cancel()
            await asyncio.gather(opening, return_exceptions=True)
        self._discard()
        await asyncio.gather(*self._closing, return_exceptions=True)


# ---- receiving ---------------------------------------------------------------------------------


class _ServiceBusDelivery:
    def __init__(self, subscription: _ServiceBusSubscription, message: ServiceBusReceivedMessage):
        self._subscription = subscription
        self._message = message
        #: When it was received (monotonic): its lock is renewed for MESSAGE_RENEWAL_SECONDS.
        self.received_at = time.monotonic()
        self.body = _body(message)
        self.properties: Mapping[str, PropertyValue] = _received_properties(message)
        self.message_id = _message_id(_text(message.message_id or ""), self.properties)
        self.content_type = _text(message.content_type or "")
        self.routing_key = _text(message.subject or "")
        # The AMQP header counts earlier attempts: 0 on the first delivery, as the contract says.
        self.delivery_count = int(message.delivery_count or 0)
        # Service Bus names no sender per message: lifecycle messages are signed instead.
        self.sender: str | None = None

    @property
    def message(self) -> ServiceBusReceivedMessage:
        return self._message

    async def ack(self) -> None:
        await self._settle(lambda r: r.complete_message(self._message))

    async def retry(self) -> None:
        await self._settle(lambda r: r.abandon_message(self._message))

    async def dead_letter(self, reason: str, description: str) -> None:
        await self._settle(
            lambda r: r.dead_letter_message(
                self._message, reason=reason[:4096], error_description=description[:4096]
            )
        )

    async def give_back(self, receiver: ServiceBusReceiver) -> None:
        """Abandon it as its subscription closes, rather than when its lock expires."""
        try:
            await receiver.abandon_message(self._message)
        except (ServiceBusError, ValueError) as exc:
            log.debug("abandoning %s on close failed: %s", self.message_id, exc)

    async def _settle(self, action: Callable[[ServiceBusReceiver], Awaitable[None]]) -> None:
        receiver = self._subscription.settling_receiver(self)
        try:
            await action(receiver)
        except ServiceBusError as exc:
            raise TransportError(
                f"could not settle message {self.message_id} (the broker delivers it again "
                f"after its lock expires): {exc}"
            ) from exc
        except ValueError as exc:  # MessageAlreadySettled
            raise TransportError(f"message {self.message_id} was settled already") from exc


class _LockKeeper:
    """Renews the locks an open receiver holds until :meth:`stop`, which its subscription calls
    before it closes the receiver, so that no renewal runs through a receiver being closed.

    A session receiver holds its session's lock (which covers its messages): renewed for as
    long as the receiver is open. Any other holds the lock of each message it received and that
    is not settled yet (``held``: handed out, or waiting in the subscription's buffer): renewed
    for at most ``MESSAGE_RENEWAL_SECONDS`` after the message arrived. A lock is renewed once
    less than half of it is left (at the latest ``RENEW_BEFORE_SECONDS`` before it expires),
    tried again at each look while that fails, and left to expire once it has: the next receive
    or settlement then fails and says so (the broker delivers the messages again), so a failed
    renewal is said at debug level."""

    def __init__(
        self,
        receiver: ServiceBusReceiver,
        entity: str,
        held: Callable[[], Iterable[_ServiceBusDelivery]],
    ) -> None:
        self._receiver = receiver
        self._entity = entity
        self._held = held
        #: How long each lock held had left when first seen (its length), by lock token.
        self._lengths: dict[str, float] = {}
        self._pause = RENEW_CHECK_SECONDS
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop renewing, a renewal under way included (cancelled inside the SDK, which then
        says nothing: the receiver is about to close anyway)."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._pause)
            self._pause = RENEW_CHECK_SECONDS  # shorter when a lock held now is short
            session = self._receiver.session
            if session is not None:
                if self._due("session", session.locked_until_utc):
                    await self._renew("the session lock", session.renew_lock)
                continue
            now = time.monotonic()
            held = [d for d in self._held() if now - d.received_at < MESSAGE_RENEWAL_SECONDS]
            tokens = {str(d.message.lock_token) for d in held}
            for token in self._lengths.keys() - tokens:
                del self._lengths[token]
            await asyncio.gather(
                *(
                    self._renew(
                        f"the lock of message {delivery.message_id}",
                        functools.partial(self._receiver.renew_message_lock, delivery.message),
                    )
                    for delivery in held
                    if self._due(
                        str(delivery.message.lock_token), delivery.message.locked_until_utc
                    )
                )
            )

    def _due(self, token: str, locked_until: datetime | None) -> bool:
        """Whether the lock ``token``, held until ``locked_until``, is to be renewed now: less
        than half of it left (at most RENEW_BEFORE_SECONDS), and not expired yet."""
        if locked_until is None:
            return False
        left = (locked_until - datetime.now(UTC)).total_seconds()
        if left <= 0:
            return False  # gone: the next receive or settlement says so
        length = self._lengths.setdefault(token, left)
        before = min(RENEW_BEFORE_SECONDS, length / 2)
        # Look often enough not to miss it (a test's lock of a second or two).
        self._pause = min(self._pause, max(0.05, before / 2))
        return left <= before

    async def _renew(self, what: str, renew: Callable[..., Awaitable[object]]) -> None:
        try:
            async with asyncio.timeout(RENEW_TIMEOUT_SECONDS):
                await renew(timeout=RENEW_TIMEOUT_SECONDS)
        except (ServiceBusError, TimeoutError, ValueError) as exc:
            log.debug(
                "renewing %s on %s failed (%s); tried again while it lasts",
                what,
                self._entity,
                exc or type(exc).__name__,
            )
        except Exception:
            # Not a failure the SDK means to raise: said, and tried again at the next look
            # (ended here, the keeper would let every lock of the receiver lapse unsaid).
            log.exception("renewing %s on %s failed unexpectedly", what, self._entity)


class _ServiceBusSubscription(AsyncResource):
    """A receiver loop: opens its receiver at the first ``anext``, opens it again after a
    failure (with backoff), and leaves its transport when closed."""

    def __init__(
        self,
        open_receiver: Callable[[], ServiceBusReceiver],
        entity: str,
        *,
        prefetch: int,
        deadline: _OpenDeadline,
        on_close: Callable[[_ServiceBusSubscription], None],
    ) -> None:
        self._open_receiver = open_receiver
        self._entity = entity
        self._prefetch = max(1, prefetch)
        self._deadline = deadline
        self._on_close = on_close
        self._receiver: ServiceBusReceiver | None = None
        #: Renews the locks of the open receiver.
        self._keeper: _LockKeeper | None = None
        self._buffer: deque[_ServiceBusDelivery] = deque()
        self._unsettled: set[_ServiceBusDelivery] = set()
        self._closed = asyncio.Event()
        self._lock = asyncio.Lock()
        self._backoff = Backoff(RECONNECT_MIN, RECONNECT_MAX)
        self._standby = Backoff(STANDBY_SECONDS, STANDBY_SECONDS)
        self._failing = FailingSpell(FAILING_REMINDER_SECONDS)

    def settling_receiver(self, delivery: _ServiceBusDelivery) -> ServiceBusReceiver:
        self._unsettled.discard(delivery)
        if self._receiver is None:
            raise TransportError(
                f"the receiver of message {delivery.message_id} is closed; the broker delivers "
                "it again after its lock expires"
            )
        return self._receiver

    def __aiter__(self) -> AsyncIterator[_ServiceBusDelivery]:
        return self

    async def __anext__(self) -> _ServiceBusDelivery:
        while not self._closed.is_set():
            if self._buffer:
                delivery = self._buffer.popleft()
                self._unsettled.add(delivery)
                return delivery
            async with self._lock:
                if self._closed.is_set():
                    break
                pause = await self._receive_batch()
            if pause:
                # Wait outside the lock, so close() need not wait for the pause.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closed.wait(), pause)
        raise StopAsyncIteration

    async def _receive_batch(self) -> float:
        """Fill the buffer; a pause in seconds before the next try when there was a failure."""
        try:
            if self._receiver is None:
                self._receiver = self._open_receiver()
                # The SDK alone would wait for ever on a silent link.
                await self._deadline.bound(self._receiver.__aenter__(), "opening the receiver")
                self._keeper = _LockKeeper(self._receiver, self._entity, self._held)
            batch = await self._receiver.receive_messages(
                max_message_count=self._prefetch, max_wait_time=RECEIVE_WAIT_SECONDS
            )
        except SessionCannotBeLockedError:
            # Another process holds the session: stand by, and take over soon after it goes.
            log.debug("the session on %s is held by another receiver; standing by", self._entity)
            await self._drop_receiver()
            return self._standby.next()
        except MessagingEntityNotFoundError as exc:
            await self._drop_receiver()
            raise _entity_error(exc, self._entity) from exc
        except (ServiceBusError, TimeoutError) as exc:
            delay = self._backoff.next()
            self._failed(str(exc) or type(exc).__name__, delay)
            await self._drop_receiver()
            return delay
        self._backoff.reset()
        lasted = self._failing.ended()
        if lasted is not None:
            log.info(
                "receiving from %s works again after %.0f s of failed tries", self._entity, lasted
            )
        self._buffer.extend(_ServiceBusDelivery(self, message) for message in batch)
        return 0.0

    def _failed(self, reason: str, delay: float) -> None:
        """Say a failed try: the first of a spell, then every :data:`FAILING_REMINDER_SECONDS`,
        as a warning; the tries between at debug level (each at most 15 s apart: a line for
        each, from every VM listening while its namespace is out of reach, flooded the logs)."""
        said = self._failing.failed()
        if said == "first":
            log.warning(
                "receiving from %s failed (%s); opening the receiver again in %.1f s, then less "
                "and less often (at most every %.0f s) for as long as it fails; said again when "
                "it is back",
                self._entity,
                reason,
                delay,
                RECONNECT_MAX,
            )
        elif said == "reminder":
            log.warning(
                "receiving from %s still fails after %.0f s (%s); trying again in %.1f s",
                self._entity,
                self._failing.lasted,
                reason,
                delay,
            )
        else:
            log.debug(
                "receiving from %s failed again (%s); trying again in %.1f s",
                self._entity,
                reason,
                delay,
            )

    def _held(self) -> list[_ServiceBusDelivery]:
        """The deliveries received and not settled: handed out, or waiting in the buffer."""
        return [*self._unsettled, *self._buffer]

    async def _drop_receiver(self) -> None:
        receiver, self._receiver = self._receiver, None
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            await keeper.stop()  # before the close: a renewal through it is the SDK's error
        self._buffer.clear()  # their locks went with the receiver: the broker redelivers them
        self._unsettled.clear()
        if receiver is not None:
            try:
                await asyncio.wait_for(receiver.close(), CLOSE_TIMEOUT)
            except (ServiceBusError, TimeoutError) as exc:
                log.debug("closing the receiver of %s failed: %s", self._entity, exc)

    async def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        async with self._lock:
            if self._receiver is not None:
                for delivery in [*self._unsettled, *self._buffer]:
                    await delivery.give_back(self._receiver)
            await self._drop_receiver()
        self._on_close(self)


# ---- the transport -----------------------------------------------------------------------------


class ServiceBusTransport(AsyncResource):
    """The :class:`~schemas.transport.Transport` on Azure Service Bus.

    ``url`` is a connection string (``Endpoint=sb://...;SharedAccessKeyName=...;
    SharedAccessKey=...``, ``UseDevelopmentEmulator=true`` for the emulator) or
    ``sb://NAMESPACE`` to sign in with ``DefaultAzureCredential`` (a VM's managed identity);
    either may carry the options in the module's docstring, which override ``settings``::

        async with ServiceBusTransport("sb://contoso?sender_idle_timeout=10") as transport:
            await transport.publish(message)
    """

    name = "servicebus"

    def __init__(
        self,
        url: str,
        channels: ChannelNames = DEFAULT_CHANNELS,
        *,
        settings: ServiceBusSettings | None = None,
    ) -> None:
        self.url = url.strip()
        self._address, self.settings = parse_servicebus_address(self.url, settings)
        self.channels = channels
        self._connection_string = self._address.lower().startswith("endpoint=")
        if not self._connection_string:
            self._namespace = _namespace(self._address)
        self._client: ServiceBusClient | None = None
        self._credential: Any = None
        self._senders: dict[str, _Sender] = {}
        self._open_deadline = _OpenDeadline(self.settings.connect_timeout)
        self._subscriptions: set[_ServiceBusSubscription] = set()

    async def connect(self) -> None:
        if self._client is not None:
            return
        if self._connection_string:
            try:
                self._client = ServiceBusClient.from_connection_string(
                    self._address, ssl_context=_tls_context(), **_RETRY
                )
            except ValueError as exc:
                raise ConfigError(f"the Service Bus connection string is not valid: {exc}") from exc
        else:
            try:
                from azure.identity.aio import DefaultAzureCredential
            except ImportError as exc:
                raise ConfigError(
                    "sb://NAMESPACE signs in with azure-identity: "
                    "pip install 'scheduled-events-relay[servicebus]'"
                ) from exc
            self._credential = DefaultAzureCredential()
            self._client = ServiceBusClient(
                self._namespace, self._credential, ssl_context=_tls_context(), **_RETRY
            )
        # The start-up check: a wrong address or key shows now, not at the first event. The
        # connection goes at once: the first publish opens its own.
        try:
            await self._sender(self.channels.events_topic).check()
        except (ServiceBusError, TimeoutError, OSError) as exc:
            await self.close()
            raise TransportError(
                f"cannot reach Service Bus at {redact(self.url)}: {exc or type(exc).__name__}"
            ) from exc
        except ValueError as exc:
            await self.close()
            raise ConfigError(f"the Service Bus settings are not usable: {exc}") from exc

    async def close(self) -> None:
        subscriptions, self._subscriptions = list(self._subscriptions), set()
        await asyncio.gather(*(subscription.close() for subscription in subscriptions))
        senders, self._senders = list(self._senders.values()), {}
        handlers: list[Any] = [self._client, self._credential]
        self._client = self._credential = None
        # Each SDK handler's close waits for its keep-alive task: close them together.
        closing = [s.close() for s in senders] + [h.close() for h in handlers if h is not None]
        results = await asyncio.wait_for(
            asyncio.gather(*closing, return_exceptions=True), CLOSE_TIMEOUT
        )
        for result in results:
            if isinstance(result, BaseException):
                log.debug("closing a Service Bus handler failed: %s", result)

    def _require(self) -> ServiceBusClient:
        if self._client is None:
            raise TransportError("the Service Bus transport is not connected (use `async with`)")
        return self._client

    @property
    def link_down_for(self) -> float | None:
        """None: the SDK opens a link per sender and receiver, and a receiver that loses its
        link ends its subscription with a TransportError (which the stream reports)."""
        return None

    def reply_address(self, vm: str) -> ReplyAddress:
        return ReplyAddress(channel=self.channels.approvals_queue, key=vm)

    def _sender(self, entity: str) -> _Sender:
        sender = self._senders.get(entity)
        if sender is None:
            client = self._require()
            make = (
                (lambda: client.get_topic_sender(entity))
                if entity == self.channels.events_topic
                else (lambda: client.get_queue_sender(entity))
            )
            sender = _Sender(make, entity, self.settings, self._open_deadline)
            self._senders[entity] = sender
        return sender

    async def _send(self, entity: str, outgoing: OutgoingMessage, *, session_id: str) -> None:
        message = _outgoing(outgoing, session_id=session_id)
        try:
            await self._sender(entity).send(message)
        except MessageSizeExceededError as exc:
            # Service Bus measures the whole message (body, properties, annotations) against
            # the entity's limit: a body under the cap can be over it with its properties (an
            # agent's signing properties are ~2 KB). Sent again, it is refused again.
            raise MessageRefused(
                f"Service Bus will never take message {outgoing.message_id} on {entity!r}: "
                f"its {len(outgoing.body)} bytes of body with its properties are over the "
                f"largest message the entity takes ({MAX_MESSAGE_BYTES} bytes on the Standard "
                f"tier; Service Bus says: {exc})"
            ) from exc
        except ServiceBusError as exc:
            error = _entity_error(exc, entity)
            if isinstance(error, TransportError):
                raise PublishNotConfirmed(
                    f"Service Bus did not take message {message.message_id} on {entity!r}: {exc}"
                ) from exc
            raise error from exc
        except TimeoutError as exc:
            raise PublishNotConfirmed(f"message {message.message_id} was not sent: {exc}") from exc
        except ValueError as exc:  # the SDK's "handler has already been shutdown": we closed
            raise PublishNotConfirmed(
                f"message {message.message_id} was not sent: the transport is closing"
            ) from exc

    async def publish(self, message: OutgoingMessage) -> None:
        # Every lifecycle message carries one session id: a plain subscription ignores it, a
        # session-enabled one hands the whole stream, in order, to one receiver at a time.
        self._require()
        await self._send(self.channels.events_topic, message, session_id=STREAM_SESSION)

    async def send_approval(self, to: ReplyAddress, message: OutgoingMessage) -> None:
        self._require()
        if to.channel != self.channels.approvals_queue:
            raise ConfigError(
                f"reply address {to} is not on this namespace's approvals queue "
                f"{self.channels.approvals_queue!r}"
            )
        await self._send(to.channel, message, session_id=to.key.casefold())

    async def declare_group(self, group: str, *, exclusive: bool | None = None) -> None:
        """Service Bus subscriptions are created by the operator (no AMQP call creates one):
        check that the group's subscription exists, so a missing one is found at start."""
        client = self._require()
        receiver = client.get_subscription_receiver(
            self.channels.events_topic, group, session_id=STREAM_SESSION if exclusive else None
        )
        entity = f"{self.channels.events_topic}/Subscriptions/{group}"
        try:
            async with receiver:
                # The link reports a missing entity at the first receive. A message taken by
                # this check goes straight back (its delivery count grows by one).
                for message in await receiver.receive_messages(
                    max_message_count=1, max_wait_time=0.5
                ):
                    await receiver.abandon_message(message)
        except SessionCannotBeLockedError:
            return  # it exists, and another consumer holds it
        except ServiceBusError as exc:
            raise _entity_error(exc, entity) from exc

    def _open(
        self, factory: Callable[[ServiceBusClient], ServiceBusReceiver], entity: str, prefetch: int
    ) -> _ServiceBusSubscription:
        client = self._require()
        subscription = _ServiceBusSubscription(
            lambda: factory(client),
            entity,
            prefetch=prefetch,
            deadline=self._open_deadline,
            on_close=self._forget,
        )
        self._subscriptions.add(subscription)
        return subscription

    def _forget(self, subscription: _ServiceBusSubscription) -> None:
        self._subscriptions.discard(subscription)

    def subscribe(
        self, group: str, *, prefetch: int = 64, exclusive: bool = False, transient: bool = False
    ) -> _ServiceBusSubscription:
        """``transient`` changes nothing here: a subscription cannot be created over AMQP, so
        a transient reader (``tail``) reads the subscription ``group``, which the operator
        creates with AutoDeleteOnIdle (e.g. ``az servicebus topic subscription create ...
        --name tail --auto-delete-on-idle PT5M``) so it does not collect messages forever."""
        topic = self.channels.events_topic
        if exclusive:
            # One active consumer at a time, in order: the session-enabled subscription's one
            # session is locked by one receiver; the others wait until it is free.
            return self._open(
                lambda client: client.get_subscription_receiver(
                    topic, group, session_id=STREAM_SESSION
                ),
                f"{topic}/Subscriptions/{group} (session-enabled)",
                prefetch,
            )
        return self._open(
            lambda client: client.get_subscription_receiver(topic, group),
            f"{topic}/Subscriptions/{group}",
            prefetch,
        )

    def approvals(self, vm: str, *, prefetch: int = 8) -> _ServiceBusSubscription:
        """The VM's session on the approvals queue: one connection and one receive link from
        the first ``anext`` until it is closed. Cheap to open and close for every event.

        Approvals are received one at a time, whatever ``prefetch`` says: a receive call that
        asks for more waits 0.2 s after the first message for the rest (the SDK's "further
        pull"), and an approval's round trip is what counts here."""
        queue, session = self.channels.approvals_queue, vm.casefold()
        return self._open(
            lambda client: client.get_queue_receiver(queue, session_id=session),
            f"{queue} (session {session})",
            1,
        )

    def dead_letters(self, group: str) -> _ServiceBusSubscription:
        topic = self.channels.events_topic
        return self._open(
            lambda client: client.get_subscription_receiver(
                topic, group, sub_queue=ServiceBusSubQueue.DEAD_LETTER
            ),
            f"{topic}/Subscriptions/{group}/$DeadLetterQueue",
            16,
        )
