"""A link that drops while a channel opens is a lost link (TransportError), like any other.

aiormq raises a bare ``RuntimeError("<Connection ...> closed")`` when a channel is opened on a
connection that has closed and not reconnected yet. In a 10,000-VM fleet run that escaped the
agents' approvals listener (the link dropped between declaring an agent's approvals queue and
consuming it) and ended a thousand agents at once: every caller retries a TransportError, none
expects a RuntimeError.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import pytest

from schemas import TransportError
from schemas.channels import ChannelNames
from schemas.transport.rabbitmq import AmqpSettings, RabbitMQTransport

from ._helpers import outgoing, receive
from .proxy import TcpProxy

BOUND = 60


def _through(amqp_url: str, port: int) -> str:
    split = urlsplit(amqp_url)
    netloc = f"{split.username}:{split.password}@127.0.0.1:{port}"
    return split._replace(netloc=netloc).geturl()


@pytest.mark.rabbitmq
async def test_a_subscription_opened_while_the_link_is_down_fails_as_a_lost_link(
    amqp_url: str, unique: str
) -> None:
    split = urlsplit(amqp_url)
    channels = ChannelNames().suffixed(unique)
    settings = AmqpSettings(connect_timeout=2, reconnect_timeout=5, confirm_timeout=2)
    async with (
        asyncio.timeout(BOUND),
        TcpProxy(split.hostname or "127.0.0.1", split.port or 5672) as proxy,
    ):
        transport = RabbitMQTransport(_through(amqp_url, proxy.port), channels, settings=settings)
        async with transport:
            try:
                await proxy.cut()
                await asyncio.sleep(0.2)  # the reset has reached the connection
                # A transient subscription declares nothing first: it opens its channel at
                # once, on the connection that has just closed.
                with pytest.raises(TransportError, match="link closed before a channel opened"):
                    async with transport.subscribe("g", transient=True):
                        pass
                # The caller's retry, once the link is back (the robust connection reconnects
                # after its interval), consumes as usual.
                await proxy.restore()
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 20
                message = outgoing("after the link came back")
                while True:
                    try:
                        async with transport.subscribe("g", transient=True) as subscription:
                            await transport.publish(message)
                            delivery = await receive(subscription, within=10)
                            await delivery.ack()
                        break
                    except TransportError:
                        if loop.time() > deadline:
                            raise
                        await asyncio.sleep(0.5)
                assert delivery.message_id == message.message_id
            finally:
                await transport.delete_topology(exchanges=True)
