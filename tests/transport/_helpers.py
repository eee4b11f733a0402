"""Small helpers the transport tests share: messages to send, bounded receives."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from schemas.channels import ChannelNames
from schemas.transport import Delivery, OutgoingMessage
from schemas.transport.rabbitmq import AmqpSettings, RabbitMQTransport

from .proxy import TcpProxy

__all__ = ["assert_nothing", "outgoing", "proxied_rabbitmq", "receive", "via_proxy"]


def outgoing(
    body: str = "hello",
    *,
    routing_key: str = "scheduled.Reboot.vm-1",
    properties: dict[str, str | int | float | bool] | None = None,
    ttl_seconds: float | None = None,
) -> OutgoingMessage:
    return OutgoingMessage(
        body=body.encode(),
        message_id=uuid.uuid4().hex,
        content_type="application/json",
        routing_key=routing_key,
        properties=properties or {"vm": "vm-1"},
        ttl_seconds=ttl_seconds,
    )


async def receive(subscription: Any, within: float = 5.0) -> Delivery:
    """The next delivery, or a test failure after ``within`` seconds."""
    try:
        async with asyncio.timeout(within):
            delivery: Delivery = await anext(subscription)
    except TimeoutError:
        raise AssertionError(f"no message within {within} s") from None
    return delivery


async def assert_nothing(subscription: Any, seconds: float = 0.5) -> None:
    """Nothing arrives within ``seconds`` (the subscription must already be started)."""
    task = asyncio.ensure_future(anext(subscription))
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if done:
        delivery = task.result()
        raise AssertionError(f"unexpected message {delivery.message_id}: {delivery.body!r}")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def via_proxy(amqp_url: str, port: int) -> str:
    """``amqp_url`` with its credentials, to a :class:`~.proxy.TcpProxy` on loopback ``port``."""
    split = urlsplit(amqp_url)
    netloc = f"{split.username}:{split.password}@127.0.0.1:{port}"
    return split._replace(netloc=netloc).geturl()


@contextlib.asynccontextmanager
async def proxied_rabbitmq(
    amqp_url: str, unique: str, settings: AmqpSettings, *, within: float = 60
) -> AsyncIterator[tuple[TcpProxy, RabbitMQTransport]]:
    """A RabbitMQ transport (channels suffixed ``unique``) connected through a
    :class:`~.proxy.TcpProxy` the test cuts, pauses or resets; its group ``g`` and exchanges are
    deleted afterwards, and the whole is bounded by ``within`` seconds."""
    split = urlsplit(amqp_url)
    async with (
        asyncio.timeout(within),
        TcpProxy(split.hostname or "127.0.0.1", split.port or 5672) as proxy,
    ):
        channels = ChannelNames().suffixed(unique)
        transport = RabbitMQTransport(via_proxy(amqp_url, proxy.port), channels, settings=settings)
        async with transport:
            try:
                yield proxy, transport
            finally:
                await transport.delete_topology(groups=["g"], exchanges=True)
