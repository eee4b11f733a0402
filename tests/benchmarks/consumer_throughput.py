"""Consumer throughput on the real RabbitMQ: messages per second through parse, dedupe, handler
and ack, for the consumers' FleetStream against a naive aio-pika consumer (manual ack per
message, pydantic parse) and against the ceiling, a raw aiormq consumer that only counts and
acks in batches (``basic.ack multiple``, no parsing), in the same run, on the same queue
contents.

Every consumer group gets its own copy of the stream, so one publish fills every queue with the
same messages (transitions and heartbeats of a fleet, 5 % of them repeated as an agent does after
a restart). Each consumer then drains its own queue; the figure is messages / wall seconds from
the first message to the last ack.

    python tests/benchmarks/consumer_throughput.py [--messages 20000] [--prefetch 256] [--rounds 1]

``--rounds N`` fills and drains the queues N times and prints each round (the machine is shared:
one round is one sample).

Beside each rate it prints the CPU this process spent a message while that consumer drained its
queue (every consumer runs here, one after another), and once, on the same bodies without a
broker, the cost of what FleetStream must do for every message whatever else it does: decode and
validate it (no input is trusted before it is checked), digest what it says (another message
under a handled id is an id conflict, not a repeat) and look it up in and add it to the dedupe
window (a repeat reaches no handler). FleetStream reaches a share ``r`` of the ceiling only if
its CPU a message is at most the ceiling's divided by ``r``; the last lines say what that leaves
for FleetStream's own work at 80 %. A fifth consumer, "checks only", does just that work on the
project's own subscription (the same acks as the ceiling, no handler, no retry, no dead letter):
a bound on what FleetStream, or any consumer that checks its input as it does, reaches here.

Prints figures; asserts nothing (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aio_pika
import aiormq

sys.path.insert(0, str(Path(__file__).parents[2]))

from consumers import DedupeWindow, FleetStream
from consumers._stream import message_key
from schemas import (
    AgentData,
    AgentMessage,
    ChannelNames,
    LifecycleMessage,
    MessageType,
    ReplyAddress,
    ScheduledEvent,
    Transition,
    TransitionKind,
    TransitionMessage,
    VmIdentity,
    decode,
)
from schemas.messages import content_digest
from schemas.transport import open_transport
from schemas.transport.rabbitmq import RabbitMQTransport
from schemas.wire import lifecycle_message

URL = os.environ.get("RELAY_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


def fleet_messages(count: int) -> list[LifecycleMessage]:
    """Realistic traffic: per VM an event scheduled, started, completed, and heartbeats."""
    rng = random.Random(7)
    start = datetime(2025, 1, 6, tzinfo=UTC)
    out: list[LifecycleMessage] = []
    vm_index = 0
    while len(out) < count:
        name = f"web_{vm_index}"
        vm = VmIdentity(
            name=name,
            resource_group="rg",
            scale_set="web",
            zone="1",
            fault_domain=vm_index % 3,
            resource_id=f"/vm/{name}",
        )
        reply = ReplyAddress(channel="scheduled-events.approvals", key=name)
        event_id = str(uuid.UUID(int=rng.getrandbits(128)))
        base = {
            "EventId": event_id,
            "EventType": "Freeze",
            "ResourceType": "VirtualMachine",
            "Resources": [name],
            "Description": "Live migration",
            "EventSource": "Platform",
            "DurationInSeconds": 5,
        }
        scheduled = ScheduledEvent.from_imds(
            base | {"EventStatus": "Scheduled", "NotBefore": "Mon, 06 Jan 2025 00:15:00 GMT"}
        )
        started = ScheduledEvent.from_imds(base | {"EventStatus": "Started", "NotBefore": ""})
        moment = start + timedelta(seconds=vm_index)
        for kind, event, previous in (
            (TransitionKind.SCHEDULED, scheduled, None),
            (TransitionKind.STARTED, started, "Scheduled"),
            (TransitionKind.COMPLETED, started, "Started"),
        ):
            out.append(
                TransitionMessage.build(
                    Transition(kind, event, previous, 1), vm=vm, reply_to=reply, observed_at=moment
                )
            )
        out.append(
            AgentMessage.build(
                MessageType.AGENT_HEARTBEAT,
                AgentData(vm=vm, agent_version="0.1.0", reply_to=reply, document_incarnation=3),
                observed_at=moment,
                instance="bench",
            )
        )
        vm_index += 1
    out = out[:count]
    repeats = rng.sample(out, count // 20)  # an agent's replays after a restart
    return out + repeats


async def fill(transport: RabbitMQTransport, messages: list[LifecycleMessage]) -> None:
    wire = [lifecycle_message(m) for m in messages]
    for offset in range(0, len(wire), 500):
        await asyncio.gather(*(transport.publish(w) for w in wire[offset : offset + 500]))


async def wait_depth(url: str, queue: str, depth: int) -> None:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        async with asyncio.timeout(120):
            while True:
                declared = await channel.declare_queue(queue, passive=True)
                if (declared.declaration_result.message_count or 0) >= depth:
                    return
                await asyncio.sleep(0.2)
    finally:
        await connection.close()


async def naive(url: str, queue: str, total: int, prefetch: int) -> float:
    """The consumer a team writes first: iterate, parse with pydantic, handle, ack each one."""
    handled: set[str] = set()
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        declared = await channel.declare_queue(queue, passive=True)
        count = 0
        started = 0.0
        async with declared.iterator() as messages:
            async for message in messages:
                if count == 0:
                    started = time.perf_counter()
                parsed = decode(message.body)
                handled.add(parsed.id)
                await message.ack()
                count += 1
                if count == total:
                    break
        return total / (time.perf_counter() - started)
    finally:
        await connection.close()


async def raw(url: str, queue: str, total: int, prefetch: int, ack_batch: int) -> float:
    """The ceiling: aiormq alone, no parsing, acks every ``ack_batch`` deliveries (and the
    last) with ``multiple``."""
    connection = await aiormq.connect(url)
    try:
        channel = await connection.channel()
        await channel.basic_qos(prefetch_count=prefetch)
        done = asyncio.get_running_loop().create_future()
        count = 0
        started = 0.0

        async def on_message(message: aiormq.abc.DeliveredMessage) -> None:
            nonlocal count, started
            if count == 0:
                started = time.perf_counter()
            count += 1
            if count % ack_batch == 0 or count == total:
                tag = message.delivery_tag
                assert tag is not None
                await channel.basic_ack(tag, multiple=True)
            if count == total and not done.done():
                done.set_result(time.perf_counter() - started)

        await channel.basic_consume(queue, on_message, no_ack=False)
        elapsed: float = await asyncio.wait_for(done, 300)
        return total / elapsed
    finally:
        await connection.close()


def check(window: DedupeWindow, body: bytes) -> None:
    """What FleetStream does for every message before its handlers: decode and validate it,
    look it up in the dedupe window and, under a new id, enter it with its content digest."""
    message = decode(body)
    key = message_key(message)
    if window.get(key) is None:
        window.add(key, content_digest(message))


async def checks_only(
    url: str, channels: ChannelNames, group: str, total: int, prefetch: int, ack_batch: int
) -> tuple[float, float]:
    """What every message needs and nothing else, on the transport's own subscription: decode
    and validate, digest, look up in and add to a dedupe window; acks as the ceiling's. Returns
    the rate and the microseconds a message spent in :func:`check` itself (wall time around
    each call: between frames it costs more than in :func:`required_cost`'s loop)."""
    window = DedupeWindow()
    checking = 0
    transport = open_transport(url, channels)
    assert isinstance(transport, RabbitMQTransport)
    async with transport, transport.subscribe(group, prefetch=prefetch) as deliveries:
        count = 0
        started = 0.0
        async for delivery in deliveries:
            if count == 0:
                started = time.perf_counter()
            count += 1
            before = time.perf_counter_ns()
            check(window, delivery.body)
            checking += time.perf_counter_ns() - before
            if count % ack_batch == 0 or count == total:
                await delivery.ack_through()
            if count == total:
                break
        return total / (time.perf_counter() - started), checking / total / 1000


async def stream(
    url: str, channels: ChannelNames, group: str, total: int, prefetch: int, distinct: int
) -> tuple[float, dict[str, int]]:
    handled: set[str] = set()
    async with open_transport(url, channels) as transport:
        fleet = FleetStream(transport, group, prefetch=prefetch)
        started = 0.0

        @fleet.on()
        async def handle(message: LifecycleMessage) -> None:
            nonlocal started
            if not handled:
                started = time.perf_counter()
            handled.add(message.id)

        @fleet.on(MessageType.AGENT_HEARTBEAT)
        async def done(message: LifecycleMessage) -> None:
            pass

        async def stopper() -> None:
            while fleet.stats.received < total:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            fleet.stop()

        async with asyncio.TaskGroup() as group_:
            group_.create_task(stopper())
            await fleet.run()
        elapsed = time.perf_counter() - started
        stats = {"handled": fleet.stats.handled, "duplicates": fleet.stats.duplicates}
        assert len(handled) == distinct, (len(handled), distinct)
        return total / elapsed, stats


def cpu_per_message(started: float, total: int) -> float:
    """Microseconds of this process's CPU a message since ``started`` (``time.process_time``)."""
    return (time.process_time() - started) / total * 1e6


def required_cost(bodies: list[bytes], rounds: int = 3) -> tuple[float, float]:
    """Microseconds of CPU a message, the best of ``rounds`` passes over ``bodies``: of
    :func:`schemas.decode` alone, and of everything FleetStream does for every message before
    its handlers (decode, :func:`~schemas.messages.content_digest`, the dedupe window's look-up
    and entry). Nothing is kept beyond the window: no collector work from a growing heap."""
    decoding = required = math.inf
    for _ in range(rounds):
        started = time.process_time()
        for body in bodies:
            decode(body)
        decoding = min(decoding, cpu_per_message(started, len(bodies)))
        window = DedupeWindow()
        started = time.process_time()
        for body in bodies:
            check(window, body)
        required = min(required, cpu_per_message(started, len(bodies)))
    return decoding, required


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--prefetch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    channels = ChannelNames().suffixed(f"bench-{uuid.uuid4().hex[:8]}")
    messages = fleet_messages(args.messages)
    total = len(messages)
    distinct = len({m.id for m in messages})
    groups = ["raw", "naive", "naive-p1", "checks", "stream"]
    transport = open_transport(URL, channels)
    assert isinstance(transport, RabbitMQTransport)
    ratios: list[float] = []
    decoding, required = required_cost([lifecycle_message(m).body for m in messages])
    print(
        f"alone, without a broker: decoding and validating {decoding:.1f} µs a message; with "
        f"the content digest and the dedupe window, what every message needs, {required:.1f}"
    )
    async with transport:
        for group in groups:
            await transport.declare_group(group)
        try:
            for round_ in range(1, args.rounds + 1):
                t0 = time.perf_counter()
                await fill(transport, messages)
                for group in groups:
                    await wait_depth(URL, transport.group_queue(group), total)
                print(
                    f"round {round_}: {total} messages ({distinct} distinct, "
                    f"{total - distinct} repeats) in {len(groups)} queues, published in "
                    f"{time.perf_counter() - t0:.1f} s"
                )
                # The stream's own ack batch, for a like-for-like ceiling.
                ack_batch = max(1, min(128, args.prefetch // 2))
                cpu = time.process_time()
                ceiling = await raw(
                    URL, transport.group_queue("raw"), total, args.prefetch, ack_batch
                )
                raw_cpu = cpu_per_message(cpu, total)
                print(
                    f"raw aiormq (ceiling), prefetch {args.prefetch:<4} {ceiling:9.0f} msg/s  "
                    f"{raw_cpu:6.1f} µs CPU a message"
                )
                cpu = time.process_time()
                naive_rate = await naive(URL, transport.group_queue("naive"), total, args.prefetch)
                print(
                    f"naive aio-pika, prefetch {args.prefetch:<4}  {naive_rate:9.0f} msg/s  "
                    f"{cpu_per_message(cpu, total):6.1f} µs CPU a message"
                )
                cpu = time.process_time()
                naive1 = await naive(URL, transport.group_queue("naive-p1"), total, 1)
                print(
                    f"naive aio-pika, prefetch 1     {naive1:9.0f} msg/s  "
                    f"{cpu_per_message(cpu, total):6.1f} µs CPU a message"
                )
                cpu = time.process_time()
                checks, in_check = await checks_only(
                    URL, channels, "checks", total, args.prefetch, ack_batch
                )
                print(
                    f"checks only, prefetch {args.prefetch:<4}     {checks:9.0f} msg/s  "
                    f"{cpu_per_message(cpu, total):6.1f} µs CPU a message "
                    f"({checks / ceiling:.0%} of the ceiling; the checks themselves "
                    f"{in_check:.1f} µs a message between frames, {required:.1f} alone)"
                )
                cpu = time.process_time()
                rate, stats = await stream(URL, channels, "stream", total, args.prefetch, distinct)
                stream_cpu = cpu_per_message(cpu, total)
                print(
                    f"FleetStream, prefetch {args.prefetch:<4}     {rate:9.0f} msg/s  "
                    f"{stream_cpu:6.1f} µs CPU a message "
                    f"({stats['handled']} handled, {stats['duplicates']} repeats dropped)"
                )
                # At 80 % of the ceiling FleetStream may spend the ceiling's CPU / 0.8 a
                # message: a quarter of the ceiling's on top of it, for all its own work.
                budget = raw_cpu / 0.8 - raw_cpu
                print(
                    f"FleetStream's own CPU a message: {stream_cpu - raw_cpu:.1f} µs over the "
                    f"ceiling's; 80 % of the ceiling leaves it {budget:.1f} µs, and what every "
                    f"message needs takes {required:.1f} alone"
                )
                ratios.append(rate / ceiling)
                print(
                    f"FleetStream / raw ceiling: {rate / ceiling:.0%}; / naive (same prefetch): "
                    f"{rate / naive_rate:.2f}x; / naive prefetch 1: {rate / naive1:.2f}x"
                )
        finally:
            await transport.delete_topology(groups=groups, exchanges=True)
    if len(ratios) > 1:
        print("FleetStream / ceiling per round: " + ", ".join(f"{r:.0%}" for r in ratios))


if __name__ == "__main__":
    asyncio.run(main())
