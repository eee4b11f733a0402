"""The double counts what Service Bus limits: connections and entity links held at once."""

from __future__ import annotations

import asyncio

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient

from tests.servicebus.conftest import eventually
from tests.servicebus_double import ServiceBusDouble
from tests.servicebus_double._usage import UsageMeter

pytestmark = [pytest.mark.servicebus, pytest.mark.timeout(30)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_mean_is_weighted_by_the_time_a_count_was_held() -> None:
    clock = FakeClock()
    meter = UsageMeter(clock)
    meter.connection(+1)
    clock.now += 6
    meter.connection(-1)
    clock.now += 54
    usage = meter.snapshot()
    assert usage.seconds == 60
    assert usage.connections.mean == pytest.approx(0.1)
    assert (usage.connections.now, usage.connections.peak, usage.connections.opened) == (0, 1, 1)


def test_links_are_counted_per_entity_and_a_restart_keeps_what_is_open() -> None:
    clock = FakeClock()
    meter = UsageMeter(clock)
    meter.link("q", +1, receive=True)
    meter.link("q", +1, receive=True)
    meter.link("t", +1, receive=False)
    clock.now += 10
    meter.link("q", -1, receive=True)
    meter.restart()
    clock.now += 10
    usage = meter.snapshot()
    assert usage.receive_links.now == 1
    assert usage.receive_links.peak == 1  # the window began with one
    assert usage.receive_links.mean == pytest.approx(1.0)
    assert usage.receive_links.opened == 0
    assert usage.receive_links_by_entity["q"].now == 1
    assert usage.send_links_by_entity["t"].now == 1


async def test_the_sdk_holds_one_connection_per_sender_and_per_receiver() -> None:
    with ServiceBusDouble(queues=["q"], topics={"t": ["a"]}) as double:
        async with ServiceBusClient.from_connection_string(double.connection_string) as client:
            sender = client.get_topic_sender("t")
            receiver = client.get_queue_receiver("q")
            await sender.send_messages(ServiceBusMessage(b"x"))
            await receiver.receive_messages(max_wait_time=2)  # opens the link first
            usage = double.usage()
            assert usage.connections.now == 2
            assert usage.send_links_by_entity["t"].now == 1
            assert usage.receive_links_by_entity["q"].now == 1
            assert usage.receive_links.now == 1  # $cbs and $management are not counted
            await asyncio.gather(sender.close(), receiver.close())
            await eventually(lambda: double.usage().connections.now == 0)
            usage = double.usage()
            assert (usage.receive_links.now, usage.send_links.now) == (0, 0)
            assert usage.connections.peak == 2
            assert usage.connections.opened == 2
