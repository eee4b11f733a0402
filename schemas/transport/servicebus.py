"""The Azure Service Bus transport (azure-servicebus, async).

========================================  =================================================
lifecycle stream                          topic ``scheduled-events``; ``message_id`` = the
                                          CloudEvent id (duplicate detection drops repeats);
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
description. An :class:`AutoLockRenewer` keeps locks of long handlers (and the agent's session).

Facts of the SDK this design follows: every sender and receiver opens its own connection (a
namespace allows 5,000), so one sender per entity is kept and reused; Standard tier caps a
message at 256 KB; sessions need Standard or Premium; ``message_id`` is random unless set.

Service Bus entities are not created over AMQP: create the topic, its subscriptions and the
session-enabled queue beforehand (the README has the az CLI commands). A missing entity is a
:class:`~schemas.ConfigError` that says which one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from azure.servicebus import (
    ServiceBusMessage,
    ServiceBusReceivedMessage,
    ServiceBusSubQueue,
)
from azure.servicebus.aio import (
    AutoLockRenewer,
    ServiceBusClient,
    ServiceBusReceiver,
    ServiceBusSender,
)
from azure.servicebus.exceptions import (
    MessageSizeExceededError,
    MessagingEntityNotFoundError,
    ServiceBusAuthenticationError,
    ServiceBusAuthorizationError,
    ServiceBusError,
    SessionCannotBeLockedError,
)

from .._errors import ConfigError, PublishNotConfirmed, TransportError
from ..channels import DEFAULT_CHANNELS, ChannelNames, ReplyAddress
from ._base import AsyncResource, OutgoingMessage, PropertyValue
from .memory import DEAD_LETTER_DESCRIPTION, DEAD_LETTER_REASON


def redact(url: str) -> str:
    from . import redact as _redact

    return _redact(url)


__all__ = ["ServiceBusTransport"]

log = logging.getLogger(__name__)

#: Standard tier's cap on one message.
MAX_MESSAGE_BYTES = 256 * 1024
#: How long one receive call waits before the loop looks at ``close()`` again.
RECEIVE_WAIT_SECONDS = 1.0
#: How long the agent's session lock is renewed before the session is opened again.
SESSION_RENEWAL_SECONDS = 24 * 3600.0
#: A handler's message lock is renewed for at most this long.
MESSAGE_RENEWAL_SECONDS = 300.0
RECONNECT_MIN, RECONNECT_MAX = 0.5, 15.0
CLOSE_TIMEOUT = 10.0
#: How often a standby receiver asks for a session another receiver holds.
STANDBY_SECONDS = 1.0
#: The session id of every lifecycle message (see :meth:`ServiceBusTransport.publish`).
STREAM_SESSION = "scheduled-events"
CONNECT_TIMEOUT = 15.0
#: The SDK's own retries of one operation; above it the agent's outbox and the consumers'
#: receive loops retry for as long as it takes, so a short ladder here keeps failures visible.
_RETRY: dict[str, Any] = {"retry_total": 2, "retry_backoff_factor": 0.5, "retry_backoff_max": 4}


def _entity_error(exc: ServiceBusError, entity: str) -> RelayErrorLike:
    if isinstance(exc, MessagingEntityNotFoundError):
        return ConfigError(
            f"the Service Bus entity {entity!r} does not exist: create it first "
            "(see the README, 'Azure Service Bus')"
        )
    if isinstance(exc, ServiceBusAuthenticationError | ServiceBusAuthorizationError):
        return ConfigError(f"Service Bus refused access to {entity!r}: {exc}")
    return TransportError(f"Service Bus failed on {entity!r}: {exc}")


RelayErrorLike = ConfigError | TransportError


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _properties(message: ServiceBusReceivedMessage) -> dict[str, PropertyValue]:
    """Received application properties come back with ``bytes`` keys and string values."""
    out: dict[str, PropertyValue] = {}
    for key, value in (message.application_properties or {}).items():
        name = _text(key)
        if name in ("DeadLetterReason", "DeadLetterErrorDescription"):
            continue
        out[name] = value if isinstance(value, int | float | bool) else _text(value)
    if message.dead_letter_reason is not None:
        out[DEAD_LETTER_REASON] = message.dead_letter_reason
        out[DEAD_LETTER_DESCRIPTION] = message.dead_letter_error_description or ""
    return out


def _body(message: ServiceBusReceivedMessage) -> bytes:
    body: Any = message.body
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode()
    return b"".join(body)  # data sections


class _ServiceBusDelivery:
    def __init__(self, subscription: _ServiceBusSubscription, message: ServiceBusReceivedMessage):
        self._subscription = subscription
        self._message = message
        self.body = _body(message)
        self.message_id = _text(message.message_id or "")
        self.content_type = _text(message.content_type or "")
        self.routing_key = _text(message.subject or "")
        self.properties: Mapping[str, PropertyValue] = _properties(message)
        # The AMQP header counts earlier attempts: 0 on the first delivery, as the contract says.
        self.delivery_count = int(message.delivery_count or 0)

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


class _ServiceBusSubscription(AsyncResource):
    """A receiver loop that reopens its receiver after a failure (with jittered backoff)."""

    def __init__(
        self,
        open_receiver: Callable[[], ServiceBusReceiver],
        entity: str,
        *,
        prefetch: int,
    ) -> None:
        self._open_receiver = open_receiver
        self._entity = entity
        self._prefetch = max(1, prefetch)
        self._receiver: ServiceBusReceiver | None = None
        self._buffer: deque[_ServiceBusDelivery] = deque()
        self._unsettled: set[_ServiceBusDelivery] = set()
        self._closed = False
        self._lock = asyncio.Lock()
        self._failures = 0

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
        while not self._closed:
            if self._buffer:
                delivery = self._buffer.popleft()
                self._unsettled.add(delivery)
                return delivery
            async with self._lock:
                if self._closed:
                    break
                await self._receive_batch()
        raise StopAsyncIteration

    async def _receive_batch(self) -> None:
        try:
            if self._receiver is None:
                self._receiver = self._open_receiver()
                await self._receiver.__aenter__()
            batch = await self._receiver.receive_messages(
                max_message_count=self._prefetch, max_wait_time=RECEIVE_WAIT_SECONDS
            )
        except SessionCannotBeLockedError:
            # Another process holds the session: stand by, and take over soon after it goes.
            log.debug("the session on %s is held by another receiver; standing by", self._entity)
            await self._drop_receiver()
            await asyncio.sleep(STANDBY_SECONDS * random.uniform(0.8, 1.2))
            return
        except MessagingEntityNotFoundError as exc:
            await self._drop_receiver()
            raise _entity_error(exc, self._entity) from exc
        except ServiceBusError as exc:
            await self._backoff(f"receiving from {self._entity} failed", exc)
            return
        self._failures = 0
        self._buffer.extend(_ServiceBusDelivery(self, message) for message in batch)

    async def _backoff(self, what: str, exc: BaseException) -> None:
        self._failures += 1
        delay = min(RECONNECT_MAX, RECONNECT_MIN * 2 ** (self._failures - 1))
        delay *= random.uniform(0.8, 1.2)
        log.warning("%s (%s); opening the receiver again in %.1f s", what, exc, delay)
        await self._drop_receiver()
        await asyncio.sleep(delay)

    async def _drop_receiver(self) -> None:
        receiver, self._receiver = self._receiver, None
        self._buffer.clear()  # their locks went with the receiver: the broker redelivers them
        self._unsettled.clear()
        if receiver is not None:
            try:
                await asyncio.wait_for(receiver.close(), CLOSE_TIMEOUT)
            except (ServiceBusError, TimeoutError) as exc:
                log.debug("closing the receiver of %s failed: %s", self._entity, exc)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        async with self._lock:
            receiver = self._receiver
            pending = [*self._unsettled, *self._buffer]
            if receiver is not None:
                # Give unsettled messages back now rather than when their locks expire.
                for delivery in pending:
                    try:
                        await receiver.abandon_message(delivery._message)
                    except (ServiceBusError, ValueError) as exc:
                        log.debug("abandoning %s on close failed: %s", delivery.message_id, exc)
            await self._drop_receiver()


def _namespace(url: str) -> str:
    host = urlsplit(url.strip()).netloc or urlsplit(url.strip()).path
    if not host:
        raise ConfigError(f"Service Bus URL {url!r} names no namespace (sb://NAMESPACE)")
    return host if "." in host else f"{host}.servicebus.windows.net"


class ServiceBusTransport(AsyncResource):
    """The :class:`~schemas.transport.Transport` on Azure Service Bus.

    ``url`` is a connection string (``Endpoint=sb://...;SharedAccessKeyName=...;
    SharedAccessKey=...``, ``UseDevelopmentEmulator=true`` for the emulator) or
    ``sb://NAMESPACE`` to sign in with ``DefaultAzureCredential`` (a VM's managed identity).
    """

    name = "servicebus"

    def __init__(self, url: str, channels: ChannelNames = DEFAULT_CHANNELS) -> None:
        self.url = url.strip()
        self.channels = channels
        self._client: ServiceBusClient | None = None
        self._credential: Any = None
        self._senders: dict[str, ServiceBusSender] = {}
        self._sender_lock = asyncio.Lock()
        self._subscriptions: set[_ServiceBusSubscription] = set()
        self._renewer: AutoLockRenewer | None = None
        self._session_renewers: list[AutoLockRenewer] = []
        if not self.url.lower().startswith("endpoint="):
            self._namespace = _namespace(self.url)

    async def connect(self) -> None:
        if self._client is not None:
            return
        if self.url.lower().startswith("endpoint="):
            try:
                self._client = ServiceBusClient.from_connection_string(self.url, **_RETRY)
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
            self._client = ServiceBusClient(self._namespace, self._credential, **_RETRY)
        self._renewer = AutoLockRenewer(max_lock_renewal_duration=MESSAGE_RENEWAL_SECONDS)
        # Open the stream's sender now: a wrong address or key shows at start, not at the
        # first event, and the agent needs this one connection anyway.
        sender = await self._sender(self.channels.events_topic, topic=True)
        try:
            await asyncio.wait_for(sender.__aenter__(), CONNECT_TIMEOUT)
        except (ServiceBusError, TimeoutError, OSError) as exc:
            await self.close()
            raise TransportError(
                f"cannot reach Service Bus at {redact(self.url)}: {exc or type(exc).__name__}"
            ) from exc
        except ValueError as exc:
            await self.close()
            raise ConfigError(f"the Service Bus settings are not usable: {exc}") from exc

    async def close(self) -> None:
        for subscription in list(self._subscriptions):
            await subscription.close()
        self._subscriptions.clear()
        handlers: list[Any] = [*self._senders.values(), *self._session_renewers]
        self._session_renewers.clear()
        if self._renewer is not None:
            handlers.append(self._renewer)
        if self._client is not None:
            handlers.append(self._client)
        if self._credential is not None:
            handlers.append(self._credential)
        self._senders.clear()
        self._renewer, self._client, self._credential = None, None, None
        # Each handler's close waits for its keep-alive task: close them together.
        results = await asyncio.wait_for(
            asyncio.gather(*(h.close() for h in handlers), return_exceptions=True), CLOSE_TIMEOUT
        )
        for result in results:
            if isinstance(result, BaseException):
                log.debug("closing a Service Bus handler failed: %s", result)

    def _require(self) -> ServiceBusClient:
        if self._client is None:
            raise TransportError("the Service Bus transport is not connected (use `async with`)")
        return self._client

    def reply_address(self, vm: str) -> ReplyAddress:
        return ReplyAddress(channel=self.channels.approvals_queue, key=vm)

    async def _sender(self, entity: str, *, topic: bool) -> ServiceBusSender:
        client = self._require()
        async with self._sender_lock:
            sender = self._senders.get(entity)
            if sender is None:
                sender = (
                    client.get_topic_sender(entity) if topic else client.get_queue_sender(entity)
                )
                self._senders[entity] = sender
            return sender

    @staticmethod
    def _message(message: OutgoingMessage, *, session_id: str | None = None) -> ServiceBusMessage:
        if len(message.body) > MAX_MESSAGE_BYTES:
            raise PublishNotConfirmed(
                f"message {message.message_id} has {len(message.body)} bytes; Service Bus "
                f"Standard takes at most {MAX_MESSAGE_BYTES}"
            )
        # The SDK sends whole seconds (a TTL under 1 s would mean "never expires"): round up.
        ttl = (
            None
            if message.ttl_seconds is None
            else timedelta(seconds=max(1, math.ceil(message.ttl_seconds)))
        )
        return ServiceBusMessage(
            message.body,
            message_id=message.message_id,
            content_type=message.content_type,
            subject=message.routing_key or None,
            application_properties=dict(message.properties),  # type: ignore[arg-type]
            session_id=session_id,
            time_to_live=ttl,
        )

    async def _send(self, entity: str, message: ServiceBusMessage, *, topic: bool) -> None:
        sender = await self._sender(entity, topic=topic)
        try:
            await sender.send_messages(message)
        except MessageSizeExceededError as exc:
            raise PublishNotConfirmed(
                f"Service Bus refused message {message.message_id} as too large"
            ) from exc
        except ServiceBusError as exc:
            # A failed sender may hold a dead link: the next send opens a new one.
            self._senders.pop(entity, None)
            error = _entity_error(exc, entity)
            if isinstance(error, TransportError):
                raise PublishNotConfirmed(
                    f"Service Bus did not take message {message.message_id} on {entity!r}: {exc}"
                ) from exc
            raise error from exc

    async def publish(self, message: OutgoingMessage) -> None:
        # Every lifecycle message carries one session id: a plain subscription ignores it, a
        # session-enabled one hands the whole stream, in order, to one receiver at a time.
        message_ = self._message(message, session_id=STREAM_SESSION)
        await self._send(self.channels.events_topic, message_, topic=True)

    async def send_approval(self, to: ReplyAddress, message: OutgoingMessage) -> None:
        if to.channel != self.channels.approvals_queue:
            raise ConfigError(
                f"reply address {to} is not on this namespace's approvals queue "
                f"{self.channels.approvals_queue!r}"
            )
        session = to.key.casefold()
        await self._send(to.channel, self._message(message, session_id=session), topic=False)

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
        subscription = _ServiceBusSubscription(lambda: factory(client), entity, prefetch=prefetch)
        self._subscriptions.add(subscription)
        return subscription

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
            renewer = self._session_renewer()
            return self._open(
                lambda client: client.get_subscription_receiver(
                    topic, group, session_id=STREAM_SESSION, auto_lock_renewer=renewer
                ),
                f"{topic}/Subscriptions/{group} (session-enabled)",
                prefetch,
            )
        return self._open(
            lambda client: client.get_subscription_receiver(
                topic, group, auto_lock_renewer=self._renewer
            ),
            f"{topic}/Subscriptions/{group}",
            prefetch,
        )

    def _session_renewer(self) -> AutoLockRenewer:
        renewer = AutoLockRenewer(max_lock_renewal_duration=SESSION_RENEWAL_SECONDS)
        self._session_renewers.append(renewer)
        return renewer

    def approvals(self, vm: str, *, prefetch: int = 8) -> _ServiceBusSubscription:
        queue = self.channels.approvals_queue
        session_renewer = self._session_renewer()
        return self._open(
            lambda client: client.get_queue_receiver(
                queue,
                session_id=vm.casefold(),
                auto_lock_renewer=session_renewer,
            ),
            f"{queue} (session {vm.casefold()})",
            prefetch,
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
