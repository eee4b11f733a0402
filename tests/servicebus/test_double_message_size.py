"""The double's max message size, as Service Bus has one: the real SDK against it, over
loopback. Standard advertises 262,144 bytes on the links a client sends on and refuses a
larger message as it arrives (the SDK checks no single message before sending), measuring the
whole encoded message, not only its body; Premium allows more."""

from __future__ import annotations

from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient
from azure.servicebus.exceptions import MessageSizeExceededError

from tests.servicebus.conftest import Handlers
from tests.servicebus_double import STANDARD_MAX_MESSAGE_SIZE, ServiceBusDouble

pytestmark = [pytest.mark.servicebus, pytest.mark.timeout(30)]

#: Properties a message carries besides its body (an agent's signing properties are ~2 KB).
PROPERTIES: dict[str | bytes, Any] = {"origin-attestation": "a" * 2000}


async def test_a_message_over_the_standard_size_is_refused_with_the_sdks_own_error(
    handlers: Handlers, servicebus_double: ServiceBusDouble
) -> None:
    """A body under 262,144 bytes whose properties take the message over it: the SDK raises
    MessageSizeExceededError (not retried: it comes at once), with the size and the limit,
    and the queue holds nothing; a message under the limit on the same sender goes."""
    sender = handlers.queue_sender("q")
    body = b"x" * (STANDARD_MAX_MESSAGE_SIZE - 1000)
    with pytest.raises(MessageSizeExceededError, match=r"exceeds the limit \(262144 bytes\)"):
        await sender.send_messages(ServiceBusMessage(body, application_properties=PROPERTIES))
    assert servicebus_double.namespace.count("q") == 0
    await sender.send_messages(ServiceBusMessage(body[:200_000], application_properties=PROPERTIES))
    assert servicebus_double.namespace.count("q") == 1


async def test_a_larger_max_message_size_takes_what_standard_refuses() -> None:
    """Premium's larger limit, set in the double's constructor."""
    with ServiceBusDouble(queues=["q"], max_message_size=1024 * 1024) as double:
        async with (
            ServiceBusClient.from_connection_string(double.connection_string) as client,
            client.get_queue_sender("q") as sender,
        ):
            await sender.send_messages(
                ServiceBusMessage(
                    b"x" * STANDARD_MAX_MESSAGE_SIZE, application_properties=PROPERTIES
                )
            )
            with pytest.raises(MessageSizeExceededError, match=r"limit \(1048576 bytes\)"):
                await sender.send_messages(ServiceBusMessage(b"x" * (1024 * 1024)))
        assert double.namespace.count("q") == 1
