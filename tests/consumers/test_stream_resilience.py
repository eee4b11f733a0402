"""A broker failure while settling never ends a consumer: the stream opens its subscription
again, the broker delivers what was not settled once more, and the dedupe window keeps each
message to one handling. RabbitMQ behind a TCP proxy that cuts the link mid-stream."""

from __future__ import annotations

import asyncio
import uuid
from urllib.parse import urlsplit

import pytest

from consumers import FleetStream
from schemas import ChannelNames, LifecycleMessage
from schemas.transport.rabbitmq import RabbitMQTransport
from schemas.wire import lifecycle_message
from tests.transport.proxy import TcpProxy

from ._factory import event, transition, vm

pytestmark = [pytest.mark.rabbitmq]


async def test_a_link_cut_while_acking_reconnects_and_every_message_is_handled_once(
    amqp_url: str,
) -> None:
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:10])
    split = urlsplit(amqp_url)
    messages = [
        transition("scheduled", event(f"EVT-{n}", resources=("web-1",)), vm("web-1"), sequence=n)
        for n in range(30)
    ]
    seen: list[str] = []
    async with (
        TcpProxy(split.hostname or "127.0.0.1", split.port or 5672) as proxy,
        RabbitMQTransport(amqp_url, channels) as publisher,
    ):
        proxied = f"amqp://guest:guest@127.0.0.1:{proxy.port}/?reconnect_interval=0.2"
        try:
            async with RabbitMQTransport(proxied, channels) as consumer:
                await consumer.declare_group("audit")
                for message in messages:
                    await publisher.publish(lifecycle_message(message))
                # Settle one at a time: every ack goes to the broker, and one is cut off.
                stream = FleetStream(consumer, "audit", prefetch=4, ack_batch=1)
                cut = asyncio.Event()

                @stream.on()
                async def handle(message: LifecycleMessage) -> None:
                    seen.append(message.id)
                    if len(seen) == 10 and not cut.is_set():
                        cut.set()
                        await proxy.cut()
                        asyncio.get_running_loop().call_later(
                            2.0, lambda: asyncio.ensure_future(proxy.restore())
                        )
                    if len(set(seen)) == len(messages):
                        stream.stop()

                async with asyncio.timeout(40):
                    await stream.run()
        finally:
            await publisher.delete_topology(groups=["audit"], exchanges=True)
    assert set(seen) == {m.id for m in messages}
    assert len(seen) == len(messages), "a message reached the handler twice"
    assert stream.stats.reconnects >= 1
