"""The brokers the transport contract suite runs against, one factory each.

To add a backend, write an ``async`` context manager that yields a :class:`Backend` and
register it in :data:`BACKENDS` with the pytest marks it needs; every contract test then runs
against it too. Where brokers legitimately differ, :class:`Backend` says how (a flag), and the
test branches on that flag, never on the backend's name.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import pytest

from schemas.channels import ChannelNames
from schemas.transport import MemoryBroker, MemoryTransport, OutgoingMessage, Transport

from ._helpers import outgoing, via_proxy

__all__ = ["BACKENDS", "Backend", "closed_port"]


@dataclass
class Backend:
    """One broker for one test: fresh transports on it, and the names to delete afterwards."""

    name: str
    channels: ChannelNames
    #: A new, unconnected transport on the test's broker (each one plays one process).
    make: Callable[[], Transport]
    #: A transport whose broker cannot be reached, where that can happen at all.
    unreachable: Callable[[], Transport] | None = None
    #: An approval to a VM that never declared its queue raises PublishNotConfirmed (RabbitMQ:
    #: mandatory + unroutable); elsewhere it waits for the VM.
    unroutable_approval_raises: bool = False
    #: Who the broker says published what these transports publish (``Delivery.sender``).
    sender: str | None = None
    #: Why this broker drops what is published while no consumer group exists, where it does;
    #: None: it keeps it for the first group declared.
    drops_without_groups: str | None = None
    #: Makes the broker refuse one message (from ``transport``), and returns it.
    refused_message: Callable[[Any], Awaitable[OutgoingMessage]] | None = None
    #: That refusal is final (:class:`~schemas.MessageRefused`: too large), not a nack.
    refuses_for_good: bool = False
    #: Where the broker listens, for a TCP proxy between it and a transport; None: no link.
    address: tuple[str, int] | None = None
    #: A new transport to the broker at ``127.0.0.1:<port>`` (the proxy in front of it).
    via: Callable[[int], Transport] | None = None
    groups: set[str] = field(default_factory=set)
    vms: set[str] = field(default_factory=set)

    def group(self, name: str) -> str:
        self.groups.add(name)
        return name

    def vm(self, name: str) -> str:
        self.vms.add(name)
        return name

    @contextlib.asynccontextmanager
    async def transport(self) -> AsyncIterator[Any]:
        async with self.make() as transport:
            yield transport


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


#: The user the memory backend's transports publish as (``memory://USER@NAME``).
MEMORY_USER = "contract-user"


@contextlib.asynccontextmanager
async def memory_backend(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Backend]:
    name = f"contract-{unique}"
    channels = ChannelNames().suffixed(unique)

    async def oversized(transport: Any) -> OutgoingMessage:
        return outgoing("x" * (MemoryBroker.named(name).max_message_bytes + 1))

    try:
        yield Backend(
            "memory",
            channels,
            lambda: MemoryTransport(name, channels, user=MEMORY_USER),
            sender=MEMORY_USER,
            refused_message=oversized,
            refuses_for_good=True,
        )
    finally:
        MemoryBroker.discard(name)


@contextlib.asynccontextmanager
async def rabbitmq_backend(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Backend]:
    from schemas.transport.rabbitmq import AmqpSettings, RabbitMQTransport

    url: str = request.getfixturevalue("amqp_url")
    split = urlsplit(url)
    channels = ChannelNames().suffixed(unique)
    settings = AmqpSettings(connect_timeout=3, reconnect_timeout=5, confirm_timeout=5)
    refusing = f"{channels.group_prefix}refusing"

    async def nacked(transport: Any) -> OutgoingMessage:
        # A queue that takes nothing and says so, bound for one routing key: the broker nacks
        # what is published with that key (other queues may still take their copy).
        connection = await aio_pika.connect(url)
        async with connection, connection.channel() as channel:
            queue = await channel.declare_queue(
                refusing, arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
            )
            await queue.bind(channels.events_exchange, "refused.Test.vm-1")
        return outgoing("refused", routing_key="refused.Test.vm-1")

    def via(port: int) -> RabbitMQTransport:
        return RabbitMQTransport(via_proxy(url, port), channels, settings=settings)

    backend = Backend(
        "rabbitmq",
        channels,
        lambda: RabbitMQTransport(url, channels, settings=settings),
        unreachable=lambda: RabbitMQTransport(
            f"amqp://guest:guest@127.0.0.1:{closed_port()}/", channels, settings=settings
        ),
        unroutable_approval_raises=True,
        sender=split.username or "guest",
        refused_message=nacked,
        address=(split.hostname or "127.0.0.1", split.port or 5672),
        via=via,
    )
    try:
        yield backend
    finally:
        async with RabbitMQTransport(url, channels, settings=settings) as transport:
            await transport.delete_topology(groups=backend.groups, vms=backend.vms, exchanges=True)
            connection = await aio_pika.connect(url)
            async with connection, connection.channel() as channel:
                await channel.queue_delete(refusing)


#: The consumer groups the contract suite reads; on Service Bus an operator creates the
#: subscriptions beforehand, so the double declares these ("ordered", read by one consumer at
#: a time, is session-enabled).
SERVICEBUS_GROUPS = ("audit", "fleet", "approver", "policy")
SERVICEBUS_ORDERED_GROUPS = ("ordered",)
SERVICEBUS_DROPS = (
    "a Service Bus topic drops what it gets while it has no subscription, and nothing can keep "
    "it (no AMQP call creates a subscription): the operator creates the groups' subscriptions "
    "with the topic"
)


@contextlib.asynccontextmanager
async def servicebus_backend(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Backend]:
    from schemas.transport.servicebus import MAX_MESSAGE_BYTES, ServiceBusTransport
    from tests.servicebus_double import EntityOptions, ServiceBusDouble

    channels = ChannelNames().suffixed(unique)
    double = ServiceBusDouble(
        session_queues=[channels.approvals_queue],
        topics={channels.events_topic: SERVICEBUS_GROUPS},
        session_topics={channels.events_topic: SERVICEBUS_ORDERED_GROUPS},
        options=EntityOptions(lock_duration=5.0, max_delivery_count=10),
    )

    def at(port: int) -> str:
        return (
            f"Endpoint=sb://127.0.0.1:{port};SharedAccessKeyName=k;"
            "SharedAccessKey=s;UseDevelopmentEmulator=true"
        )

    async def oversized(transport: Any) -> OutgoingMessage:
        return outgoing("x" * (MAX_MESSAGE_BYTES + 1))

    with double:
        yield Backend(
            "servicebus",
            channels,
            lambda: ServiceBusTransport(double.connection_string, channels),
            unreachable=lambda: ServiceBusTransport(at(closed_port()), channels),
            drops_without_groups=SERVICEBUS_DROPS,
            refused_message=oversized,
            refuses_for_good=True,
            address=(double.host, double.port),
            via=lambda port: ServiceBusTransport(at(port), channels),
        )


@contextlib.asynccontextmanager
async def servicebus_live_backend(
    request: pytest.FixtureRequest, unique: str
) -> AsyncIterator[Backend]:
    """The same suite against the official emulator or a real namespace, when
    ``SERVICEBUS_CONNECTION_STRING`` names one. Its entities keep the default names (topic
    ``scheduled-events`` with the subscriptions in :data:`SERVICEBUS_GROUPS` and the
    session-enabled ones in :data:`SERVICEBUS_ORDERED_GROUPS`, session queue
    ``scheduled-events-approvals``): create them first, as the README shows."""
    import os

    from schemas.channels import DEFAULT_CHANNELS
    from schemas.transport.servicebus import ServiceBusTransport

    connection_string = os.environ.get("SERVICEBUS_CONNECTION_STRING")
    if not connection_string:
        pytest.skip(
            "SERVICEBUS_CONNECTION_STRING is not set: no Service Bus emulator or namespace to "
            "run against (the double runs the same tests)"
        )
    yield Backend(
        "servicebus-live",
        DEFAULT_CHANNELS,
        lambda: ServiceBusTransport(connection_string, DEFAULT_CHANNELS),
        drops_without_groups=SERVICEBUS_DROPS,
    )


BackendFactory = Callable[
    [pytest.FixtureRequest, str], contextlib.AbstractAsyncContextManager[Backend]
]

#: name -> (factory, marks). The Service Bus backend adds one line here.
BACKENDS: dict[str, tuple[BackendFactory, tuple[pytest.MarkDecorator, ...]]] = {
    "memory": (memory_backend, ()),
    "rabbitmq": (rabbitmq_backend, (pytest.mark.rabbitmq,)),
    "servicebus": (servicebus_backend, (pytest.mark.servicebus,)),
    "servicebus-live": (servicebus_live_backend, (pytest.mark.servicebus,)),
}
