"""Locks a receiver holds are kept while it is open, and their renewal never overlaps its close.

The SDK's ``AutoLockRenewer`` renews on its own schedule, blind to the receiver being closed: a
renewal that began as an agent closed its approvals session (every event, on every VM) ended
in the SDK's "Unexpected error occurred (...). Handler shutting down." at ERROR, with a
traceback (135 in 377 openings and closings of 50 VMs' sessions with a 3 s lock; 66 in three
runs of 1,000 VMs). The transport now renews what its receiver holds itself, and stops that
before it closes the receiver. The real SDK against the double."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterator

import pytest

from schemas import ChannelNames
from schemas.transport.servicebus import ServiceBusTransport
from tests.servicebus.conftest import an_approval_arrives
from tests.servicebus_double import EntityOptions, ServiceBusDouble
from tests.transport._helpers import outgoing

pytestmark = [pytest.mark.servicebus, pytest.mark.timeout(90)]

#: Short, so that renewals come every second or two.
LOCK_SECONDS = 3.0


@pytest.fixture
def short_locks(channels: ChannelNames) -> Iterator[ServiceBusDouble]:
    with ServiceBusDouble(
        topics={channels.events_topic: ["audit", "slow"]},
        session_queues=[channels.approvals_queue],
        options=EntityOptions(lock_duration=LOCK_SECONDS),
    ) as double:
        yield double


def _sdk_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.name.startswith("azure") and r.levelno >= logging.ERROR
    ]


async def test_sessions_closed_while_their_locks_are_renewed_log_no_error(
    short_locks: ServiceBusDouble, channels: ChannelNames, caplog: pytest.LogCaptureFixture
) -> None:
    """Twelve VMs open their approvals session, hold it across one or two renewals, close it,
    three times over: the SDK logs no error (before: 16 or 17 errors, each with a traceback)."""
    caplog.set_level(logging.INFO, logger="azure")
    async with ServiceBusTransport(short_locks.connection_string, channels) as transport:

        async def vm(index: int) -> None:
            rng = random.Random(index)
            for _ in range(3):
                subscription = transport.approvals(f"vm-{index}")
                waiting = asyncio.ensure_future(anext(subscription))
                await asyncio.sleep(rng.uniform(2.0, 2 * LOCK_SECONDS))
                await subscription.close()
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)

        await asyncio.gather(*(vm(i) for i in range(12)))
    assert _sdk_errors(caplog) == []


async def test_a_session_held_past_its_lock_keeps_its_receiver(
    short_locks: ServiceBusDouble, channels: ChannelNames, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent waits for its approval longer than the session lock lasts: the lock is renewed,
    so the approval arrives on the receiver opened first, with no failure on the way."""
    caplog.set_level(logging.DEBUG, logger="schemas.transport.servicebus")
    async with ServiceBusTransport(short_locks.connection_string, channels) as transport:
        subscription = transport.approvals("vm-a")
        try:
            waiting = asyncio.ensure_future(anext(subscription))
            await asyncio.sleep(3 * LOCK_SECONDS)
            await an_approval_arrives(transport, waiting)
        finally:
            await subscription.close()
    opened = short_locks.usage().receive_links_by_entity[channels.approvals_queue].opened
    assert opened == 1, "the session was lost and opened again"
    failed = [
        r.getMessage()
        for r in caplog.records
        if r.name == "schemas.transport.servicebus" and "fail" in r.getMessage()
    ]
    assert failed == []
    assert _sdk_errors(caplog) == []


async def test_messages_waiting_behind_a_long_handler_keep_their_locks(
    short_locks: ServiceBusDouble, channels: ChannelNames
) -> None:
    """A receive brings a batch; while the handler holds the first message for more than two
    locks, the rest wait in the subscription's buffer: their locks are renewed too, so each is
    settled once and none is delivered again."""
    async with ServiceBusTransport(short_locks.connection_string, channels) as transport:
        for body in ("first", "second", "third"):
            await transport.publish(outgoing(body))
        async with transport.subscribe("slow", prefetch=8) as subscription:
            first = await anext(subscription)
            await asyncio.sleep(2.5 * LOCK_SECONDS)
            await first.ack()
            for _ in range(2):
                delivery = await asyncio.wait_for(anext(subscription), 5)
                await delivery.ack()
            again = asyncio.ensure_future(anext(subscription))
            await asyncio.sleep(LOCK_SECONDS + 0.5)
            assert not again.done(), "a message was delivered again"
            again.cancel()
    assert short_locks.namespace.count(f"{channels.events_topic}/Subscriptions/slow") == 0
