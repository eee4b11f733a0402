"""A broker failure while settling never ends a consumer: the stream opens its subscription
again, the broker delivers what was not settled once more, and the dedupe window keeps each
message to one handling. RabbitMQ behind a TCP proxy that cuts the link mid-stream."""

from __future__ import annotations

import asyncio
import uuid
from urllib.parse import urlsplit

import aio_pika
import pytest

from consumers import FleetStream
from schemas import ChannelNames, LifecycleMessage
from schemas.transport.rabbitmq import RabbitMQTransport
from schemas.wire import lifecycle_message
from tests.transport.proxy import TcpProxy

from ._factory import event, heartbeat, transition, vm

pytestmark = [pytest.mark.rabbitmq]


async def test_a_link_cut_while_acking_reconnects_and_every_message_is_handled_once(
    amqp_url: str,
) -> None:
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:10])
    split = urlsplit(amqp_url)
    messages = [
        transition("scheduled", event(f"EVT-{n}", resources=("web-1",)), vm("web-1"), sequence=n)
        for n in range(30)
    ]
    seen: list[str] = []
    async with (
        TcpProxy(split.hostname or "127.0.0.1", split.port or 5672) as proxy,
        RabbitMQTransport(amqp_url, channels) as publisher,
    ):
        proxied = f"amqp://guest:guest@127.0.0.1:{proxy.port}/?reconnect_interval=0.2"
        try:
            async with RabbitMQTransport(proxied, channels) as consumer:
                await consumer.declare_group("audit")
                for message in messages:
                    await publisher.publish(lifecycle_message(message))
                # Settle one at a time: every ack goes to the broker, and one is cut off.
                stream = FleetStream(consumer, "audit", prefetch=4, ack_batch=1)
                cut = asyncio.Event()

                @stream.on()
                async def handle(message: LifecycleMessage) -> None:
                    seen.append(message.id)
                    if len(seen) == 10 and not cut.is_set():
                        cut.set()
                        await proxy.cut()
                        asyncio.get_running_loop().call_later(
                            2.0, lambda: asyncio.ensure_future(proxy.restore())
                        )
                    if len(set(seen)) == len(messages):
                        stream.stop()

                async with asyncio.timeout(40):
                    await stream.run()
        finally:
            await publisher.delete_topology(groups=["audit"], exchanges=True)
    assert set(seen) == {m.id for m in messages}
    assert len(seen) == len(messages), "a message reached the handler twice"
    assert stream.stats.reconnects >= 1


async def test_a_pipelined_commit_that_fails_loses_nothing_though_later_batches_were_handled(
    amqp_url: str,
) -> None:
    """With ``pipeline`` the stream handles the next batch while the last one is committed.
    When a commit fails, the batches handled after it must not be acked either: on RabbitMQ a
    batch is acked in one frame *through* its last delivery, which would ack the failed batch
    too. Here the second of the store's commits fails: every message ends up committed exactly
    once, and the queue is empty."""
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:10])
    # Two full batches of 128 and a part: the second commit's failure is found by the flush
    # of the third, when the stream has read everything (and so would ack that one at once).
    messages = [heartbeat(vm(f"web-{n}")) for n in range(300)]
    pending: list[str] = []
    committed: list[str] = []
    committing = 0
    handled_while_committing = 0
    commits = 0

    async def before_ack() -> asyncio.Future[None]:
        """Fixes what the batch changed now; writes it in the background. The second write
        takes a second and fails; the third, begun meanwhile, does not."""
        nonlocal commits
        batch = list(pending)
        pending.clear()
        commits += 1
        number = commits

        async def write() -> None:
            nonlocal committing
            committing += 1
            try:
                await asyncio.sleep(1.0 if number == 2 else 0.01)  # a disk
                if number == 2:
                    raise RuntimeError("disk I/O error")  # this batch's changes are gone
                committed.extend(batch)
            finally:
                committing -= 1

        return asyncio.ensure_future(write())

    async with RabbitMQTransport(amqp_url, channels) as transport:
        try:
            await transport.declare_group("approver")
            for message in messages:
                await transport.publish(lifecycle_message(message))
            # The flusher looks every half second: it first finds the stream idle once all
            # 300 are handled, while the second write is still under way.
            stream = FleetStream(
                transport,
                "approver",
                prefetch=256,
                before_ack=before_ack,
                pipeline=True,
                ack_interval=0.5,
            )

            @stream.on()
            async def handle(message: LifecycleMessage) -> None:
                nonlocal handled_while_committing
                pending.append(message.id)
                handled_while_committing += committing > 0

            async def stop_when_all_committed() -> None:
                # ... and the copies of what was committed but not acked are dropped.
                while len(set(committed)) < len(messages) or not stream.settled:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
                stream.stop()

            async with asyncio.timeout(20), asyncio.TaskGroup() as group:
                group.create_task(stop_when_all_committed())
                await stream.run()
            depth = await _depth(amqp_url, transport.group_queue("approver"))
        finally:
            await transport.delete_topology(groups=["approver"], exchanges=True)
    assert sorted(committed) == sorted(m.id for m in messages)  # each once
    assert handled_while_committing > 0
    assert stream.stats.reconnects >= 1
    assert depth == 0


async def _depth(url: str, queue: str) -> int:
    """Messages in ``queue``, ready or unacked, once the stream let go of them."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return declared.declaration_result.message_count or 0
    finally:
        await connection.close()
