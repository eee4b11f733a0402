"""RabbitMQ consumers: one robust channel per subscription, deliveries settled once.

A subscription owns its channel, so its prefetch is its own and closing it hands every message
it had not settled back to the queue (the broker requeues a closed channel's unacked messages).
After a reconnect the robust channel consumes again; messages buffered from the lost channel
are dropped here, since the broker delivers them again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import TracebackType
from typing import Self

import aio_pika
import aio_pika.abc
import aiormq.exceptions

from .._errors import TransportError
from ._amqp_errors import FAILURES, is_spurious_cancel, reason
from ._base import PropertyValue
from .memory import DEAD_LETTER_DESCRIPTION, DEAD_LETTER_REASON

__all__ = ["AmqpDelivery", "AmqpSubscription"]

log = logging.getLogger(__name__)

#: Publish ``message`` to ``exchange`` with ``routing_key``, confirmed; ``what`` names it in errors.
PublishFn = Callable[[str, str, aio_pika.Message, str], Awaitable[None]]
#: A robust channel with this prefetch, opened once the link is up.
ChannelFn = Callable[[int], Awaitable[aio_pika.abc.AbstractRobustChannel]]

_DELIVERY_COUNT = "x-delivery-count"
_FIRST_DEATH_REASON = "x-first-death-reason"
_FIRST_DEATH_QUEUE = "x-first-death-queue"
_CLOSE_TIMEOUT = 5.0


def _properties(headers: Mapping[str, object]) -> dict[str, PropertyValue]:
    """Application headers as plain values; the broker's own ``x-`` headers are left out."""
    result: dict[str, PropertyValue] = {}
    for key, value in headers.items():
        if key.startswith("x-"):
            continue
        if isinstance(value, bytes):
            try:
                result[key] = value.decode()
            except UnicodeDecodeError:
                log.debug("header %s is not UTF-8 text: left out", key)
        elif isinstance(value, str | int | float | bool):
            result[key] = value
    if DEAD_LETTER_REASON not in result and _FIRST_DEATH_REASON in headers:
        # Dead-lettered by the broker itself (delivery limit, expiry): say so the same way.
        result[DEAD_LETTER_REASON] = str(headers[_FIRST_DEATH_REASON])
        result[DEAD_LETTER_DESCRIPTION] = (
            f"dead-lettered by RabbitMQ from {headers.get(_FIRST_DEATH_QUEUE, 'its queue')}"
        )
    return result


class AmqpDelivery:
    """A :class:`~schemas.transport.Delivery` from RabbitMQ."""

    def __init__(self, message: aio_pika.abc.AbstractIncomingMessage, owner: AmqpSubscription):
        self._message = message
        self._owner = owner
        self._settled = False
        self._properties: dict[str, PropertyValue] | None = None  # computed when first asked

    @property
    def body(self) -> bytes:
        return bytes(self._message.body)

    @property
    def message_id(self) -> str:
        return self._message.message_id or ""

    @property
    def content_type(self) -> str:
        return self._message.content_type or ""

    @property
    def routing_key(self) -> str:
        return self._message.routing_key or ""

    @property
    def properties(self) -> Mapping[str, PropertyValue]:
        if self._properties is None:
            self._properties = _properties(self._message.headers)
        return self._properties

    @property
    def delivery_count(self) -> int:
        # Quorum queues count returns; classic queues only say "delivered before".
        count = self._message.headers.get(_DELIVERY_COUNT)
        if isinstance(count, int) and not isinstance(count, bool):
            return count
        return 1 if self._message.redelivered else 0

    def _claim(self) -> None:
        if self._settled:
            raise TransportError(f"message {self.message_id} was settled already")
        self._settled = True

    async def _settle(self, action: str, operation: Callable[[], Awaitable[None]]) -> None:
        try:
            await operation()
        except asyncio.CancelledError as exc:
            if not is_spurious_cancel(exc):
                raise
            raise TransportError(self._lost(action, exc)) from exc
        except FAILURES as exc:
            raise TransportError(self._lost(action, exc)) from exc

    def _lost(self, action: str, exc: BaseException) -> str:
        return (
            f"could not {action} message {self.message_id} from {self._owner.queue_name}: its "
            f"channel closed ({reason(exc)}); the broker delivers it again"
        )

    async def ack(self) -> None:
        self._claim()
        await self._settle("ack", self._message.ack)

    async def ack_through(self) -> None:
        """Ack this delivery and every earlier one of its subscription still unsettled, in one
        frame (``basic.ack`` with ``multiple``): for a consumer that handles deliveries in
        order and settles the earlier ones no other way, a batch costs one ack."""
        self._claim()
        await self._settle("ack", lambda: self._message.ack(multiple=True))

    async def retry(self) -> None:
        self._claim()
        await self._settle("requeue", lambda: self._message.nack(requeue=True))

    async def dead_letter(self, reason: str, description: str) -> None:
        exchange = self._owner.dead_letter_exchange
        if exchange is None:
            self._claim()
            log.warning(
                "message %s dead-lettered from %s, which has no dead-letter queue: dropped (%s)",
                self.message_id,
                self._owner.queue_name,
                reason,
            )
            await self._settle("drop", lambda: self._message.reject(requeue=False))
            return
        if self._settled:
            raise TransportError(f"message {self.message_id} was settled already")
        headers = {k: v for k, v in self._message.headers.items() if not k.startswith("x-")}
        headers[DEAD_LETTER_REASON] = reason
        headers[DEAD_LETTER_DESCRIPTION] = description
        copy = aio_pika.Message(
            body=self.body,
            headers=headers,
            content_type=self._message.content_type,
            content_encoding=self._message.content_encoding,
            message_id=self._message.message_id,
            correlation_id=self._message.correlation_id,
            timestamp=self._message.timestamp,
            type=self._message.type,
            app_id=self._message.app_id,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        # Confirmed in the dead-letter queue first, then removed here: never both lost.
        await self._owner.publish(
            exchange, self.routing_key, copy, f"dead letter of message {self.message_id}"
        )
        self._claim()
        await self._settle("ack", self._message.ack)


class AmqpSubscription:
    """A :class:`~schemas.transport.Subscription` on one RabbitMQ queue."""

    def __init__(
        self,
        queue_name: str,
        *,
        prefetch: int,
        declare: Callable[[], Awaitable[None]],
        open_channel: ChannelFn,
        publish: PublishFn,
        dead_letter_exchange: str | None,
        on_close: Callable[[AmqpSubscription], None],
        start_timeout: float,
    ) -> None:
        self.queue_name = queue_name
        self.dead_letter_exchange = dead_letter_exchange
        self.publish = publish
        self._prefetch = prefetch
        self._declare = declare
        self._open_channel = open_channel
        self._on_close = on_close
        self._start_timeout = start_timeout
        self._buffer: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage | None] = asyncio.Queue()
        self._channel: aio_pika.abc.AbstractRobustChannel | None = None
        self._started = False
        self._closed = False
        self._start_lock = asyncio.Lock()

    async def start(self) -> None:
        """Declare the queue and start consuming (done by ``async with`` or the first wait)."""
        if self._started or self._closed:
            return
        async with self._start_lock:
            if self._started or self._closed:
                return
            await self._declare()
            channel = await self._open_channel(self._prefetch)
            try:
                async with asyncio.timeout(self._start_timeout):
                    queue = await channel.declare_queue(self.queue_name, passive=True)
                    await queue.consume(self._on_message)
            except asyncio.CancelledError as exc:
                await self._close_channel(channel)
                if not is_spurious_cancel(exc):
                    raise
                raise TransportError(f"consuming {self.queue_name} failed: link lost") from exc
            except FAILURES as exc:
                await self._close_channel(channel)
                raise TransportError(f"consuming {self.queue_name} failed: {reason(exc)}") from exc
            self._channel = channel
            self._started = True
            log.debug("consuming %s (prefetch %d)", self.queue_name, self._prefetch)

    async def _on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        if not self._closed:  # after close the channel's closing hands it back to the queue
            self._buffer.put_nowait(message)

    def __aiter__(self) -> AsyncIterator[AmqpDelivery]:
        return self

    async def __anext__(self) -> AmqpDelivery:
        await self.start()
        while not self._closed:
            message = await self._buffer.get()
            if message is None:
                break
            try:
                message.channel  # noqa: B018 - raises once the channel it came on is gone
            except aiormq.exceptions.ChannelInvalidStateError:
                log.debug(
                    "message %s from %s arrived on a channel since lost: the broker delivers "
                    "it again",
                    message.message_id,
                    self.queue_name,
                )
                continue
            return AmqpDelivery(message, self)
        raise StopAsyncIteration

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._buffer.put_nowait(None)
        self._on_close(self)
        async with self._start_lock:
            channel, self._channel = self._channel, None
        if channel is not None:
            await self._close_channel(channel)

    async def _close_channel(self, channel: aio_pika.abc.AbstractRobustChannel) -> None:
        if channel.is_closed:
            return
        try:
            async with asyncio.timeout(_CLOSE_TIMEOUT):
                await channel.close()
        except FAILURES as exc:
            log.warning(
                "closing the consumer channel of %s failed (%s): the broker hands its "
                "unsettled messages back when the connection closes",
                self.queue_name,
                reason(exc),
            )

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
