"""``tail`` reads a transient copy of the stream: it shows what is published while it runs and
leaves nothing on the broker to collect messages once it stops (a durable group would)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import aio_pika
import pytest

from consumers import FleetStream
from schemas import ChannelNames
from schemas.transport import MemoryBroker, MemoryTransport
from schemas.transport.rabbitmq import AmqpSettings, RabbitMQTransport
from schemas.wire import lifecycle_message

from ._factory import event, transition, vm

ROOT = Path(__file__).parents[2]


async def test_a_transient_stream_shows_the_live_stream_and_leaves_no_group(unique):
    try:
        async with asyncio.timeout(10), MemoryTransport(unique) as transport:
            message = transition("scheduled", event("EVT-1"), vm("web-1"))
            async with FleetStream(transport, "tail", transient=True) as stream:
                await transport.publish(lifecycle_message(message))
                shown = await anext(stream)
                assert shown.id == message.id
            await transport.publish(lifecycle_message(message))
            assert MemoryBroker.named(unique).groups == {}
    finally:
        MemoryBroker.discard(unique)


async def _publish_until_shown(
    transport: RabbitMQTransport, message, out: Path, text: str, within: float = 20
) -> None:
    """Publish until tail prints it: what is published before tail's queue is bound waits in
    the catch-all, which tail (a transient reader) never drains."""
    async with asyncio.timeout(within):
        while text not in out.read_text():  # noqa: ASYNC240 - another process writes it
            await transport.publish(lifecycle_message(message))
            await asyncio.sleep(0.2)


async def _unrouted_count(amqp_url: str, channels: ChannelNames) -> int:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(channels.unrouted, passive=True)
        return queue.declaration_result.message_count or 0


def _tail(amqp_url: str, suffix: str, out: Path, err: Path) -> subprocess.Popen[bytes]:
    command = ["tail", "--broker", amqp_url, "--channel-suffix", suffix]
    with out.open("wb") as stdout, err.open("wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "consumers", *command],
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=stdout,
            stderr=stderr,
        )


@pytest.mark.rabbitmq
async def test_tail_shows_what_is_published_while_it_runs_and_leaves_no_queue(
    amqp_url, unique, tmp_path
):
    channels = ChannelNames().suffixed(unique)
    settings = AmqpSettings(reconnect_timeout=5, confirm_timeout=5)
    out, err = tmp_path / "tail.out", tmp_path / "tail.err"
    async with RabbitMQTransport(amqp_url, channels, settings=settings) as publisher:
        process = None
        try:
            process = _tail(amqp_url, unique, out, err)
            shown = transition("started", event("EVT-TAIL"), vm("web-tail"))
            out.touch()
            await _publish_until_shown(publisher, shown, out, "web-tail")
            process.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(process.wait, 20) == 0
            # Nothing of tail's is bound to the stream any more: the next message, which no
            # group takes, waits in the catch-all for the first group (it is not lost, and
            # tail left no queue behind to collect it).
            before = await _unrouted_count(amqp_url, channels)
            later = transition("completed", event("EVT-TAIL"), vm("web-tail"))
            await publisher.publish(lifecycle_message(later))
            assert await _unrouted_count(amqp_url, channels) == before + 1
        finally:
            if process is not None and process.poll() is None:
                process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.to_thread(process.wait, 10)
            print("tail stderr:", err.read_text() if err.exists() else "(none)")
            await publisher.delete_topology(groups=["tail"], exchanges=True)
    assert "started" in out.read_text()
