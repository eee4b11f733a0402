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
from schemas.transport import Delivery
from schemas.transport.rabbitmq import AmqpSettings, RabbitMQTransport

from ._helpers import assert_nothing, outgoing, receive
from .proxy import TcpProxy

pytestmark = pytest.mark.rabbitmq

BOUND = 60
SETTINGS = AmqpSettings(connect_timeout=2, reconnect_timeout=20, confirm_timeout=5)


def _through(amqp_url: str, port: int) -> str:
    split = urlsplit(amqp_url)
    netloc = f"{split.username}:{split.password}@127.0.0.1:{port}"
    return split._replace(netloc=netloc).geturl()


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
        RabbitMQTransport(_through(amqp_url, proxy.port), channels, settings=SETTINGS) as consumer,
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
        RabbitMQTransport(_through(amqp_url, proxy.port), channels, settings=SETTINGS) as consumer,
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
