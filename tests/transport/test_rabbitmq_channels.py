"""One channel's end costs that channel, never the connection the others share.

Many agents share one AMQP connection (``tests/benchmarks/fleet.py``: 500 to a connection), so
whatever one channel does after the broker or the client closed it is everyone's problem:
RabbitMQ answers any frame on a channel number it has already forgotten with a connection
error (``CHANNEL_ERROR - expected 'channel.open'``), and every channel on the connection goes
with it. These tests churn channels on one connection the ways the transport does, with the
broker closing some of them, and check that the link stays up."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest

from schemas import PublishNotConfirmed, TransportError
from schemas.channels import ChannelNames
from schemas.transport import Delivery
from schemas.transport.rabbitmq import AmqpSettings, RabbitMQTransport

from ._helpers import assert_nothing, outgoing, receive, via_proxy
from ._rabbitmqctl import BrokerUser, rabbitmqctl
from .proxy import TcpProxy

pytestmark = pytest.mark.rabbitmq

BOUND = 60
SETTINGS = AmqpSettings(connect_timeout=3, reconnect_timeout=5, confirm_timeout=5)


def _said(caplog: pytest.LogCaptureFixture, words: str) -> list[str]:
    """What the transport logged with ``words`` in it (only its own records are formatted:
    aio-pika's may no longer format once their callbacks ran)."""
    ours = (r.getMessage() for r in caplog.records if r.name.startswith("schemas."))
    return [text for text in ours if words in text]


def _lost_links(caplog: pytest.LogCaptureFixture) -> list[str]:
    return _said(caplog, "lost the link")


@pytest.fixture
async def central(amqp_url: str, unique: str) -> AsyncIterator[RabbitMQTransport]:
    """The central side, as guest; deletes the test's entities afterwards."""
    channels = ChannelNames().suffixed(unique)
    async with RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as transport:
        try:
            yield transport
        finally:
            await transport.delete_topology(groups=["audit"], vms=["vm-a"], exchanges=True)


@pytest.fixture
async def agents(
    amqp_url: str, alice: BrokerUser, central: RabbitMQTransport
) -> AsyncIterator[RabbitMQTransport]:
    """Agents sharing one connection as ``alice``, whose topic permissions allow only vm-a's
    routing keys on the events exchange (so a vm-b message is refused); the audit group is
    declared."""
    events = central.channels.events_exchange
    await rabbitmqctl("set_topic_permissions", "-p", "/", alice.name, events, r"^.*\.vm-a$", ".*")
    await central.declare_group("audit")
    async with RabbitMQTransport(
        alice.url(amqp_url), central.channels, settings=SETTINGS
    ) as shared:
        yield shared


async def test_a_refused_publish_does_not_close_the_connection_its_neighbours_share(
    central: RabbitMQTransport, agents: RabbitMQTransport, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker closes the publishing channel for a message it refuses (here a routing key
    the user's topic permissions forbid), and the robust channel reopens for the next. The
    agents sharing the connection keep publishing meanwhile: aiormq sent the publishes made
    between its ``Channel.CloseOk`` and the channel's closing on the channel the broker had
    just forgotten, and RabbitMQ closed the whole connection (``CHANNEL_ERROR - expected
    'channel.open'``, caused by ``basic.publish``): every agent on it lost its link, the
    approvals consumer with them. Now a publish that comes after the channel's end is not
    sent there but again on the reopened channel, the link stays up and the consumer on it
    is never interrupted. (A neighbour whose message was already on the channel when the
    broker closed it is published again: the next test.)"""
    caplog.set_level(logging.INFO, logger="schemas.transport")
    async with asyncio.timeout(BOUND):
        async with agents.approvals("vm-a") as approvals:
            confirmed = refused = 0
            stop = asyncio.Event()

            async def neighbour() -> None:
                nonlocal confirmed
                while not stop.is_set():
                    with contextlib.suppress(PublishNotConfirmed):
                        await agents.publish(outgoing(routing_key="started.Reboot.vm-a"))
                        confirmed += 1

            async def refusals() -> None:
                nonlocal refused
                for _ in range(40):
                    with pytest.raises(PublishNotConfirmed, match="ACCESS_REFUSED"):
                        await agents.publish(outgoing(routing_key="started.Reboot.vm-b"))
                    refused += 1
                    if _lost_links(caplog):
                        break
                stop.set()

            await asyncio.gather(refusals(), *(neighbour() for _ in range(20)))
            assert not _lost_links(caplog), f"after {refused} refusals"
            assert refused == 40
            assert confirmed > 40
            # The consumer sharing the connection was never cut off: it still gets approvals.
            await central.send_approval(agents.reply_address("vm-a"), sent := outgoing("approve"))
            delivery = await receive(approvals)
            await delivery.ack()
        assert delivery.message_id == sent.message_id
        await agents.delete_topology(vms=["vm-a"])
    assert not _said(caplog, "again after a reconnect")


async def test_settling_while_a_subscription_closes_does_not_close_the_connection(
    amqp_url: str, central: RabbitMQTransport, caplog: pytest.LogCaptureFixture
) -> None:
    """A consumer that settles deliveries while its subscription closes (a stop that finds
    workers still acking, a subscription closed while its deliveries are being handled):
    aiormq sent the acks made while the subscription's ``Channel.Close`` waited for the
    broker's ``CloseOk`` after the Close, on a channel RabbitMQ had already forgotten, and it
    closed the whole connection (``expected 'channel.open'``, caused by ``basic.ack``). Such an
    ack now fails as one from a closed channel and the broker delivers the message again; an
    ack made before the close goes through; the connection carries on."""
    caplog.set_level(logging.INFO, logger="schemas.transport")
    pending = 40
    # Each round hands the unacked deliveries back: no dead-lettering for that here.
    settings = dataclasses.replace(SETTINGS, delivery_limit=1000)
    outcomes: list[str] = []

    async def ack_later(delivery: Delivery, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            await delivery.ack()
        except TransportError:
            outcomes.append("refused")
        else:
            outcomes.append("acked")

    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(amqp_url, central.channels, settings=settings) as consumer,
    ):
        await consumer.declare_group("audit")
        await asyncio.gather(*(consumer.publish(outgoing(str(n))) for n in range(pending)))
        for _ in range(30):
            subscription = consumer.subscribe("audit", prefetch=pending)
            await subscription.start()
            deliveries = [await receive(subscription) for _ in range(20)]
            before = outcomes.count("acked")
            acks = [
                asyncio.create_task(ack_later(delivery, n * 0.0002))
                for n, delivery in enumerate(deliveries)
            ]
            await subscription.close()
            await asyncio.gather(*acks)
            # What was acked is gone: publish as much again for the next round.
            acked = outcomes.count("acked") - before
            await asyncio.gather(*(consumer.publish(outgoing("more")) for _ in range(acked)))
            if _lost_links(caplog):
                break
        assert not _lost_links(caplog)
        # The acks straddled the closes: some went before, some came after.
        assert "acked" in outcomes
        assert "refused" in outcomes
        # What was not acked was handed back: all of it is still there, once.
        async with consumer.subscribe("audit", prefetch=pending) as subscription:
            for _ in range(pending):
                await (await receive(subscription)).ack()
            await assert_nothing(subscription, 0.3)


async def test_a_refused_message_costs_that_message_not_its_neighbours_on_the_channel(
    central: RabbitMQTransport, agents: RabbitMQTransport
) -> None:
    """When the broker refuses a message it closes the channel, and aiormq fails every publish
    still waiting for its confirm there with that message's refusal: a neighbour that did
    nothing wrong was told PublishNotConfirmed, "ACCESS_REFUSED - access to topic
    '...vm-b'", for a message of vm-a (and, for a message over the broker's size limit,
    MessageRefused: its sender set it aside for good, a transition lost). Now a publish is
    refused only when the broker's words are about it (its routing key, its size, its
    user_id); another message's refusal is a lost channel for it, and it is published again
    once the channel reopens."""
    async with asyncio.timeout(BOUND):
        blamed: list[str] = []
        refused = 0

        async def neighbour(n: int) -> None:
            for k in range(15):
                try:
                    good = outgoing(f"good-{n}-{k}", routing_key="started.Reboot.vm-a")
                    await agents.publish(good)
                except PublishNotConfirmed as exc:
                    blamed.append(str(exc))

        async def refusals() -> None:
            nonlocal refused
            for _ in range(20):
                with pytest.raises(PublishNotConfirmed, match="ACCESS_REFUSED"):
                    await agents.publish(outgoing(routing_key="started.Reboot.vm-b"))
                refused += 1

        await asyncio.gather(refusals(), *(neighbour(n) for n in range(20)))
        assert refused == 20
        assert blamed == []
        # Every good message reached the group's queue (some perhaps twice: at least once).
        got: set[str] = set()
        async with central.subscribe("audit", prefetch=400) as subscription:
            while len(got) < 300:
                delivery = await receive(subscription)
                got.add(delivery.body.decode())
                await delivery.ack()
        assert got == {f"good-{n}-{k}" for n in range(20) for k in range(15)}


async def test_a_subscription_closed_past_its_deadline_does_not_stall_the_connection(
    amqp_url: str, central: RabbitMQTransport, caplog: pytest.LogCaptureFixture
) -> None:
    """A subscription closes while its link is stalled (paused here by a TCP proxy), longer
    than aiormq waits for the broker's ``CloseOk`` (the heartbeat), and the broker had sent
    it deliveries meanwhile (up to its prefetch, 256). aiormq then gives the channel up: its
    reader stops, but the connection still routes the channel's frames to it until the
    ``CloseOk``, which comes after those deliveries. Its frame queue held 10: the 11th frame
    left the connection's only reader waiting for room nobody would make, so once the link
    came back nothing more arrived on *any* channel of the connection (no confirm, no
    approval, not the ``CloseOk``) until the heartbeat check gave the connection up (3 x
    (heartbeat + 1) s; 93 s with the default 30). Now the channel's frames queue without
    bound (the broker sends a channel at most its prefetch of deliveries, a confirm per
    publish in flight, an answer per request), and the connection carries on at once."""
    caplog.set_level(logging.INFO, logger="schemas.transport")
    loop = asyncio.get_running_loop()
    settings = dataclasses.replace(SETTINGS, heartbeat=2)
    split = urlsplit(amqp_url)
    async with (
        asyncio.timeout(BOUND),
        TcpProxy(split.hostname or "127.0.0.1", split.port or 5672) as proxy,
    ):
        through = via_proxy(amqp_url, proxy.port)
        async with (
            RabbitMQTransport(through, central.channels, settings=settings) as consumer,
            consumer.approvals("vm-a") as approvals,
        ):
            await central.declare_group("audit")
            subscription = consumer.subscribe("audit", prefetch=256)
            await subscription.start()
            await consumer.publish(outgoing("before"))
            await (await receive(subscription)).ack()

            proxy.pause()
            await asyncio.gather(*(central.publish(outgoing("queued")) for _ in range(600)))
            started = loop.time()
            await subscription.close()
            closing = loop.time() - started
            proxy.resume()
            resumed = loop.time()

            await central.send_approval(consumer.reply_address("vm-a"), sent := outgoing("go"))
            try:
                delivery = await receive(approvals, within=3)
                async with asyncio.timeout(3):
                    await consumer.publish(outgoing("after"))
            finally:
                print(
                    f"\nclose took {closing:.2f} s (aiormq waits {settings.heartbeat} s for "
                    f"the CloseOk); the approval and a confirm came "
                    f"{loop.time() - resumed:.2f} s after the link did"
                )
            await delivery.ack()
        assert delivery.message_id == sent.message_id
        assert not _lost_links(caplog)
