"""The RabbitMQ transport (aio-pika): confirmed, persistent, and patient with a flaky link.

Topology (declared idempotently, durable; names from :class:`~schemas.ChannelNames`)::

    events_exchange      topic   lifecycle messages, routing key <type>.<EventType>.<vm>
      │                          (alternate-exchange -> unrouted)
      ├─ group_prefix+G          quorum queue per consumer group, bound with "#"
      │  (x-dead-letter-exchange -> group_prefix+G.dead-letter, x-delivery-limit)
      └─ group_prefix+G.transient.<id>   a transient subscription's own queue (classic,
                                         exclusive, auto-delete): gone when it closes
    group_prefix+G.dead-letter   fanout exchange + quorum queue: the group's dead letters
    unrouted             fanout  the events exchange's alternate exchange
      └─ unrouted                quorum queue: what was published while no queue was bound
         (x-dead-letter-exchange -> events_exchange, at-least-once, reject-publish)
    approvals_exchange   topic   approvals, routing key = the VM's word (vm_word: lower case,
      │                          dots as "_"), as the last word of its lifecycle keys
      └─ vm_prefix+word          the VM's queue (classic, x-message-ttl = approval_ttl), bound
                                 with its own word: a VM's broker user may bind only that one
                                 (a topic permission), so it can never read another's approvals

Every party declares all of it the same way, so whoever comes first creates it; with the URL
option ``declare=passive`` (a least-privilege agent, whose user may configure only its own
queue) the shared exchanges are only checked, and the central services create them.

Nothing is lost while nobody listens: a lifecycle message published before any consumer group
exists goes to the alternate exchange and waits in the ``unrouted`` queue. Declaring a group
(:meth:`declare_group`, and the declaration :meth:`subscribe` makes) then drains that queue into
the stream without republishing anything: it rejects each message there, and the broker
dead-letters it into the events exchange with its routing key and properties unchanged (the
publisher's validated ``user_id`` included, which no consumer could forge on a copy), where the
group's queue now takes it. An events exchange declared by an older version, without the
argument, is used as it is; :attr:`RabbitMQTransport.catch_all_problem` then says how to fix it.

Publishing uses publisher confirms with ``mandatory``: :meth:`publish` returns once the broker
confirmed, and raises :class:`PublishNotConfirmed` when the broker refused that message: a nack,
an unroutable message, a ``user_id`` that is not the login's, a routing key the user's topic
permissions forbid (the broker closes the channel, which reopens for the next message), or no
confirm in ``confirm_timeout``; :class:`MessageRefused` for a message over the broker's
``max_message_size``, which it will never take. A refusal closes the channel, and every publish
still waiting there for its confirm fails with it: it is raised only for the message the
broker's words are about (its routing key, size or ``user_id``); the others are published again
on the reopened channel. An approval to a VM whose agent never
declared its queue is unroutable, so its sender learns it (the sender does not create queues
for VMs).

While the link is down, the robust connection reconnects every ``reconnect_interval`` at
first, less often the longer the link stays down (an eighth of the time it has been down, at
most ``reconnect_max_interval``; jittered: a fleet does not storm a broker that restarts);
``publish`` waits up to ``reconnect_timeout`` for it and then raises
:class:`TransportError`, so the caller keeps the message (outbox) and tries later. A publish
cut off before its confirm is sent again after the reconnect: at-least-once, and message ids
are deterministic so consumers drop the duplicate. Consumers resume by themselves.

::

    async with RabbitMQTransport("amqp://guest:guest@127.0.0.1/?confirm_timeout=5") as t:
        await t.publish(lifecycle_message(msg))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from typing import Any, cast

import aio_pika
import aio_pika.abc
import aiormq.exceptions
from yarl import URL

from .._backoff import Backoff
from .._errors import ConfigError, PublishNotConfirmed, TransportError
from ..channels import DEFAULT_CHANNELS, ChannelNames, ReplyAddress, vm_word
from . import redact
from ._amqp_catch_all import (
    ALTERNATE_EXCHANGE,
    declare_catch_all,
    drain,
    events_exchange_arguments,
    missing_catch_all,
)
from ._amqp_connection import RelayConnection, connect_error, login
from ._amqp_consume import AmqpSubscription
from ._amqp_errors import (
    FAILURES,
    MESSAGE_REFUSALS,
    REFUSALS,
    config_error,
    initialized,
    is_spurious_cancel,
    lost_if_closed,
    reason,
    refused,
    refuses,
    unabandoned,
    uninterrupted,
)
from ._amqp_settings import AmqpSettings, parse_amqp_url
from ._base import AsyncResource, OutgoingMessage
from .memory import TRANSIENT_INFIX

__all__ = ["AmqpSettings", "RabbitMQTransport"]

log = logging.getLogger(__name__)

_DEAD_LETTER_SUFFIX = ".dead-letter"
_QUORUM = {"x-queue-type": "quorum"}
_CLOSE_TIMEOUT = 5.0
#: The pause between publish attempts while the link is down: 50 ms, doubling up to 1 s.
_RETRY_PAUSE = (0.05, 1.0)


class RabbitMQTransport(AsyncResource):
    """The :class:`~schemas.transport.Transport` over RabbitMQ (``amqp://`` / ``amqps://``)."""

    name = "rabbitmq"

    def __init__(
        self,
        url: str,
        channels: ChannelNames = DEFAULT_CHANNELS,
        *,
        settings: AmqpSettings | None = None,
    ) -> None:
        self._url, self.settings = parse_amqp_url(url, settings)
        self.display_url = redact(url)
        self.channels = channels
        self._connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._channel: aio_pika.abc.AbstractRobustChannel | None = None
        self._subscriptions: set[AmqpSubscription] = set()
        self._closing = False
        self._lost_at: float | None = None
        #: Why messages published while no group is bound are not kept (an events exchange
        #: declared without the alternate exchange by an older version), with the fix; None
        #: when the exchange has it. Only a policy could give it one then, which a client
        #: cannot see: an unroutable message says so again.
        self.catch_all_problem: ConfigError | None = None

    # -- connection ---------------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect, declare the exchanges and the catch-all, open the publishing channel.

        Raises :class:`TransportError` when the broker cannot be reached within
        ``connect_timeout`` or refuses the login or the vhost (one line saying which),
        :class:`ConfigError` when an exchange exists with another type. An events exchange
        without the alternate exchange (an older version's) is used as it is, with a warning
        and :attr:`catch_all_problem`.
        """
        if self._connection is not None:
            return
        self._closing = False
        settings = self.settings
        log.debug("connecting to RabbitMQ %s as %r", self.display_url, settings.connection_name)
        connection = RelayConnection(
            URL(self._url),
            reconnect_interval=settings.reconnect_interval,
            client_properties={"connection_name": settings.connection_name},
        )
        connection.max_reconnect_interval = settings.reconnect_max_interval
        try:
            async with asyncio.timeout(settings.connect_timeout + 1):
                await connection.connect(timeout=settings.connect_timeout)
        except FAILURES as exc:
            await self._close_quietly(connection)
            raise connect_error(exc, self._url, self.display_url) from exc
        except BaseException:
            await self._close_quietly(connection)
            raise
        connection.close_callbacks.add(self._on_link_lost)
        connection.reconnect_callbacks.add(self._on_link_restored)
        self._connection = connection
        try:
            await self._declare_topology()
            channel = connection.channel(publisher_confirms=True, on_return_raises=True)
            await initialized(channel, settings.connect_timeout)
            async with asyncio.timeout(settings.connect_timeout):
                # Declared on the robust channel too, so a reconnect re-declares them.
                await self._declare_exchanges(channel)
        except BaseException as exc:
            await self.close()
            if isinstance(exc, FAILURES):
                raise TransportError(
                    f"RabbitMQ at {self.display_url}: opening the publishing channel failed: "
                    f"{reason(exc)}"
                ) from exc
            raise
        self._channel = channel
        log.info("connected to RabbitMQ %s as %r", self.display_url, settings.connection_name)

    async def _declare_exchanges(
        self, channel: aio_pika.abc.AbstractChannel
    ) -> list[aio_pika.abc.AbstractExchange]:
        """The two exchanges, as every party declares them; an events exchange an older
        version declared without the alternate exchange is taken as it is (passively)."""
        events = self.channels.events_exchange
        if self._passive:
            return [
                await channel.declare_exchange(events, passive=True),
                await channel.declare_exchange(self.channels.approvals_exchange, passive=True),
            ]
        if self.catch_all_problem is None:
            try:
                exchange = await channel.declare_exchange(
                    events,
                    aio_pika.ExchangeType.TOPIC,
                    durable=True,
                    arguments=events_exchange_arguments(self.channels),
                )
            except aiormq.exceptions.ChannelPreconditionFailed as exc:
                raise config_error(
                    exc, f"exchange {events!r}", "delete it so that it is declared again"
                ) from exc
        else:
            exchange = await channel.declare_exchange(events, passive=True)
        approvals = self.channels.approvals_exchange
        return [
            exchange,
            await channel.declare_exchange(approvals, aio_pika.ExchangeType.TOPIC, durable=True),
        ]

    @property
    def _passive(self) -> bool:
        return self.settings.declare == "passive"

    async def _declare_topology(self) -> None:
        """The exchanges, and the catch-all that keeps what no group takes yet (only checked,
        with ``declare=passive``)."""
        if self._passive:
            try:
                await self._declare(self._declare_exchanges)
            except TransportError as exc:
                raise ConfigError(
                    f"declare=passive, but the shared exchanges are not there ({exc}): start the "
                    "central services (they declare them) before least-privilege agents"
                ) from exc
            return
        await self._declare(lambda channel: declare_catch_all(channel, self.channels))
        try:
            await self._declare(self._declare_exchanges)
        except ConfigError as exc:
            if ALTERNATE_EXCHANGE not in str(exc):
                raise
            self.catch_all_problem = missing_catch_all(self.channels, login(self._url)[1])
            log.warning("%s", self.catch_all_problem)
            await self._declare(self._declare_exchanges)

    async def close(self) -> None:
        """Stop the subscriptions (their unsettled messages go back), then disconnect."""
        self._closing = True
        for subscription in list(self._subscriptions):
            await subscription.close()
        self._subscriptions.clear()
        connection, self._connection = self._connection, None
        self._channel = None
        if connection is not None:
            await self._close_quietly(connection)
            log.info("disconnected from RabbitMQ %s", self.display_url)

    async def _close_quietly(self, connection: aio_pika.abc.AbstractRobustConnection) -> None:
        try:
            async with asyncio.timeout(_CLOSE_TIMEOUT):
                await connection.close()
        except FAILURES as exc:
            log.warning("closing the connection to %s failed (%s): dropped", self.display_url, exc)

    def _on_link_lost(self, connection: object, exc: BaseException | None) -> None:
        if self._closing:
            return
        self._lost_at = asyncio.get_running_loop().time()
        log.warning(
            "lost the link to RabbitMQ %s (%s): reconnecting every ~%.1f s at first, less often "
            "the longer it is down (at most every %.0f s); publishing waits up to %.0f s for it, "
            "then fails so the caller keeps the message and retries",
            self.display_url,
            exc if exc is not None else "closed",
            self.settings.reconnect_interval,
            cast(RelayConnection, connection).longest_wait,  # the one it made (connect)
            self.settings.reconnect_timeout,
        )

    def _on_link_restored(self, _sender: object) -> None:
        now = asyncio.get_running_loop().time()
        down = now - self._lost_at if self._lost_at is not None else 0.0
        self._lost_at = None
        log.info(
            "link to RabbitMQ %s restored after %.2f s down: publishing and %d consumer(s) resume",
            self.display_url,
            down,
            len(self._subscriptions),
        )

    def _require(self) -> tuple[aio_pika.abc.AbstractRobustConnection, Any]:
        if self._connection is None or self._channel is None:
            raise TransportError("the RabbitMQ transport is not connected (use `async with`)")
        return self._connection, self._channel

    async def _wait_link(self, deadline: float, what: str) -> None:
        connection, channel = self._require()
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                await connection.ready()
                await channel.ready()
        except TimeoutError as exc:
            raise TransportError(
                f"{what}: RabbitMQ at {self.display_url} has been unreachable for "
                f"{self.settings.reconnect_timeout:g} s; the caller should keep it and retry"
            ) from exc

    # -- publishing -----------------------------------------------------------------------------

    @property
    def link_down_for(self) -> float | None:
        if self._lost_at is None:
            return None
        return asyncio.get_running_loop().time() - self._lost_at

    def reply_address(self, vm: str) -> ReplyAddress:
        return ReplyAddress(channel=self.channels.approvals_exchange, key=vm)

    async def publish(self, message: OutgoingMessage) -> None:
        await self._publish(
            self.channels.events_exchange,
            message.routing_key,
            _amqp_message(message, self.settings.user_id),
            f"message {message.message_id}",
        )

    async def send_approval(self, to: ReplyAddress, message: OutgoingMessage) -> None:
        """Send to the VM's word (:func:`~schemas.channels.vm_word`) on the approvals
        exchange; unroutable (:class:`PublishNotConfirmed`) when that VM never declared its
        queue."""
        if to.channel != self.channels.approvals_exchange:
            raise ConfigError(
                f"approval {message.message_id} is addressed to {to}, but this transport's "
                f"approvals exchange is {self.channels.approvals_exchange!r}: sender and agent "
                "use different channel names"
            )
        await self._publish(
            to.channel,
            vm_word(to.key),
            _amqp_message(message, self.settings.user_id),
            f"approval {message.message_id} for {to.key}",
        )

    async def _publish(
        self, exchange_name: str, routing_key: str, message: aio_pika.Message, what: str
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.reconnect_timeout
        attempt = 0
        backoff = Backoff(*_RETRY_PAUSE)
        while True:
            await self._wait_link(deadline, what)
            _, channel = self._require()
            try:
                if channel.is_closed:
                    raise aiormq.exceptions.ChannelInvalidStateError(f"{channel!r} closed")
                underlay = await channel.get_underlay_channel()
                # wait=False: the channel is held only while the frames are queued for the
                # socket, not until it drained, so the publishes of many agents sharing a
                # connection pipeline; each still waits for its own confirm (or return).
                with lost_if_closed():
                    await underlay.basic_publish(
                        message.body,
                        exchange=exchange_name,
                        routing_key=routing_key,
                        properties=message.properties,
                        mandatory=True,
                        timeout=self.settings.confirm_timeout,
                        wait=False,
                    )
            except aiormq.exceptions.PublishError as exc:
                problem = (
                    self.catch_all_problem
                    if exchange_name == self.channels.events_exchange
                    else None
                )
                raise PublishNotConfirmed(
                    f"{what}: RabbitMQ returned it unroutable ({reason(exc)}): no queue is bound "
                    f"to {exchange_name!r} for routing key {routing_key!r}"
                    + (f". {problem}" if problem is not None else "")
                ) from exc
            except aiormq.exceptions.DeliveryError as exc:
                raise PublishNotConfirmed(f"{what}: RabbitMQ refused it (nack)") from exc
            except TimeoutError as exc:
                raise PublishNotConfirmed(
                    f"{what}: no confirm from RabbitMQ within {self.settings.confirm_timeout:g} s"
                ) from exc
            except MESSAGE_REFUSALS as exc:
                # Refused for what it carries (user_id, routing key, size): the broker closed
                # the channel, which reopens by itself for the next message. Every publish
                # waiting for its confirm there is failed with that refusal: only the message
                # it is about is refused, the others are sent again.
                props = message.properties
                if refuses(exc, exchange_name, routing_key, message.body, props.user_id):
                    raise refused(exc, what) from exc
                failure: BaseException = exc  # another message's refusal
            except REFUSALS as exc:
                raise TransportError(f"{what}: RabbitMQ refused it: {reason(exc)}") from exc
            except asyncio.CancelledError as exc:
                if not is_spurious_cancel(exc):
                    raise
                failure = exc
            except FAILURES as exc:
                failure = exc
            else:
                if attempt:
                    log.info("%s published after %d interrupted attempt(s)", what, attempt)
                return
            attempt += 1
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TransportError(
                    f"{what}: RabbitMQ at {self.display_url} has been unreachable for "
                    f"{self.settings.reconnect_timeout:g} s ({reason(failure)}); the caller "
                    "should keep it and retry"
                ) from failure
            if isinstance(failure, MESSAGE_REFUSALS):
                log.info(
                    "%s: RabbitMQ closed the channel for another message waiting there (%s): "
                    "publishing this one again once the channel reopens",
                    what,
                    reason(failure),
                )
            else:
                log.warning(
                    "%s interrupted (%s): the link is down; publishing again once it is back "
                    "(giving up in %.1f s)",
                    what,
                    reason(failure),
                    remaining,
                )
            await asyncio.sleep(min(backoff.next(), remaining))

    # -- topology -------------------------------------------------------------------------------

    def group_queue(self, group: str) -> str:
        return f"{self.channels.group_prefix}{group}"

    def dead_letter_name(self, group: str) -> str:
        """The group's dead-letter exchange and queue (one name, two namespaces)."""
        return f"{self.channels.group_prefix}{group}{_DEAD_LETTER_SUFFIX}"

    def vm_queue(self, vm: str) -> str:
        return f"{self.channels.vm_prefix}{vm_word(vm)}"

    async def _declare(
        self, steps: Callable[[aio_pika.abc.AbstractChannel], Awaitable[object]]
    ) -> None:
        """Run declarations on a short-lived plain channel, so a refusal (which closes the
        channel) costs nothing else and is reported as such; a cancel meanwhile waits for them
        to end (:func:`uninterrupted`)."""
        await uninterrupted(self._declare_now(steps))

    async def _declare_now(
        self, steps: Callable[[aio_pika.abc.AbstractChannel], Awaitable[object]]
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.reconnect_timeout
        connection = self._connection
        if connection is None:
            raise TransportError("the RabbitMQ transport is not connected (use `async with`)")
        try:
            async with asyncio.timeout(max(deadline - loop.time(), 0.0)):
                await connection.ready()
            channel = aio_pika.Channel(connection, publisher_confirms=False)
            await initialized(channel, self.settings.confirm_timeout)
            try:
                async with asyncio.timeout(self.settings.confirm_timeout):
                    with lost_if_closed():
                        await steps(channel)
            finally:
                if not channel.is_closed:
                    # Declared already: a slow close (left to finish) fails nothing.
                    with contextlib.suppress(*FAILURES):
                        await unabandoned(channel.close(), _CLOSE_TIMEOUT)
        except asyncio.CancelledError as exc:
            if not is_spurious_cancel(exc):
                raise
            raise TransportError(f"declaring on {self.display_url}: link lost") from exc
        except (ConfigError, TransportError):
            raise
        except FAILURES as exc:
            raise TransportError(
                f"declaring on RabbitMQ {self.display_url} failed: {reason(exc)}"
            ) from exc

    async def _queue_exists(self, name: str) -> bool:
        exists = True

        async def probe(channel: aio_pika.abc.AbstractChannel) -> None:
            nonlocal exists
            try:
                await channel.declare_queue(name, passive=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                exists = False

        await self._declare(probe)
        return exists

    async def _declare_group(self, group: str, exclusive: bool | None) -> None:
        """``exclusive=None``: create the group's queue if missing, else take it as it is."""
        queue = self.group_queue(group)
        dead = self.dead_letter_name(group)
        if exclusive is None and await self._queue_exists(queue):
            exclusive = False
            declare_queue = False
        else:
            declare_queue = True
        arguments: dict[str, Any] = {
            **_QUORUM,
            "x-dead-letter-exchange": dead,
            "x-delivery-limit": self.settings.delivery_limit,
        }
        if exclusive:
            arguments["x-single-active-consumer"] = True

        async def steps(channel: aio_pika.abc.AbstractChannel) -> None:
            dead_exchange = await channel.declare_exchange(
                dead, aio_pika.ExchangeType.FANOUT, durable=True
            )
            dead_queue = await self._checked_queue(channel, dead, dict(_QUORUM), "")
            await dead_queue.bind(dead_exchange, "")
            if declare_queue:
                hint = (
                    f"subscribe to {group!r} with the exclusive= it was created with, or delete "
                    f"the queue {queue!r} (its messages go with it) so it is declared again"
                )
                declared = await self._checked_queue(channel, queue, arguments, hint)
            else:  # bound again all the same: the events exchange may have been declared anew
                declared = await channel.get_queue(queue, ensure=False)
            await declared.bind(self.channels.events_exchange, "#")

        await self._declare(steps)
        connection, _ = self._require()
        await uninterrupted(
            drain(
                connection,
                self.channels.unrouted,
                group,
                step_timeout=self.settings.confirm_timeout,
            )
        )

    async def _checked_queue(
        self,
        channel: aio_pika.abc.AbstractChannel,
        name: str,
        arguments: dict[str, Any],
        hint: str,
    ) -> aio_pika.abc.AbstractQueue:
        try:
            return await channel.declare_queue(name, durable=True, arguments=arguments)
        except aiormq.exceptions.ChannelPreconditionFailed as exc:
            raise config_error(
                exc,
                f"queue {name!r}",
                hint or f"delete the queue {name!r} so it is declared again",
            ) from exc

    async def declare_group(self, group: str, *, exclusive: bool | None = None) -> None:
        """Create the group's queue if missing. ``exclusive=None`` takes an existing queue as it
        is and creates a missing one for competing consumers; True or False must match how the
        queue was created (``x-single-active-consumer``)."""
        self._require()
        await self._declare_group(group, exclusive)

    async def _declare_vm(self, vm: str) -> None:
        queue = self.vm_queue(vm)
        arguments = {"x-message-ttl": round(self.settings.approval_ttl * 1000)}
        hint = (
            f"use the approval_ttl it was created with, or delete the queue {queue!r} so it is "
            "declared again"
        )

        async def steps(channel: aio_pika.abc.AbstractChannel) -> None:
            declared = await self._checked_queue(channel, queue, arguments, hint)
            await declared.bind(self.channels.approvals_exchange, vm_word(vm))

        await self._declare(steps)

    # -- consuming ------------------------------------------------------------------------------

    async def _consumer_channel(self, prefetch: int) -> aio_pika.abc.AbstractRobustChannel:
        connection, _ = self._require()
        channel = connection.channel(publisher_confirms=False)
        try:
            await initialized(channel, self.settings.confirm_timeout)
            async with asyncio.timeout(self.settings.confirm_timeout):
                await channel.set_qos(prefetch_count=prefetch)
        except FAILURES as exc:
            raise TransportError(f"opening a consumer channel failed: {reason(exc)}") from exc
        return channel

    def _subscription(
        self,
        queue: str,
        *,
        prefetch: int,
        declare: Callable[[], Awaitable[None]],
        dead_letter_exchange: str | None,
        attach: Callable[[aio_pika.abc.AbstractRobustChannel], Awaitable[object]] | None = None,
        reads_dead_letters: bool = False,
    ) -> AmqpSubscription:
        self._require()
        if prefetch < 1:
            raise ConfigError(f"prefetch must be at least 1, not {prefetch}")

        async def existing(channel: aio_pika.abc.AbstractRobustChannel) -> object:
            # Passive, and registered on the robust channel: each reopen checks it again.
            return await channel.declare_queue(queue, passive=True)

        subscription = AmqpSubscription(
            queue,
            prefetch=prefetch,
            declare=declare,
            attach=attach or existing,
            open_channel=self._consumer_channel,
            publish=self._publish,
            dead_letter_exchange=dead_letter_exchange,
            reads_dead_letters=reads_dead_letters,
            on_close=self._subscriptions.discard,
            start_timeout=self.settings.reconnect_timeout + self.settings.confirm_timeout,
        )
        self._subscriptions.add(subscription)
        return subscription

    def subscribe(
        self, group: str, *, prefetch: int = 64, exclusive: bool = False, transient: bool = False
    ) -> AmqpSubscription:
        """Consume the group's queue. ``exclusive`` is ``x-single-active-consumer``, fixed when
        the queue is created: asking for the other value raises :class:`ConfigError`.

        ``transient``: a queue of this subscription's own instead of the group's (a classic,
        non-durable, exclusive, auto-delete queue named ``<group_prefix><group>.transient.<id>``,
        bound ``#``), which the broker deletes when the subscription closes or its connection
        goes: nothing collects messages once the reader stops. It sees what is published while
        it runs (after a reconnect it is declared again, so what was published while the link
        was down is missed); ``exclusive`` does not apply (it has one consumer); what it
        dead-letters is dropped."""
        if not transient:
            return self._subscription(
                self.group_queue(group),
                prefetch=prefetch,
                declare=lambda: self._declare_group(group, exclusive),
                dead_letter_exchange=self.dead_letter_name(group),
            )
        queue = f"{self.group_queue(group)}{TRANSIENT_INFIX}{uuid.uuid4().hex[:12]}"

        async def nothing() -> None:
            """The events exchange is declared on connect; the queue belongs to the channel."""

        async def transient_queue(channel: aio_pika.abc.AbstractRobustChannel) -> object:
            declared = await channel.declare_queue(
                queue, durable=False, exclusive=True, auto_delete=True
            )
            await declared.bind(self.channels.events_exchange, "#")
            return declared

        return self._subscription(
            queue,
            prefetch=prefetch,
            declare=nothing,
            dead_letter_exchange=None,
            attach=transient_queue,
        )

    def approvals(self, vm: str, *, prefetch: int = 8) -> AmqpSubscription:
        return self._subscription(
            self.vm_queue(vm),
            prefetch=prefetch,
            declare=lambda: self._declare_vm(vm),
            dead_letter_exchange=None,
        )

    def dead_letters(self, group: str) -> AmqpSubscription:
        return self._subscription(
            self.dead_letter_name(group),
            prefetch=16,
            declare=lambda: self._declare_group(group, None),
            dead_letter_exchange=None,
            reads_dead_letters=True,
        )

    # -- housekeeping ---------------------------------------------------------------------------

    async def delete_topology(
        self, *, groups: Iterable[str] = (), vms: Iterable[str] = (), exchanges: bool = False
    ) -> None:
        """Delete the named groups' and VMs' queues (with their messages), and with
        ``exchanges`` this transport's exchanges and its catch-all queue. For tests and
        decommissioning."""
        self._require()
        queues = [self.vm_queue(vm) for vm in vms]
        dead_exchanges = []
        for group in groups:
            queues += [self.group_queue(group), self.dead_letter_name(group)]
            dead_exchanges.append(self.dead_letter_name(group))
        names = list(dead_exchanges)
        if exchanges:
            queues.append(self.channels.unrouted)
            names += [
                self.channels.events_exchange,
                self.channels.approvals_exchange,
                self.channels.unrouted,
            ]

        async def steps(channel: aio_pika.abc.AbstractChannel) -> None:
            for queue in queues:
                await channel.queue_delete(queue)
            for exchange in names:
                await channel.exchange_delete(exchange)

        await self._declare(steps)


def _amqp_message(message: OutgoingMessage, user_id: str | None) -> aio_pika.Message:
    return aio_pika.Message(
        body=message.body,
        headers=dict(message.properties),
        content_type=message.content_type,
        message_id=message.message_id,
        timestamp=datetime.now(UTC),
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        expiration=message.ttl_seconds,
        # RabbitMQ checks it against the connection's user: the consumer can trust it.
        user_id=user_id or None,
    )
