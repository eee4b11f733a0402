"""A lost link to RabbitMQ is said once, in the transport's own words, and the libraries'
repeats of it are not: before, each cut put aiormq's WARNING with two chained tracebacks per
connection ("Cancelling cause reader exited abnormally") and aio-pika's ERROR per channel (a
robust channel's reopen failing on the connection that was lost) into the operator's log,
around the transport's one line. Against the real broker through a TCP proxy that resets the
connections."""

from __future__ import annotations

import asyncio
import logging

import pytest

from schemas.transport.rabbitmq import AmqpSettings

from ._helpers import outgoing, proxied_rabbitmq, receive

pytestmark = pytest.mark.rabbitmq


async def test_a_lost_link_is_said_once_by_the_transport_not_with_the_libraries_tracebacks(
    amqp_url: str, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    settings = AmqpSettings(connect_timeout=2, reconnect_timeout=20, confirm_timeout=5)
    async with proxied_rabbitmq(amqp_url, unique, settings) as (proxy, transport):
        await transport.declare_group("g")
        async with transport.subscribe("g", prefetch=4) as subscription:
            await transport.publish(outgoing("before"))
            await (await receive(subscription, within=10)).ack()
            caplog.clear()
            await proxy.cut()
            await asyncio.sleep(1.5)
            await proxy.restore()
            await transport.publish(outgoing("after"))  # waits for the link
            await (await receive(subscription, within=20)).ack()
    # asyncio's own records are the test proxy's (its cut cancels its relaying tasks).
    said = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name != "asyncio"]
    lines = [f"{r.levelname} {r.name}: {_text(r)}" for r in said]
    assert any("lost the link to RabbitMQ" in line for line in lines), lines
    assert [line for line in lines if " aiormq" in line or " aio_pika.tools" in line] == []
    assert [line for r, line in zip(said, lines, strict=True) if r.exc_info] == []


def _text(record: logging.LogRecord) -> str:
    """The record's message; its bare format when an argument can no longer be shown (aio-pika
    drops a callback's target once it ran, and its repr then fails)."""
    try:
        return record.getMessage()
    except Exception:
        return str(record.msg)
