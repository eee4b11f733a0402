"""RabbitMQ consumers: one robust channel per subscription, deliveries settled once.

A subscription owns its channel, so its prefetch is its own and closing it hands every message
it had not settled back to the queue (the broker requeues a closed channel's unacked messages).

It consumes on the robust channel's underlying aiormq channel rather than through aio-pika's
queue: aio-pika builds a full ``IncomingMessage`` (every property converted, one more task) for
each message, which costs more than everything a consumer does with it. A delivery here keeps
aiormq's frame and reads what it is asked for. The price is that aio-pika no longer knows the
consumer, so the subscription consumes again itself each time the robust channel reopens (after
a reconnect, or after the broker closed the channel). A delivery is settled by its delivery tag
on the channel it came on: one from a lost channel raises :class:`TransportError` (the broker
delivers it again), and deliveries still buffered from a lost channel are dropped here.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, Self

import aio_pika
import aio_pika.abc
import aiormq.abc
import aiormq.exceptions
from pamqp import commands as spec
from pamqp import encode

from .._errors import TransportError

# Imported for its effect: a content header with a property pamqp cannot read costs that
# property, not the connection (see the module).
from . import _amqp_properties  # noqa: F401
from ._amqp_errors import (
    FAILURES,
    LINK_ERRORS,
    is_spurious_cancel,
    lost_if_closed,
    reason,
    unabandoned,
    uninterrupted,
)
from ._base import PropertyValue
from .memory import DEAD_LETTER_DESCRIPTION, DEAD_LETTER_REASON, ORIGINAL_SENDER

__all__ = ["ORIGINAL_SENDER", "AmqpDelivery", "AmqpSubscription"]

log = logging.getLogger(__name__)

#: Publish ``message`` to ``exchange`` with ``routing_key``, confirmed; ``what`` names it in errors.
PublishFn = Callable[[str, str, aio_pika.Message, str], Awaitable[None]]
#: A robust channel with this prefetch, opened once the link is up.
ChannelFn = Callable[[int], Awaitable[aio_pika.abc.AbstractRobustChannel]]
#: Declares the subscription's queue on its robust channel, so each reopen declares it again
#: before the subscription consumes again (a durable queue passively: it must still exist).
AttachFn = Callable[[aio_pika.abc.AbstractRobustChannel], Awaitable[object]]

_DELIVERY_COUNT = "x-delivery-count"
#: The broker's record of each time it dead-lettered a message, the latest first.
_DEATHS = "x-death"
_FIRST_DEATH_REASON = "x-first-death-reason"
_FIRST_DEATH_QUEUE = "x-first-death-queue"
_CLOSE_TIMEOUT = 5.0
_CONSUME_TIMEOUT = 10.0
#: The most of a message's own headers its dead-letter copy carries (bytes as written): the
#: copy's content header, with the reason added, must fit in one frame (RabbitMQ's frame_max,
#: 128 KiB by default), or the broker closes the whole link.
_COPIED_HEADERS_MAX = 64 * 1024


def _properties(
    headers: Mapping[str, object], *, dead_letter: bool, sender: str | None
) -> dict[str, PropertyValue]:
    """Application headers as plain values; the broker's own ``x-`` headers are left out.

    A dead letter (``dead_letter``) the broker moved itself (delivery limit, expiry) says why
    the same way as one a consumer dead-lettered, and names its original sender: the broker
    kept its validated ``user_id``. Its reason and sender are the broker's even when its
    headers say otherwise: those are the publisher's own, and anyone may write them (a
    consumer's copy carries no broker record: its headers are the consumer's). Elsewhere the
    broker's dead-lettering records mean nothing to the reader (a message handed on from the
    catch-all queue carries one)."""
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
    if dead_letter:
        death = _latest_death(headers)
        if death is not None:
            result[DEAD_LETTER_REASON], queue = death
            result[DEAD_LETTER_DESCRIPTION] = f"dead-lettered by RabbitMQ from {queue}"
            result.pop(ORIGINAL_SENDER, None)
            if sender is not None:
                result[ORIGINAL_SENDER] = sender
    return result


def _latest_death(headers: Mapping[str, object]) -> tuple[str, str] | None:
    """(reason, queue) of the last time the broker dead-lettered the message."""
    deaths = headers.get(_DEATHS)
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping):
        latest = deaths[0]
        return _text(latest.get("reason")), _text(latest.get("queue", "its queue"))
    if _FIRST_DEATH_REASON in headers:
        return (
            _text(headers[_FIRST_DEATH_REASON]),
            _text(headers.get(_FIRST_DEATH_QUEUE, "its queue")),
        )
    return None


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _copyable(headers: Mapping[str, Any], message_id: str) -> dict[str, object]:
    """The headers a dead-letter copy can carry of ``headers`` (the broker's ``x-`` ones left
    out). The publisher chose them, and pamqp reads values it cannot write again (a long string
    that is not UTF-8, read as bytes; a decimal beyond the signed mantissa it writes; a double
    beyond the single-precision float it writes floats as): each is left out of the copy, as
    is whatever exceeds :data:`_COPIED_HEADERS_MAX`, and a warning names them."""
    kept: dict[str, object] = {}
    left_out: list[str] = []
    size = 0
    for key, value in headers.items():
        if key.startswith("x-"):
            continue
        try:
            written = len(key.encode(errors="replace")) + len(encode.encode_table_value(value))
        except (TypeError, ValueError, OverflowError, RecursionError, struct.error):
            left_out.append(key)
            continue
        if size + written > _COPIED_HEADERS_MAX:
            left_out.append(key)
            continue
        size += written
        kept[key] = value
    if left_out:
        log.warning(
            "message %s: %d header(s) cannot be written into its dead-letter copy (not "
            "writable as AMQP values, or more than %d bytes of headers): left out of it (%s)",
            message_id or "(no id)",
            len(left_out),
            _COPIED_HEADERS_MAX,
            ", ".join(repr(key[:40]) for key in left_out[:5])
            + (", ..." if len(left_out) > 5 else ""),
        )
    return kept


class AmqpDelivery:
    """A :class:`~schemas.transport.Delivery` from RabbitMQ: aiormq's frame, read on demand."""

    __slots__ = ("_channel", "_deliver", "_header", "_owner", "_properties", "_settled", "body")

    def __init__(self, message: aiormq.abc.DeliveredMessage, owner: AmqpSubscription) -> None:
        self.body: bytes = message.body
        self._deliver: Any = message.delivery  # spec.Basic.Deliver
        self._header: Any = message.header.properties  # spec.Basic.Properties
        self._channel = message.channel
        self._owner = owner
        self._settled = False
        self._properties: dict[str, PropertyValue] | None = None  # computed when first asked

    @property
    def message_id(self) -> str:
        return self._header.message_id or ""

    @property
    def content_type(self) -> str:
        return self._header.content_type or ""

    @property
    def routing_key(self) -> str:
        return self._deliver.routing_key or ""

    @property
    def properties(self) -> Mapping[str, PropertyValue]:
        if self._properties is None:
            self._properties = _properties(
                self._headers, dead_letter=self._owner.reads_dead_letters, sender=self.sender
            )
        return self._properties

    @property
    def _headers(self) -> Mapping[str, object]:
        headers: Mapping[str, object] | None = self._header.headers
        return headers if headers is not None else {}

    @property
    def delivery_count(self) -> int:
        # Quorum queues count returns; classic queues only say "delivered before". A quorum
        # queue writes its count only on a redelivery: on a first delivery the header is the
        # publisher's own, whatever it says.
        if not self._deliver.redelivered:
            return 0
        count = self._headers.get(_DELIVERY_COUNT)
        if isinstance(count, int) and not isinstance(count, bool):
            return count
        return 1 if self._deliver.redelivered else 0

    @property
    def sender(self) -> str | None:
        # RabbitMQ refuses a publish whose user_id is not the connection's user: validated.
        user_id: str | None = self._header.user_id
        return user_id or None

    def _claim(self) -> None:
        if self._settled:
            raise TransportError(f"message {self.message_id} was settled already")
        self._settled = True

    async def _settle(
        self, action: str, operation: Callable[[aiormq.abc.AbstractChannel, int], Awaitable[None]]
    ) -> None:
        channel = self._channel
        try:
            if channel.is_closed:
                raise aiormq.exceptions.ChannelInvalidStateError(f"{channel!r} closed")
            await operation(channel, self._deliver.delivery_tag)
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
        await self._settle("ack", lambda channel, tag: channel.basic_ack(tag))

    async def ack_through(self) -> None:
        """Ack this delivery and every earlier one of its subscription still unsettled, in one
        frame (``basic.ack`` with ``multiple``): for a consumer that handles deliveries in
        order and settles the earlier ones no other way, a batch costs one ack."""
        self._claim()
        await self._settle("ack", lambda channel, tag: channel.basic_ack(tag, multiple=True))

    async def retry(self) -> None:
        self._claim()
        await self._settle("requeue", lambda channel, tag: channel.basic_nack(tag, requeue=True))

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
            await self._settle(
                "drop", lambda channel, tag: channel.basic_reject(tag, requeue=False)
            )
            return
        if self._settled:
            raise TransportError(f"message {self.message_id} was settled already")
        headers = _copyable(self._headers, self.message_id)
        headers[DEAD_LETTER_REASON] = reason
        headers[DEAD_LETTER_DESCRIPTION] = description
        # The copy is published by this consumer's own user: it names the original's sender,
        # as the broker validated it, and never a header of that name the publisher wrote.
        headers.pop(ORIGINAL_SENDER, None)
        if self.sender is not None:
            headers[ORIGINAL_SENDER] = self.sender
        header = self._header
        copy = aio_pika.Message(
            body=self.body,
            headers=headers,  # type: ignore[arg-type]  # values as the broker delivered them
            content_type=header.content_type,
            content_encoding=header.content_encoding,
            message_id=header.message_id,
            correlation_id=header.correlation_id,
            timestamp=header.timestamp,
            type=header.message_type,
            app_id=header.app_id,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        # Confirmed in the dead-letter queue first, then removed here: never both lost.
        await self._owner.publish(
            exchange, self.routing_key, copy, f"dead letter of message {self.message_id}"
        )
        self._claim()
        await self._settle("ack", lambda channel, tag: channel.basic_ack(tag))


class AmqpSubscription:
    """A :class:`~schemas.transport.Subscription` on one RabbitMQ queue."""

    def __init__(
        self,
        queue_name: str,
        *,
        prefetch: int,
        declare: Callable[[], Awaitable[None]],
        attach: AttachFn,
        open_channel: ChannelFn,
        publish: PublishFn,
        dead_letter_exchange: str | None,
        on_close: Callable[[AmqpSubscription], None],
        start_timeout: float,
        reads_dead_letters: bool = False,
    ) -> None:
        self.queue_name = queue_name
        self.dead_letter_exchange = dead_letter_exchange
        #: A dead-letter queue: deliveries say why the broker dead-lettered them.
        self.reads_dead_letters = reads_dead_letters
        self.publish = publish
        self._prefetch = prefetch
        self._declare = declare
        self._attach = attach
        self._open_channel = open_channel
        self._on_close = on_close
        self._start_timeout = start_timeout
        #: Deliveries in arrival order; None wakes the reader to stop (closed or failed).
        self._buffer: asyncio.Queue[aiormq.abc.DeliveredMessage | None] = asyncio.Queue()
        self._channel: aio_pika.abc.AbstractRobustChannel | None = None
        self._consumer_tag: str | None = None
        self._started = False
        self._closed = False
        self._failure: TransportError | None = None
        self._start_lock = asyncio.Lock()

    async def start(self) -> None:
        """Declare the queue and start consuming (done by ``async with`` or the first wait)."""
        if self._started or self._closed:
            return
        async with self._start_lock:
            if self._started or self._closed:
                return
            # A cancel (a stop) waits for the exchange to end, then close() undoes it.
            await uninterrupted(self._start())

    async def _start(self) -> None:
        await self._declare()
        channel = await self._open_channel(self._prefetch)
        try:
            async with asyncio.timeout(self._start_timeout):
                with lost_if_closed():
                    await self._attach(channel)
                    await self._consume(await channel.get_underlay_channel())
        except asyncio.CancelledError as exc:
            await self._close_channel(channel)
            if not is_spurious_cancel(exc):
                raise
            raise TransportError(f"consuming {self.queue_name} failed: link lost") from exc
        except FAILURES as exc:
            await self._close_channel(channel)
            raise TransportError(f"consuming {self.queue_name} failed: {reason(exc)}") from exc
        channel.reopen_callbacks.add(self._on_reopen)
        self._channel = channel
        self._started = True
        log.debug("consuming %s (prefetch %d)", self.queue_name, self._prefetch)

    async def _consume(self, channel: aiormq.abc.AbstractChannel) -> None:
        channel.on_consumer_cancel_callbacks.add(self._on_cancelled)
        ok = await channel.basic_consume(
            self.queue_name, self._on_delivered, no_ack=False, timeout=_CONSUME_TIMEOUT
        )
        self._consumer_tag = ok.consumer_tag

    async def _on_reopen(self, channel: aio_pika.abc.AbstractRobustChannel | None, /) -> None:
        """The robust channel reopened (it declared the queue again): consume on it again.

        aio-pika drops what a reopen callback raises, so nothing may leave here: a consume
        that failed while the channel stays open (no reopen follows) would leave the
        subscription quiet for good. Only a consume cut off by the channel closing again
        waits for the next reopen; any other failure ends the subscription, whose next wait
        raises it (its owner opens it again)."""
        if channel is None or self._closed or self._failure is not None:
            return
        try:
            with lost_if_closed():
                await self._consume(await channel.get_underlay_channel())
        except asyncio.CancelledError as exc:
            if not is_spurious_cancel(exc):
                raise
            self._not_consuming(channel, exc)
        except Exception as exc:  # aio-pika would drop it: see the docstring
            self._not_consuming(channel, exc)
        else:
            log.info("consuming %s again after a reconnect", self.queue_name)

    def _not_consuming(self, channel: aio_pika.abc.AbstractChannel, exc: BaseException) -> None:
        cut_off = isinstance(exc, (asyncio.CancelledError, *LINK_ERRORS))
        if cut_off and channel.is_closed:
            log.info(
                "consuming %s again was cut off (%s): tried again on the next reopen",
                self.queue_name,
                reason(exc),
            )
        else:
            self._fail(f"consuming {self.queue_name} again failed: {reason(exc)}", exc)

    def _on_cancelled(self, frame: spec.Basic.Cancel) -> None:
        """The broker cancelled the consumer (its queue was deleted): the stream ends."""
        if frame.consumer_tag == self._consumer_tag and not self._closed:
            self._fail(f"RabbitMQ cancelled the consumer of {self.queue_name}", None)

    def _fail(self, message: str, cause: BaseException | None) -> None:
        """End the subscription: what is buffered is still handed out, then waits raise."""
        log.error("%s: the subscription ends", message)
        self._failure = TransportError(message)
        self._failure.__cause__ = cause
        self._buffer.put_nowait(None)

    async def _on_delivered(self, message: aiormq.abc.DeliveredMessage) -> None:
        if not self._closed:  # after close the channel's closing hands it back to the queue
            self._buffer.put_nowait(message)

    def __aiter__(self) -> AsyncIterator[AmqpDelivery]:
        return self

    async def __anext__(self) -> AmqpDelivery:
        await self.start()
        buffer = self._buffer
        while not self._closed:
            message = buffer.get_nowait() if buffer.qsize() else await buffer.get()
            if message is None:
                if self._failure is not None and not self._closed:
                    buffer.put_nowait(None)  # every later wait raises too
                    raise TransportError(str(self._failure)) from self._failure.__cause__
                continue
            if message.channel.is_closed:
                log.debug(
                    "message %s from %s arrived on a channel since lost: the broker delivers "
                    "it again",
                    message.header.properties.message_id,
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
            channel.reopen_callbacks.discard(self._on_reopen)
            await uninterrupted(self._close_channel(channel))

    async def _close_channel(self, channel: aio_pika.abc.AbstractRobustChannel) -> None:
        if channel.is_closed:
            return
        try:
            await unabandoned(channel.close(), _CLOSE_TIMEOUT)
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
