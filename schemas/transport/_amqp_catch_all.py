"""Nothing lost while nobody listens: RabbitMQ's catch-all for the lifecycle stream.

A topic exchange drops what no queue is bound for, and a ``mandatory`` publish is refused
(NO_ROUTE), so an agent started before any consumer group exists could keep nothing. Here the
events exchange has an alternate exchange, ``unrouted`` (fanout), bound to one durable quorum
queue of the same name::

    events_exchange (alternate-exchange = unrouted) ──no queue bound──▶ unrouted ─▶ [unrouted]
          ▲                                                                           │
          └──────── dead-lettered, routing key and properties unchanged ◀── rejected ─┘

When a group is declared (its queue bound), :func:`drain` rejects each message waiting there,
without requeue: the broker dead-letters it back into the events exchange, where the group's
queue takes it. Nothing is republished by a consumer, which would make the consumer its sender:
the publisher's validated ``user_id`` travels on. The queue dead-letters at least once
(``x-dead-letter-strategy``), so a message leaves it only once a queue of the stream confirmed
it; quorum queues do that only with ``x-overflow = reject-publish``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from typing import Any

import aio_pika
import aio_pika.abc
import aiormq.abc
import aiormq.exceptions

from .._errors import ConfigError
from ..channels import ChannelNames
from ._amqp_errors import (
    FAILURES,
    config_error,
    initialized,
    is_spurious_cancel,
    reason,
    unabandoned,
)

__all__ = [
    "ALTERNATE_EXCHANGE",
    "declare_catch_all",
    "drain",
    "events_exchange_arguments",
    "missing_catch_all",
]

log = logging.getLogger(__name__)

ALTERNATE_EXCHANGE = "alternate-exchange"
#: Deliveries in flight while draining, and how long a pause ends the drain.
_PREFETCH = 256
_IDLE = 1.0
_CLOSE_TIMEOUT = 5.0
#: How often the drain asks whether RabbitMQ applied its last rejection.
_POLL = 0.05


def events_exchange_arguments(channels: ChannelNames) -> dict[str, Any]:
    """The events exchange's arguments, the same from every party."""
    return {ALTERNATE_EXCHANGE: channels.unrouted}


async def declare_catch_all(channel: aio_pika.abc.AbstractChannel, channels: ChannelNames) -> None:
    """The ``unrouted`` fanout exchange and the quorum queue bound to it."""
    name = channels.unrouted
    exchange = await channel.declare_exchange(name, aio_pika.ExchangeType.FANOUT, durable=True)
    arguments: dict[str, Any] = {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": channels.events_exchange,  # routing key kept
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }
    try:
        queue = await channel.declare_queue(name, durable=True, arguments=arguments)
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        raise config_error(
            exc, f"queue {name!r}", f"delete the queue {name!r} so it is declared again"
        ) from exc
    await queue.bind(exchange, "")


def missing_catch_all(channels: ChannelNames, vhost: str) -> ConfigError:
    """An events exchange an older version declared without the alternate exchange: how to fix
    it. A policy works while older agents still declare the exchange without the argument;
    deleting the exchange (it is declared again with it) needs every party on this version."""
    events, unrouted = channels.events_exchange, channels.unrouted
    pattern = "^" + re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", events) + "$"
    policy = (
        f"rabbitmqctl set_policy -p '{vhost}' --apply-to exchanges {events}-catch-all "
        f"'{pattern}' '{{\"{ALTERNATE_EXCHANGE}\":\"{unrouted}\"}}'"
    )
    return ConfigError(
        f"RabbitMQ exchange {events!r} was declared without the argument "
        f"{ALTERNATE_EXCHANGE}={unrouted!r} (by an older version), so a message published while "
        "no consumer group is bound is refused instead of kept, unless a policy gives the "
        f"exchange that alternate exchange. Fix, with older agents still running: {policy} ; or, "
        f"once every party runs this version, delete the exchange (rabbitmqadmin delete "
        f"exchange name={events}) so that it is declared again, then restart the consumers so "
        "they bind their groups again"
    )


async def drain(
    connection: aio_pika.abc.AbstractConnection, name: str, group: str, *, step_timeout: float
) -> int:
    """Hand what waits in the catch-all queue ``name`` to the stream, now that ``group``'s
    queue is bound; how many messages were handed on.

    Only what was there when the drain began is handled, so a message that found no queue again
    (the group deleted meanwhile) cannot go round for ever; the drain also ends after a second
    without a delivery (another consumer drained the rest); ``step_timeout`` bounds each broker
    round trip. A failure (no read permission on the
    queue, the link lost) is logged and leaves the rest for the next declaration.

    The channel closes only once RabbitMQ has applied every rejection (:func:`_applied`): while
    ``quorum_commands_soft_limit`` (32) of a channel's commands to a quorum queue wait to be
    applied (a loaded broker), RabbitMQ holds the channel's further acks and rejections back,
    and drops them if the channel closes; a drain that closed right after its last rejection
    gave those messages back to the queue, to wait there for the next group declaration.
    """
    channel = aio_pika.Channel(connection, publisher_confirms=False)
    drained = 0
    try:
        await initialized(channel, step_timeout)
        async with asyncio.timeout(step_timeout):
            raw = await channel.get_underlay_channel()
            declared = await raw.queue_declare(name, passive=True)
        pending: int = declared.message_count or 0
        if not pending:
            return 0
        log.info(
            "%d message(s) published while no consumer group was bound wait in %r; group %r "
            "is bound now: handing them to the stream",
            pending,
            name,
            group,
        )
        tags: asyncio.Queue[int] = asyncio.Queue()
        consumer = f"drain-{uuid.uuid4().hex}"

        async def delivered(message: aiormq.abc.DeliveredMessage) -> None:
            tags.put_nowait(message.delivery_tag or 0)

        async with asyncio.timeout(step_timeout):
            await raw.basic_qos(prefetch_count=min(pending, _PREFETCH))
            await raw.basic_consume(name, delivered, no_ack=False, consumer_tag=consumer)
        while drained < pending:
            try:
                async with asyncio.timeout(_IDLE):
                    tag = await tags.get()
            except TimeoutError:
                break
            drained += 1
            while drained < pending and not tags.empty():
                tag = tags.get_nowait()
                drained += 1
            # Rejected, not requeued: dead-lettered into the stream. One frame for the batch.
            await raw.basic_nack(tag, multiple=True, requeue=False)
        async with asyncio.timeout(step_timeout):
            await raw.basic_cancel(consumer)
        # What came after the last rejection (every delivery is in by the CancelOk): handed on
        # while the count allows, the rest back to the queue for the next declaration.
        late = [tags.get_nowait() for _ in range(tags.qsize())]
        handed = late[: pending - drained]
        if handed:
            await raw.basic_nack(handed[-1], multiple=True, requeue=False)
            drained += len(handed)
        if len(late) > len(handed):
            await raw.basic_nack(late[-1], multiple=True, requeue=True)
        await _applied(raw, name, declared.consumer_count or 0, step_timeout)
    except asyncio.CancelledError as exc:
        if not is_spurious_cancel(exc):
            raise
        log.warning("draining %r was cut off (link lost): the rest waits there", name)
    except FAILURES as exc:
        log.warning(
            "draining %r for group %r stopped after %d message(s) (%s): the rest waits there for "
            "the next group declaration (a consumer needs read permission on it)",
            name,
            group,
            drained,
            reason(exc),
        )
    else:
        if drained:
            log.info("handed %d message(s) from %r to the stream", drained, name)
    finally:
        # Deliveries not rejected yet go back to the queue with the channel.
        if not channel.is_closed:
            try:
                await unabandoned(channel.close(), _CLOSE_TIMEOUT)
            except FAILURES as exc:
                log.debug("closing the drain channel of %r failed (%s)", name, reason(exc))
    return drained


async def _applied(
    raw: aiormq.abc.AbstractChannel,
    name: str,
    others: int,
    timeout: float,  # noqa: ASYNC109
) -> None:
    """Wait until RabbitMQ applied every ack and rejection of the drain's cancelled consumer
    on the quorum queue ``name``: the queue counts it among its consumers until then. There
    were ``others`` consumers before the drain's. Longer than ``timeout`` is logged (the
    channel then closes all the same, and what RabbitMQ still held goes back to the queue)."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                declared = await raw.queue_declare(name, passive=True)
                if (declared.consumer_count or 0) <= others:
                    return
                await asyncio.sleep(_POLL)
    except TimeoutError:
        log.warning(
            "RabbitMQ had not applied every rejection of the drain of %r within %g s: the "
            "messages it still holds go back there when the drain's channel closes, and wait "
            "for the next group declaration",
            name,
            timeout,
        )
