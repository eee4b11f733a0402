"""Fixtures for the agent's tests: a broker URL per backend, with unique names, cleaned up."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from schemas.channels import ChannelNames, vm_word

from .harness import GROUP


@dataclass(frozen=True)
class Broker:
    url: str
    channels: ChannelNames
    kind: str


async def delete_rabbitmq_entities(url: str, channels: ChannelNames, vms: list[str]) -> None:
    """Delete what a test's agents and consumers declared (names are unique to the test)."""
    import aio_pika

    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        dead = f"{channels.group_prefix}{GROUP}.dead-letter"
        queues = [f"{channels.group_prefix}{GROUP}", dead]
        queues += [f"{channels.vm_prefix}{vm_word(vm)}" for vm in vms]
        queues.append(channels.unrouted)
        for name in queues:
            channel = await connection.channel()
            with contextlib.suppress(aio_pika.exceptions.AMQPError):
                await channel.queue_delete(name)
        for name in (
            channels.events_exchange,
            channels.approvals_exchange,
            dead,
            channels.unrouted,
        ):
            channel = await connection.channel()
            with contextlib.suppress(aio_pika.exceptions.AMQPError):
                await channel.exchange_delete(name)


@pytest.fixture(params=["memory", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
async def broker(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Broker]:
    """The same test against the in-memory broker and the real RabbitMQ."""
    channels = ChannelNames().suffixed(unique)
    if request.param == "memory":
        yield Broker(f"memory://test-{unique}", channels, "memory")
        return
    pytest.importorskip(
        "schemas.transport.rabbitmq", reason="the RabbitMQ transport is not there yet"
    )
    url: str = request.getfixturevalue("amqp_url")
    try:
        yield Broker(url, channels, "rabbitmq")
    finally:
        await delete_rabbitmq_entities(url, channels, ["web-7", "web-8", "web-9"])
