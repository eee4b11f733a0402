"""The RabbitMQ consumer on aiormq's channel: it consumes again by itself after a reconnect,
never acks a delivery from a lost channel on the new one, ends when the broker cancels it, and
transient subscriptions leave no queue behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aio_pika
import aiormq.exceptions
import pytest

from schemas import TransportError
from schemas.channels import ChannelNames
from schemas.transport import (
    DEAD_LETTER_DESCRIPTION,
    DEAD_LETTER_REASON,
    ORIGINAL_SENDER,
    Delivery,
)
from schemas.transport.rabbitmq import AmqpSettings, RabbitMQTransport

from ._helpers import assert_nothing, outgoing, receive, via_proxy
from .proxy import TcpProxy

pytestmark = pytest.mark.rabbitmq

BOUND = 60
SETTINGS = AmqpSettings(connect_timeout=2, reconnect_timeout=20, confirm_timeout=5)


@pytest.fixture
async def proxy(amqp_url: str) -> AsyncIterator[TcpProxy]:
    split = urlsplit(amqp_url)
    async with TcpProxy(split.hostname or "127.0.0.1", split.port or 5672) as running:
        yield running


async def _queue_exists(amqp_url: str, name: str) -> bool:
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        try:
            await channel.declare_queue(name, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        except aiormq.exceptions.ChannelLockedResource:
            return True  # exclusive to another connection: it exists
        return True
    finally:
        await connection.close()


async def _publish_until_received(
    transport: RabbitMQTransport, subscription: object, within: float = 20
) -> tuple[set[str], Delivery]:
    """Publish until ``subscription`` receives one (while its queue is not back, what is
    published goes to the catch-all queue); the ids published, and the delivery."""
    sent: set[str] = set()
    async with asyncio.timeout(within):
        while True:
            message = outgoing("after the reconnect")
            try:
                await transport.publish(message)
            except TransportError:
                await asyncio.sleep(0.2)
                continue
            sent.add(message.message_id)
            try:
                return sent, await receive(subscription, within=0.5)
            except AssertionError:
                continue


async def test_a_delivery_from_a_lost_channel_is_not_acked_on_the_new_one(
    amqp_url: str, unique: str, proxy: TcpProxy
) -> None:
    channels = ChannelNames().suffixed(unique)
    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as publisher,
        RabbitMQTransport(via_proxy(amqp_url, proxy.port), channels, settings=SETTINGS) as consumer,
    ):
        try:
            await publisher.declare_group("g")
            async with consumer.subscribe("g", prefetch=4) as subscription:
                sent = outgoing("held across the cut")
                await publisher.publish(sent)
                held = await receive(subscription)
                assert held.delivery_count == 0
                await proxy.cut()
                await asyncio.sleep(0.3)
                await proxy.restore()
                with pytest.raises(TransportError, match="channel closed"):
                    await held.ack()
                # The consumer came back by itself: the broker hands the message out again,
                # and new messages flow.
                again = await receive(subscription, within=20)
                assert again.message_id == sent.message_id
                assert again.delivery_count >= 1
                await again.ack()
                await publisher.publish(later := outgoing("later"))
                fresh = await receive(subscription, within=10)
                assert fresh.message_id == later.message_id
                await fresh.ack()
                await assert_nothing(subscription, 0.3)
        finally:
            await publisher.delete_topology(groups=["g"], exchanges=True)


async def test_deleting_the_queue_ends_the_subscription(amqp_url: str, unique: str) -> None:
    channels = ChannelNames().suffixed(unique)
    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as transport,
    ):
        try:
            async with transport.subscribe("g") as subscription:
                await transport.publish(outgoing())
                await (await receive(subscription)).ack()
                await transport.delete_topology(groups=["g"])
                with pytest.raises(TransportError, match="cancelled the consumer"):
                    await receive(subscription)
                with pytest.raises(TransportError):  # and it stays ended
                    await receive(subscription)
        finally:
            await transport.delete_topology(groups=["g"], exchanges=True)


async def test_a_transient_subscription_sees_the_stream_and_leaves_no_queue(
    amqp_url: str, unique: str
) -> None:
    channels = ChannelNames().suffixed(unique)
    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as transport,
    ):
        try:
            await transport.declare_group("audit")
            await transport.publish(outgoing("before tail started"))
            one = transport.subscribe("tail", transient=True)
            two = transport.subscribe("tail", transient=True)
            async with one, two:
                assert one.queue_name != two.queue_name
                assert await _queue_exists(amqp_url, one.queue_name)
                sent = outgoing("while tail runs")
                await transport.publish(sent)
                for subscription in (one, two):  # every transient reader sees every message
                    delivery = await receive(subscription)
                    assert delivery.message_id == sent.message_id
                    await delivery.ack()
                await assert_nothing(one, 0.2)
            for subscription in (one, two):
                assert not await _queue_exists(amqp_url, subscription.queue_name)
            # No durable group was created for it either: only the audit group remains bound.
            assert not await _queue_exists(amqp_url, transport.group_queue("tail"))
            assert await _queue_exists(amqp_url, transport.group_queue("audit"))
        finally:
            await transport.delete_topology(groups=["audit", "tail"], exchanges=True)


async def test_a_transient_subscription_comes_back_after_a_cut_link(
    amqp_url: str, unique: str, proxy: TcpProxy
) -> None:
    channels = ChannelNames().suffixed(unique)
    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as publisher,
        RabbitMQTransport(via_proxy(amqp_url, proxy.port), channels, settings=SETTINGS) as consumer,
    ):
        try:
            async with consumer.subscribe("tail", transient=True) as subscription:
                name = subscription.queue_name
                await proxy.cut()
                await asyncio.sleep(0.3)
                await proxy.restore()
                # Its exclusive queue went with the old connection; the reconnect declares it
                # again, and messages published from then on are shown.
                sent, delivery = await _publish_until_received(publisher, subscription)
                assert delivery.message_id in sent
                await delivery.ack()
                assert await _queue_exists(amqp_url, name)
            assert not await _queue_exists(amqp_url, name)
        finally:
            await publisher.delete_topology(exchanges=True)


async def test_a_dead_letter_names_the_reason_and_sender_the_broker_knows_not_its_headers(
    amqp_url: str, unique: str
) -> None:
    """A publisher may write headers named like the ones a dead letter is read by: a forged
    sender stayed on a consumer's copy of a message that had no validated sender, and on one
    the broker dead-lettered itself (delivery limit) a forged reason hid the broker's and a
    forged sender the validated one. An operator looking for who sent a bad message was
    pointed at another VM."""
    channels = ChannelNames().suffixed(unique)
    settings = AmqpSettings(delivery_limit=1, reconnect_timeout=5, confirm_timeout=5)
    forged: dict[str, str | int | float | bool] = {
        ORIGINAL_SENDER: "web-7",
        DEAD_LETTER_REASON: "forged",
        DEAD_LETTER_DESCRIPTION: "forged",
    }
    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(amqp_url, channels, settings=settings) as t,
    ):
        try:
            await t.declare_group("g")
            # No user_id: no sender the broker vouches for.
            connection = await aio_pika.connect(amqp_url)
            async with connection, connection.channel() as channel:
                exchange = await channel.get_exchange(channels.events_exchange)
                await exchange.publish(
                    aio_pika.Message(b"anonymous", headers={**forged}), "scheduled.Reboot.vm-1"
                )
            await t.publish(outgoing("validated", properties=forged))  # user_id guest
            async with t.subscribe("g") as subscription:
                for _ in range(3):
                    delivery = await receive(subscription)
                    if delivery.body == b"anonymous":
                        await delivery.dead_letter("not-json", "not JSON")
                    else:
                        await delivery.retry()  # twice: over the delivery limit
            letters = {}
            async with t.dead_letters("g") as dead:
                for _ in range(2):
                    letter = await receive(dead)
                    letters[letter.body] = dict(letter.properties)
                    await letter.ack()
        finally:
            await t.delete_topology(groups=["g"], exchanges=True)
    anonymous, validated = letters[b"anonymous"], letters[b"validated"]
    assert anonymous[DEAD_LETTER_REASON] == "not-json"
    assert ORIGINAL_SENDER not in anonymous
    assert validated[DEAD_LETTER_REASON] == "delivery_limit"
    assert validated[ORIGINAL_SENDER] == "guest"
