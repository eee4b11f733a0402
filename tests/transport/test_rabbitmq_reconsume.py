"""A subscription that cannot consume again after a reconnect says so; it never goes quiet.

The subscription consumes on the robust channel's aiormq channel itself, so after a reconnect
it consumes again from the channel's reopen callback. aio-pika gathers what its reopen
callbacks raise and drops it: a consume that failed there for any reason the subscription did
not expect (aiormq fails a channel's waiting futures with a bare ``Exception`` when it ends
without an error) left the subscription open, its link up, and nothing delivered to it ever
again: an agent deaf to its approvals, an approver deaf to the fleet, and no line in the log.
Now such a failure ends the subscription with a :class:`TransportError` at its next wait (its
owner opens it again, as after any failure); only a consume cut off by a link that is down
again waits for the reopen that follows.

Against the real broker through a TCP proxy that cuts the link. The failure itself is injected
(aiormq's ``basic_consume`` raises once, on the reopened channel): the race that makes aiormq
raise it cannot be produced on demand.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiormq
import pytest

from schemas import TransportError
from schemas.transport.rabbitmq import AmqpSettings

from ._helpers import outgoing, proxied_rabbitmq, receive

pytestmark = pytest.mark.rabbitmq

SETTINGS = AmqpSettings(connect_timeout=2, reconnect_timeout=20, confirm_timeout=5)


@pytest.mark.parametrize(
    "failure",
    [Exception, lambda: RuntimeError("the consume went wrong")],
    ids=["aiormq's bare Exception", "an unexpected error"],
)
async def test_a_consume_that_fails_after_a_reconnect_ends_the_subscription_loudly(
    amqp_url: str,
    unique: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    failure: Callable[[], BaseException],
) -> None:
    caplog.set_level(logging.INFO)
    async with proxied_rabbitmq(amqp_url, unique, SETTINGS) as (proxy, transport):
        await transport.declare_group("g")
        async with transport.subscribe("g", prefetch=4) as subscription:
            await transport.publish(outgoing("before"))
            await (await receive(subscription, within=10)).ack()

            consume = aiormq.Channel.basic_consume
            failed = asyncio.Event()

            async def fails_once(self: aiormq.Channel, *args: object, **kwargs: object) -> object:
                if not failed.is_set():
                    failed.set()
                    raise failure()
                return await consume(self, *args, **kwargs)  # type: ignore[arg-type]

            monkeypatch.setattr(aiormq.Channel, "basic_consume", fails_once)
            await proxy.cut()
            await asyncio.sleep(0.5)
            await proxy.restore()
            async with asyncio.timeout(30):
                await failed.wait()
            monkeypatch.setattr(aiormq.Channel, "basic_consume", consume)
            # The link is back (the publisher's channel reopened on it) and no reopen follows:
            # the subscription must not wait for deliveries that can never come.
            await transport.publish(outgoing("after"))
            with pytest.raises(TransportError, match=r"consuming .* again failed"):
                await receive(subscription, within=10)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("schemas.")]
    assert any("again failed" in text and "the subscription ends" in text for text in said), said
