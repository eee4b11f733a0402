"""A Service Bus double per test, with the entities the tests of the double use."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from azure.servicebus.aio import ServiceBusClient

from tests.servicebus_double import EntityOptions, ServiceBusDouble

LOCK_DURATION = 1.0
MAX_DELIVERY_COUNT = 3


@pytest.fixture
def servicebus_double() -> Iterator[ServiceBusDouble]:
    """A started double: queue ``q``, session queue ``sq``, topic ``t`` with ``a`` and ``b``.

    A short lock duration (1 s) keeps the lock-expiry tests fast.
    """
    double = ServiceBusDouble(
        queues=["q", "q2"],
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


@pytest.fixture
async def client(servicebus_double: ServiceBusDouble) -> AsyncIterator[ServiceBusClient]:
    async with ServiceBusClient.from_connection_string(
        servicebus_double.connection_string
    ) as sb_client:
        yield sb_client
