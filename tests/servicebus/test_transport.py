"""Service Bus specifics of the transport that the shared contract suite does not cover: long
handlers keep their lock, one sender per entity is reused while busy, addresses parse, sizes
are capped."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import pytest

from schemas import ChannelNames, ConfigError, MessageRefused
from schemas.transport import OutgoingMessage, open_transport
from schemas.transport.servicebus import MAX_MESSAGE_BYTES, ServiceBusTransport, _namespace
from tests.servicebus_double import EntityOptions, ServiceBusDouble

pytestmark = pytest.mark.servicebus


def _message(body: bytes = b"{}") -> OutgoingMessage:
    return OutgoingMessage(
        body=body,
        message_id=uuid.uuid4().hex,
        content_type="application/json",
        routing_key="scheduled.Reboot.vm-1",
    )


def test_the_broker_url_picks_service_bus_and_names_the_namespace() -> None:
    assert isinstance(open_transport("sb://contoso"), ServiceBusTransport)
    assert _namespace("sb://contoso") == "contoso.servicebus.windows.net"
    assert _namespace("sb://contoso.servicebus.windows.net/") == "contoso.servicebus.windows.net"
    conn = "Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=s"
    assert isinstance(open_transport(conn), ServiceBusTransport)


async def test_a_connection_string_that_is_not_one_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="connection string"):
        async with open_transport("Endpoint=nonsense"):
            pass


async def test_a_handler_longer_than_the_lock_keeps_its_message() -> None:
    """The lock is 3 s; the handler takes 7 s: the renewer keeps the lock, so the message is
    completed once and never delivered again. (The SDK's renewer looks once a second and renews
    at half the lock: a lock of a few seconds is the shortest it keeps.)"""
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:8])
    double = ServiceBusDouble(
        topics={channels.events_topic: ["slow"]},
        session_queues=[channels.approvals_queue],
        options=EntityOptions(lock_duration=3.0),
    )
    with double:
        async with (
            asyncio.timeout(60),
            ServiceBusTransport(double.connection_string, channels) as t,
        ):
            sent = _message()
            await t.publish(sent)
            async with t.subscribe("slow") as subscription:
                delivery = await anext(subscription)
                await asyncio.sleep(7.0)
                await delivery.ack()
                again = asyncio.ensure_future(anext(subscription))
                await asyncio.sleep(3.5)
                assert not again.done(), "the message was delivered again"
                again.cancel()
        assert double.namespace.count(f"{channels.events_topic}/Subscriptions/slow") == 0


async def test_one_sender_per_entity_is_opened_and_reused() -> None:
    """Sends within the idle timeout share the entity's sender (the start-up check's own
    sender closed at once)."""
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:8])
    double = ServiceBusDouble(
        topics={channels.events_topic: ["audit"]}, session_queues=[channels.approvals_queue]
    )
    with double:
        async with (
            asyncio.timeout(60),
            ServiceBusTransport(double.connection_string, channels) as t,
        ):
            for _ in range(5):
                await t.publish(_message())
            for vm in ("vm-1", "vm-2"):
                await t.send_approval(t.reply_address(vm), _message())
            opened = double.usage().send_links_by_entity
            assert opened[channels.events_topic].opened == 2  # the check's, the publishes
            assert opened[channels.approvals_queue].opened == 1
            assert double.usage().connections.now == 2
        assert double.namespace.count(f"{channels.events_topic}/Subscriptions/audit") == 5


async def test_a_message_over_the_standard_tier_cap_is_refused_before_sending() -> None:
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:8])
    double = ServiceBusDouble(
        topics={channels.events_topic: ["audit"]}, session_queues=[channels.approvals_queue]
    )
    with double:
        async with (
            asyncio.timeout(60),
            ServiceBusTransport(double.connection_string, channels) as t,
        ):
            with pytest.raises(MessageRefused, match="at most 262144"):
                await t.publish(_message(b"x" * (MAX_MESSAGE_BYTES + 1)))


async def test_a_message_its_properties_take_over_the_links_max_size_is_refused_for_good() -> None:
    """Service Bus measures the whole message (body, properties, annotations) against the
    link's max message size (Standard: 262,144 bytes). A body under the cap whose properties
    (an agent's signing properties are ~2 KB) take it over is refused however often it is
    sent: MessageRefused, saying the size and the limit, which the agent's outbox sets aside.
    It was a PublishNotConfirmed, which the outbox retries for ever, and nothing of that
    agent's behind it went out. The next message on the same transport goes."""
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:8])
    double = ServiceBusDouble(
        topics={channels.events_topic: ["audit"]}, session_queues=[channels.approvals_queue]
    )
    big = dataclasses.replace(
        _message(b"x" * (MAX_MESSAGE_BYTES - 1000)),
        properties={"origin-attestation": "a" * 2000},
    )
    with double:
        async with (
            asyncio.timeout(60),
            ServiceBusTransport(double.connection_string, channels) as t,
        ):
            with pytest.raises(MessageRefused) as refused:
                await t.publish(big)
            assert f"{len(big.body)} bytes" in str(refused.value)
            assert "262144" in str(refused.value)
            after = _message()
            await t.publish(after)
            async with t.subscribe("audit") as subscription:
                delivery = await anext(subscription)
                await delivery.ack()
        assert delivery.message_id == after.message_id
        assert double.namespace.count(f"{channels.events_topic}/Subscriptions/audit") == 0


async def test_an_approval_for_a_vm_whose_name_cannot_be_a_session_id_is_refused_for_good() -> None:
    """The approvals queue's session id is the VM's name, and Service Bus takes at most 128
    characters there (the SDK refuses a longer one when it builds the message); the contract
    allows names of up to 200. An approval to such a VM is one Service Bus will never take:
    MessageRefused (the approver then treats it as undeliverable and decides again). It was
    the SDK's own ValueError, out of ``send_approval`` past every sender's handling of
    transport errors. Another VM's approval goes."""
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:8])
    double = ServiceBusDouble(
        topics={channels.events_topic: ["audit"]}, session_queues=[channels.approvals_queue]
    )
    with double:
        async with (
            asyncio.timeout(60),
            ServiceBusTransport(double.connection_string, channels) as t,
        ):
            with pytest.raises(MessageRefused, match="128"):
                await t.send_approval(t.reply_address("v" * 129), _message())
            await t.send_approval(t.reply_address("v" * 128), _message())
        assert double.namespace.count(channels.approvals_queue) == 1


async def test_a_missing_subscription_is_a_config_error_that_says_so() -> None:
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:8])
    double = ServiceBusDouble(
        topics={channels.events_topic: ["audit"]}, session_queues=[channels.approvals_queue]
    )
    with double:
        async with (
            asyncio.timeout(60),
            ServiceBusTransport(double.connection_string, channels) as t,
        ):
            with pytest.raises(ConfigError, match="does not exist: create it"):
                await t.declare_group("approver")
