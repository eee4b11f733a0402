"""The fleet stream on Service Bus against messages no agent of ours sends but any holder of a
send right on the events topic can: an AMQP body that is not data, and a ``DeadLetterReason``
application property that is not UTF-8 (the SDK's reader of it raises). Each must cost that
message only: dead-lettered, the stream still consuming, the next good message handled once."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient
from azure.servicebus.amqp import AmqpAnnotatedMessage

from consumers import FleetStream
from schemas import ChannelNames, LifecycleMessage
from schemas.transport.servicebus import ServiceBusTransport
from schemas.wire import lifecycle_message
from tests.consumers._factory import event, transition, vm
from tests.servicebus_double import ServiceBusDouble

pytestmark = pytest.mark.servicebus

GROUP = "audit"


def _hostile() -> dict[str, AmqpAnnotatedMessage | ServiceBusMessage]:
    def value(body: object, name: str) -> AmqpAnnotatedMessage:
        return AmqpAnnotatedMessage(value_body=body, properties={"message_id": name})

    return {
        "value-int": value(5, "value-int"),
        "value-null": value(None, "value-null"),
        "sequence": AmqpAnnotatedMessage(
            sequence_body=[[1, 2]], properties={"message_id": "sequence"}
        ),
        # The SDK sends a bytes value as text; the explicit AMQP type keeps it binary.
        "reason-not-utf8": ServiceBusMessage(
            b"not json",
            message_id="reason-not-utf8",
            application_properties={
                "DeadLetterReason": {"TYPE": "BINARY", "VALUE": b"\xff\xfe"}  # type: ignore[dict-item]
            },
        ),
    }


async def test_a_body_that_is_not_data_or_an_unreadable_property_costs_only_that_message() -> None:
    """Each of these once raised while the transport read the batch it came in (TypeError
    joining a body that is not data sections, UnicodeDecodeError from the SDK's
    ``dead_letter_reason``): out of the subscription, out of FleetStream.run, the service's
    end; and the message met it again at every restart."""
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:8])
    double = ServiceBusDouble(
        topics={channels.events_topic: [GROUP]}, session_queues=[channels.approvals_queue]
    )
    hostile = _hostile()
    first = transition("scheduled", event("EVT-FIRST"), vm("web-1"))
    last = transition("scheduled", event("EVT-LAST"), vm("web-1"))
    with double:
        async with (
            asyncio.timeout(60),
            ServiceBusTransport(double.connection_string, channels) as transport,
        ):
            async with (
                ServiceBusClient.from_connection_string(double.connection_string) as client,
                client.get_topic_sender(channels.events_topic) as sender,
            ):
                await sender.send_messages(list(hostile.values()))  # type: ignore[arg-type]
            for message in (first, first, last):  # first twice: an agent's repeat
                await transport.publish(lifecycle_message(message))
            stream = FleetStream(transport, GROUP)
            handled: list[str] = []

            @stream.on()
            async def record(message: LifecycleMessage) -> None:
                handled.append(message.id)
                if message.id == last.id:
                    stream.stop()

            await stream.run()
        dead = double.namespace.peek(
            f"{channels.events_topic}/Subscriptions/{GROUP}/$DeadLetterQueue", 0, 100
        )
    assert handled == [first.id, last.id]
    assert {m.message_id: m.dead_letter_reason for m in dead} == dict.fromkeys(hostile, "not-json")
