"""A Service Bus double per test (``servicebus_double`` for the SDK alone, ``double`` with the
transport's ``channels``), and SDK handlers that close together at the end."""

from __future__ import annotations

import asyncio
import gc
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from azure.servicebus.aio import ServiceBusClient, ServiceBusReceiver, ServiceBusSender

from schemas import ChannelNames
from schemas.transport import Delivery
from schemas.transport.servicebus import ServiceBusTransport
from tests.servicebus_double import EntityOptions, ServiceBusDouble
from tests.transport._helpers import outgoing

LOCK_DURATION = 1.0
MAX_DELIVERY_COUNT = 3
CLOSE_TIMEOUT = 10.0


def close_what_the_sdk_left_open() -> int:
    """The SDK's close returns early for a connection whose open never reached its AMQP session
    (``AMQPClientAsync.close_async`` in ``_pyamqp/aio/_client_async.py``: ``if not
    self._session: return``), so the socket of an open that stalled stays open, registered with
    the event loop, until the loop closes. Close those here, once the test's own connections are
    closed, so the next test does not meet their ResourceWarning; returns how many."""
    gc.collect()
    left = [
        writer
        for writer in gc.get_objects()
        if isinstance(writer, asyncio.StreamWriter) and not writer.transport.is_closing()
    ]
    for writer in left:
        writer.transport.abort()
    return len(left)


async def an_approval_arrives(
    transport: ServiceBusTransport,
    waiting: Awaitable[Delivery],
    *,
    vm: str = "vm-a",
    within: float = 10.0,
) -> None:
    """Send ``vm`` an approval and see it arrive (``waiting``: the next delivery of its approvals
    subscription, asked for before), then ack it."""
    await transport.send_approval(transport.reply_address(vm), outgoing("ok"))
    delivery = await asyncio.wait_for(waiting, within)
    assert delivery.body == b"ok"
    await delivery.ack()


async def eventually(predicate: Callable[[], bool], within: float = 5.0) -> None:
    """Wait until ``predicate()`` holds (it reads the double's state: no event to wait on)."""
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 - the double's thread changes what it reads
            await asyncio.sleep(0.02)


@pytest.fixture
def servicebus_double() -> Iterator[ServiceBusDouble]:
    """A started double: queues ``q``, session queue ``sq``, topic ``t`` with ``a`` and ``b``.

    A short lock duration (1 s) keeps the lock-expiry tests fast.
    """
    double = ServiceBusDouble(
        queues=["q"],
        session_queues=["sq"],
        topics={"t": ["a", "b"]},
        options=EntityOptions(
            lock_duration=LOCK_DURATION,
            max_delivery_count=MAX_DELIVERY_COUNT,
            duplicate_detection_window=60.0,
        ),
    )
    with double:
        yield double


class Handlers:
    """SDK senders and receivers of one test, closed concurrently when it ends.

    Closing an SDK handler waits for its keep-alive task, which sleeps a second at a time
    (``_keep_alive_async`` in ``_pyamqp/aio/_client_async.py``): closed one after another
    they would dominate the run time.
    """

    def __init__(self, client: ServiceBusClient) -> None:
        self.client = client
        self._open: list[ServiceBusSender | ServiceBusReceiver] = []

    def queue_sender(self, queue: str) -> ServiceBusSender:
        sender = self.client.get_queue_sender(queue)
        self._open.append(sender)
        return sender

    def topic_sender(self, topic: str) -> ServiceBusSender:
        sender = self.client.get_topic_sender(topic)
        self._open.append(sender)
        return sender

    def queue_receiver(self, queue: str, **kwargs: Any) -> ServiceBusReceiver:
        receiver = self.client.get_queue_receiver(queue, **kwargs)
        self._open.append(receiver)
        return receiver

    def subscription_receiver(self, topic: str, sub: str, **kwargs: Any) -> ServiceBusReceiver:
        receiver = self.client.get_subscription_receiver(topic, sub, **kwargs)
        self._open.append(receiver)
        return receiver

    async def close(self) -> None:
        handlers, self._open = self._open, []
        results = await asyncio.wait_for(
            asyncio.gather(*(h.close() for h in handlers), return_exceptions=True),
            CLOSE_TIMEOUT,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]


@pytest.fixture
async def handlers(servicebus_double: ServiceBusDouble) -> AsyncIterator[Handlers]:
    async with ServiceBusClient.from_connection_string(
        servicebus_double.connection_string
    ) as client:
        opened = Handlers(client)
        try:
            yield opened
        finally:
            await opened.close()


@pytest.fixture
def channels() -> ChannelNames:
    return ChannelNames().suffixed(uuid.uuid4().hex[:8])


@pytest.fixture
def double(channels: ChannelNames) -> Iterator[ServiceBusDouble]:
    with ServiceBusDouble(
        topics={channels.events_topic: ["audit"]},
        session_queues=[channels.approvals_queue],
        options=EntityOptions(lock_duration=5.0),
    ) as double:
        yield double
