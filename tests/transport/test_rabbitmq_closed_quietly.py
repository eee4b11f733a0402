"""A connection that ends without an error is a lost link like any other: aiormq fails every
publish still waiting for its confirm there with a bare ``Exception`` (its connection closed
from this side: the reader stops at the broker's Close-Ok and passes no error on). The fault
storm met it: the approver's detached send task died with ``Exception()`` ("Task exception was
never retrieved") and its approvals were neither confirmed nor sent again. Against the real
broker through a TCP proxy that holds the confirm back while the connection is closed."""

from __future__ import annotations

import asyncio

import pytest

from schemas import TransportError
from schemas.transport.rabbitmq import AmqpSettings

from ._helpers import outgoing, proxied_rabbitmq, receive

pytestmark = pytest.mark.rabbitmq


async def test_a_publish_on_a_connection_closed_without_an_error_is_sent_again(
    amqp_url: str, unique: str
) -> None:
    settings = AmqpSettings(connect_timeout=2, reconnect_timeout=20, confirm_timeout=5)
    async with proxied_rabbitmq(amqp_url, unique, settings) as (proxy, transport):
        await transport.declare_group("g")
        async with transport.subscribe("g", prefetch=4) as subscription:
            _, channel = transport._require()
            connection = (await channel.get_underlay_channel()).connection
            proxy.pause()  # the confirm is held back: the publish waits for it
            publishing = asyncio.create_task(transport.publish(outgoing("held")))
            await asyncio.sleep(0.3)
            # aiormq's own close with no error, as its reader passes on at a Close-Ok.
            closing = asyncio.create_task(connection.close(None))
            await asyncio.sleep(0.3)
            proxy.resume()
            await publishing  # before: raised Exception()
            await asyncio.gather(closing, return_exceptions=True)
            delivery = await receive(subscription, within=20)
            assert delivery.body == b"held"
            await delivery.ack()


async def test_opening_a_subscription_on_a_connection_closed_without_an_error_is_a_lost_link(
    amqp_url: str, unique: str
) -> None:
    """The same bare ``Exception`` reaches what waits for the broker's answer while a
    subscription opens (its queue's declaration, its channel): a lost link, for the caller to
    open it again (the agent's approvals loop does), not an error that ends the agent."""
    settings = AmqpSettings(connect_timeout=2, reconnect_timeout=20, confirm_timeout=5)
    async with proxied_rabbitmq(amqp_url, unique, settings) as (proxy, transport):
        _, channel = transport._require()
        connection = (await channel.get_underlay_channel()).connection
        proxy.pause()  # the broker's answers are held back: the opening waits for them

        async def open_approvals() -> None:
            async with transport.approvals("web-1"):
                pass

        opening = asyncio.create_task(open_approvals())
        await asyncio.sleep(0.3)
        closing = asyncio.create_task(connection.close(None))
        await asyncio.sleep(0.3)
        proxy.resume()
        with pytest.raises(TransportError):  # before: Exception()
            await opening
        await asyncio.gather(closing, return_exceptions=True)
        await open_approvals()  # once the link is back, it opens
        await transport.delete_topology(vms=["web-1"])
