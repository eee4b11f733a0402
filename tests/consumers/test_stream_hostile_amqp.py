"""The fleet stream on the real RabbitMQ against what a hostile publisher can put in an AMQP
message besides its body: headers and properties that no client of ours would write.

Anyone who may publish to the events exchange (any VM's agent user) chooses every byte of a
message's content header. aio-pika and pamqp write only well-formed values, so these tests lay
the hostile bytes on the wire by hand (:func:`publish_raw`) on a plain aiormq connection; the
broker takes them as any publisher's. What an operator must see each time: the bad message
dead-lettered with its reason, the stream still consuming on the same link, and the next good
message handled exactly once.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Mapping

import aiormq
import pytest
from pamqp import commands as spec

from consumers import FleetStream
from schemas import ChannelNames, LifecycleMessage
from schemas.transport import DEAD_LETTER_REASON
from schemas.transport._base import PropertyValue
from schemas.transport.rabbitmq import AmqpSettings, RabbitMQTransport
from schemas.wire import lifecycle_message

from ._factory import event, transition, vm

pytestmark = pytest.mark.rabbitmq

GROUP = "audit"
BOUND = 30.0


@pytest.fixture
async def rabbit(amqp_url: str, unique: str) -> AsyncIterator[RabbitMQTransport]:
    channels = ChannelNames().suffixed(unique)
    settings = AmqpSettings(connect_timeout=3, reconnect_timeout=5, confirm_timeout=5)
    async with RabbitMQTransport(amqp_url, channels, settings=settings) as transport:
        yield transport
        await transport.delete_topology(groups=[GROUP], exchanges=True)


# -- the hostile publisher ----------------------------------------------------------------------


def shortstr(raw: bytes) -> bytes:
    return bytes([len(raw)]) + raw


def table(*entries: tuple[bytes, bytes]) -> bytes:
    """A field table of (name, type octet + value) entries, as laid on the wire."""
    content = b"".join(shortstr(name) + value for name, value in entries)
    return struct.pack(">I", len(content)) + content


#: The property flags of a content header (AMQP 0-9-1, basic class), in wire order.
FLAGS = {
    "content_type": 1 << 15,
    "headers": 1 << 13,
    "message_id": 1 << 7,
    "timestamp": 1 << 6,
}


def properties(**fields: bytes) -> bytes:
    """A content header's property list: the flags, then each field's encoded value in order."""
    flags = 0
    for name in fields:
        flags |= FLAGS[name]
    return struct.pack(">H", flags) + b"".join(fields[name] for name in FLAGS if name in fields)


class _RawProperties(spec.Basic.Properties):
    """Properties that marshal to the bytes given (pamqp would refuse to write them)."""

    def __init__(self, raw: bytes) -> None:
        super().__init__(message_id="hostile")  # aiormq keys its confirm on it
        self._raw = raw

    def marshal(self) -> bytes:
        return self._raw


async def publish_raw(
    amqp_url: str, exchange: str, routing_key: str, body: bytes, raw_properties: bytes
) -> None:
    """Publish ``body`` with a content header of the given property bytes, confirmed."""
    connection = await aiormq.connect(amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        confirm = await channel.basic_publish(
            body,
            exchange=exchange,
            routing_key=routing_key,
            properties=_RawProperties(raw_properties),
            mandatory=True,
        )
        assert isinstance(confirm, spec.Basic.Ack), confirm
    finally:
        await connection.close()


# -- the consumer -------------------------------------------------------------------------------


async def _handle_until(
    stream: FleetStream, last: LifecycleMessage, handled: list[str], within: float
) -> None:
    """Run the stream until ``last`` was handled (every message is recorded in ``handled``)."""

    @stream.on()
    async def record(message: LifecycleMessage) -> None:
        handled.append(message.id)
        if message.id == last.id:
            stream.stop()

    async with asyncio.timeout(within):
        await stream.run()


async def _dead_letters(
    transport: RabbitMQTransport, count: int
) -> dict[bytes, Mapping[str, PropertyValue]]:
    """The first ``count`` dead letters of the group: body -> properties."""
    letters: dict[bytes, Mapping[str, PropertyValue]] = {}
    async with transport.dead_letters(GROUP) as dead:
        async with asyncio.timeout(10):
            async for delivery in dead:
                letters[delivery.body] = delivery.properties
                await delivery.ack()
                if len(letters) == count:
                    break
    return letters


async def test_headers_the_client_reads_but_cannot_write_again_cost_only_their_dead_letter(
    rabbit: RabbitMQTransport, amqp_url: str
) -> None:
    """pamqp reads some header values it cannot write back: a long string that is not UTF-8
    (read as bytes), a decimal whose unsigned mantissa exceeds the signed range it writes, a
    double beyond the single-precision float it writes Python floats as; and headers that
    fill a content header frame, which the copy's added reason would overflow. A dead letter is
    a copy of the message with its headers, so each of these once made dead-lettering raise,
    which ended the stream (and the service) at the first such message, or made the broker
    close the link, which delivered the message again, round and round."""
    hostile = {
        b"not-utf8": (b"note", b"S" + struct.pack(">I", 2) + b"\xff\xfe"),
        b"big-decimal": (b"price", b"D" + struct.pack(">BI", 2, 0xFFFFFFFF)),
        b"huge-double": (b"ratio", b"d" + struct.pack(">d", 1e300)),
        # As large as a content header may be (RabbitMQ's frame_max, 128 KiB): the copy, with
        # the reason added, would not fit in one frame, and the broker would close the link.
        b"huge-headers": (b"pad", b"S" + struct.pack(">I", 130_960) + b"p" * 130_960),
    }
    good = transition("scheduled", event("EVT-AFTER"), vm("web-1"))
    last = transition("scheduled", event("EVT-LAST"), vm("web-1"))
    await rabbit.declare_group(GROUP)
    for body, entry in hostile.items():
        await publish_raw(
            amqp_url,
            rabbit.channels.events_exchange,
            "scheduled.Reboot.web-1",
            body,
            properties(headers=table(entry, (b"vm", b"S" + struct.pack(">I", 5) + b"web-1"))),
        )
    await rabbit.publish(lifecycle_message(good))
    await rabbit.publish(lifecycle_message(good))  # an agent's repeat
    await rabbit.publish(lifecycle_message(last))
    stream = FleetStream(rabbit, GROUP)
    handled: list[str] = []
    await _handle_until(stream, last, handled, BOUND)
    assert handled == [good.id, last.id]
    assert stream.stats.reconnects == 0
    letters = await _dead_letters(rabbit, len(hostile))
    assert set(letters) == set(hostile)
    for letter in letters.values():
        assert letter[DEAD_LETTER_REASON] == "not-json"
        assert letter["vm"] == "web-1"  # what could be written again was kept


def _nested_table(depth: int) -> bytes:
    """Headers of tables within tables, ``depth`` deep (7 bytes a level)."""
    inner = struct.pack(">I", 0)
    for _ in range(depth):
        entry = shortstr(b"a") + b"F" + inner
        inner = struct.pack(">I", len(entry)) + entry
    return inner


async def test_properties_the_client_cannot_read_cost_no_link_and_no_other_message(
    rabbit: RabbitMQTransport, amqp_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """pamqp raises on some property values the broker passes on as they were published: a
    string property or header name that is not UTF-8, a timestamp beyond the years a datetime
    holds, headers nested deeper than Python's recursion limit. It raised while aiormq read the
    frame, which ended the whole connection (the publishing channel's, every subscription's):
    the broker delivered the message again after the reconnect, and the link went down again,
    for as long as the message stayed in the queue. What the client cannot read is left out
    now (and logged), and the message is judged on its body like any other."""
    timestamp_overflow = struct.pack(">Q", 2**64 - 1)
    hostile = {
        b"message-id-not-utf8": properties(message_id=shortstr(b"\xff\xfe")),
        b"content-type-not-utf8": properties(content_type=shortstr(b"\xc3\x28")),
        b"timestamp-overflow": properties(timestamp=timestamp_overflow),
        b"header-name-not-utf8": properties(headers=table((b"\xff", b"t\x01"))),
        b"header-timestamp-overflow": properties(
            headers=table((b"when", b"T" + timestamp_overflow))
        ),
        b"headers-too-deep": properties(headers=_nested_table(5000)),
    }
    first = transition("scheduled", event("EVT-FIRST"), vm("web-1"))
    last = transition("scheduled", event("EVT-LAST"), vm("web-1"))
    await rabbit.declare_group(GROUP)
    for body, raw_properties in hostile.items():
        await publish_raw(
            amqp_url,
            rabbit.channels.events_exchange,
            "scheduled.Reboot.web-1",
            body,
            raw_properties,
        )
    # A good message with unreadable properties is still a good message.
    await publish_raw(
        amqp_url,
        rabbit.channels.events_exchange,
        first.routing_key,
        first.to_bytes(),
        properties(message_id=shortstr(b"\xff"), timestamp=timestamp_overflow),
    )
    await rabbit.publish(lifecycle_message(first))  # an agent's repeat
    await rabbit.publish(lifecycle_message(last))
    stream = FleetStream(rabbit, GROUP)
    handled: list[str] = []
    await _handle_until(stream, last, handled, BOUND)
    assert handled == [first.id, last.id]
    assert not [r for r in caplog.records if "lost the link" in r.getMessage()]
    letters = await _dead_letters(rabbit, len(hostile))
    assert set(letters) == set(hostile)
    assert {letter[DEAD_LETTER_REASON] for letter in letters.values()} == {"not-json"}


async def test_a_delivery_count_the_publisher_wrote_is_not_taken_for_the_brokers(
    rabbit: RabbitMQTransport, amqp_url: str
) -> None:
    """RabbitMQ's quorum queue writes ``x-delivery-count`` only on a redelivery: on the first,
    a header the publisher wrote under that name reached the consumer as the broker's count. A
    message published with it at 7 was taken for its 8th attempt: a handler that failed once
    had it dead-lettered at once, "failed 8 times", and every such message made the consumers
    ask their database whether another process had handled it."""
    message = transition("scheduled", event("EVT-COUNTED"), vm("web-1"))
    await rabbit.declare_group(GROUP)
    outgoing = lifecycle_message(message)
    await publish_raw(
        amqp_url,
        rabbit.channels.events_exchange,
        outgoing.routing_key,
        outgoing.body,
        properties(headers=table((b"x-delivery-count", b"l" + struct.pack(">q", 7)))),
    )
    stream = FleetStream(rabbit, GROUP, max_attempts=3, retry_delay=0.01)
    attempts: list[int] = []

    @stream.on()
    async def flaky(received: LifecycleMessage) -> None:
        assert stream.current_delivery is not None
        attempts.append(stream.current_delivery.delivery_count)
        if len(attempts) == 1:
            raise RuntimeError("a database blip")
        stream.stop()

    async with asyncio.timeout(BOUND):
        await stream.run()
    assert attempts == [0, 1]
    assert stream.stats.dead_lettered == 0
