"""Transient subscriptions on the in-memory broker: a copy of the stream that lives only while
its reader does (what ``tail`` reads), like RabbitMQ's exclusive auto-delete queue."""

from __future__ import annotations

import asyncio

from schemas.transport import MemoryBroker, MemoryTransport

from ._helpers import assert_nothing, outgoing, receive


async def test_a_transient_subscription_sees_the_stream_and_goes_away(unique: str) -> None:
    broker = MemoryBroker.named(unique)
    try:
        async with asyncio.timeout(10), MemoryTransport(unique) as transport:
            await transport.declare_group("audit")
            await transport.publish(outgoing("before tail started"))
            async with (
                transport.subscribe("tail", transient=True) as one,
                transport.subscribe("tail", transient=True) as two,
            ):
                sent = outgoing("while tail runs")
                await transport.publish(sent)
                for subscription in (one, two):  # every transient reader sees every message
                    delivery = await receive(subscription)
                    assert delivery.message_id == sent.message_id
                    await delivery.ack()
                await assert_nothing(one, 0.1)
                assert len(broker.groups) == 3  # audit and the two readers' copies
            await transport.publish(outgoing("after tail stopped"))
            assert set(broker.groups) == {"audit"}  # nothing collects for tail any more
            assert broker.depth("audit") == 3
    finally:
        MemoryBroker.discard(unique)


async def test_an_unsettled_message_of_a_transient_subscription_goes_with_it(
    unique: str,
) -> None:
    try:
        async with asyncio.timeout(10), MemoryTransport(unique) as transport:
            async with transport.subscribe("tail", transient=True) as subscription:
                await transport.publish(outgoing())
                await receive(subscription)  # never settled
            assert MemoryBroker.named(unique).groups == {}
    finally:
        MemoryBroker.discard(unique)
