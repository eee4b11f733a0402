"""The real azure-servicebus async SDK against the Service Bus double, over loopback."""

from __future__ import annotations

import asyncio
import datetime
import time

import pytest
from azure.servicebus import (
    NEXT_AVAILABLE_SESSION,
    ServiceBusMessage,
    ServiceBusReceivedMessage,
    ServiceBusReceiveMode,
    ServiceBusSubQueue,
)
from azure.servicebus.aio import AutoLockRenewer, ServiceBusClient
from azure.servicebus.exceptions import (
    MessageLockLostError,
    MessagingEntityNotFoundError,
    OperationTimeoutError,
    SessionCannotBeLockedError,
)

from tests.servicebus.conftest import LOCK_DURATION, MAX_DELIVERY_COUNT, Handlers, eventually
from tests.servicebus_double import EntityOptions, ServiceBusDouble

pytestmark = [pytest.mark.servicebus, pytest.mark.timeout(30)]

WAIT = 2.0
EMPTY_WAIT = 0.3


def body(message: ServiceBusReceivedMessage) -> bytes:
    return b"".join(message.body)


async def test_send_receive_complete_round_trips_properties(handlers: Handlers) -> None:
    sent = ServiceBusMessage(
        b'{"a": 1}',
        message_id="m-1",
        content_type="application/json",
        correlation_id="corr",
        subject="subj",
        reply_to="replies",
        application_properties={"kind": "test", "n": 7},
    )
    await handlers.queue_sender("q").send_messages(sent)
    receiver = handlers.queue_receiver("q", max_wait_time=WAIT)
    (got,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
    assert body(got) == b'{"a": 1}'
    assert got.message_id == "m-1"
    assert got.content_type == "application/json"
    assert got.correlation_id == "corr"
    assert got.subject == "subj"
    assert got.reply_to == "replies"
    assert got.application_properties == {b"kind": b"test", b"n": 7}
    assert got.delivery_count == 0
    assert got.sequence_number == 1
    assert got.enqueued_time_utc is not None
    assert got.locked_until_utc is not None
    await receiver.complete_message(got)
    assert await receiver.receive_messages(max_wait_time=EMPTY_WAIT) == []


async def test_the_sdk_gives_every_message_an_id(
    handlers: Handlers, servicebus_double: ServiceBusDouble
) -> None:
    await handlers.queue_sender("q").send_messages(ServiceBusMessage(b"no id set"))
    (stored,) = servicebus_double.namespace.peek("q", 0, 1)
    assert stored.message_id  # a uuid4 string the SDK made up: duplicate detection sees it


async def test_topic_fans_out_to_every_subscription(handlers: Handlers) -> None:
    await handlers.topic_sender("t").send_messages(ServiceBusMessage(b"x", message_id="fan"))
    for sub in ("a", "b"):
        receiver = handlers.subscription_receiver("t", sub, max_wait_time=WAIT)
        got = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
        assert [m.message_id for m in got] == ["fan"]
        await receiver.complete_message(got[0])


async def test_queue_gives_each_message_to_one_receiver(handlers: Handlers) -> None:
    await handlers.queue_sender("q").send_messages(
        [ServiceBusMessage(b"x", message_id=f"m{i}") for i in range(4)]
    )
    first = handlers.queue_receiver("q", max_wait_time=WAIT)
    second = handlers.queue_receiver("q", max_wait_time=WAIT)
    got_first = await first.receive_messages(max_message_count=2, max_wait_time=WAIT)
    got_second = await second.receive_messages(max_message_count=4, max_wait_time=WAIT)
    assert len(got_first) == 2
    ids = [str(m.message_id) for m in got_first + got_second]
    assert sorted(ids) == ["m0", "m1", "m2", "m3"]


async def test_batches_are_unpacked(handlers: Handlers) -> None:
    sender = handlers.queue_sender("q")
    batch = await sender.create_message_batch()
    for i in range(3):
        batch.add_message(ServiceBusMessage(f"b{i}".encode(), session_id=None))
    await sender.send_messages(batch)
    await sender.send_messages([ServiceBusMessage(b"l0"), ServiceBusMessage(b"l1")])
    receiver = handlers.queue_receiver(
        "q", max_wait_time=WAIT, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE
    )
    got: list[ServiceBusReceivedMessage] = []
    while len(got) < 5:
        more = await receiver.receive_messages(max_message_count=5, max_wait_time=WAIT)
        assert more, f"only {len(got)} of 5 arrived"
        got += more
    assert [body(m) for m in got] == [b"b0", b"b1", b"b2", b"l0", b"l1"]


async def test_receive_and_delete_removes_the_message(
    handlers: Handlers, servicebus_double: ServiceBusDouble
) -> None:
    await handlers.queue_sender("q").send_messages(ServiceBusMessage(b"gone"))
    receiver = handlers.queue_receiver(
        "q", max_wait_time=WAIT, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE
    )
    (got,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
    assert body(got) == b"gone"
    assert servicebus_double.namespace.count("q") == 0


async def test_abandon_redelivers_with_delivery_count_plus_one(handlers: Handlers) -> None:
    await handlers.queue_sender("q").send_messages(ServiceBusMessage(b"again"))
    receiver = handlers.queue_receiver("q", max_wait_time=WAIT)
    (first,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
    await receiver.abandon_message(first)
    (second,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
    assert second.delivery_count == 1
    assert second.sequence_number == first.sequence_number
    await receiver.complete_message(second)


async def test_dead_letter_is_readable_from_the_dead_letter_queue(handlers: Handlers) -> None:
    await handlers.queue_sender("q").send_messages(ServiceBusMessage(b"poison", message_id="p"))
    receiver = handlers.queue_receiver("q", max_wait_time=WAIT)
    (got,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
    await receiver.dead_letter_message(got, reason="BadInput", error_description="not json")
    assert await receiver.receive_messages(max_wait_time=EMPTY_WAIT) == []
    dlq = handlers.queue_receiver("q", sub_queue=ServiceBusSubQueue.DEAD_LETTER)
    (dead,) = await dlq.receive_messages(max_message_count=1, max_wait_time=WAIT)
    assert dead.message_id == "p"
    assert dead.dead_letter_reason == "BadInput"
    assert dead.dead_letter_error_description == "not json"
    assert dead.dead_letter_source == "q"
    await dlq.complete_message(dead)


async def test_expired_lock_makes_the_message_available_again(handlers: Handlers) -> None:
    await handlers.queue_sender("q").send_messages(ServiceBusMessage(b"slow"))
    receiver = handlers.queue_receiver("q", max_wait_time=WAIT)
    (first,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
    assert first.delivery_count == 0
    await asyncio.sleep(LOCK_DURATION + 0.2)
    with pytest.raises(MessageLockLostError):
        await receiver.complete_message(first)
    (second,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
    assert second.delivery_count == 1
    assert second.lock_token != first.lock_token
    await receiver.complete_message(second)


async def test_max_delivery_count_moves_the_message_to_the_dead_letter_queue(
    handlers: Handlers,
) -> None:
    await handlers.queue_sender("q").send_messages(ServiceBusMessage(b"bad", message_id="bad"))
    receiver = handlers.queue_receiver("q", max_wait_time=WAIT)
    for attempt in range(MAX_DELIVERY_COUNT):
        (got,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
        assert got.delivery_count == attempt
        await receiver.abandon_message(got)
    dlq = handlers.queue_receiver("q", sub_queue=ServiceBusSubQueue.DEAD_LETTER)
    (dead,) = await dlq.receive_messages(max_message_count=1, max_wait_time=WAIT)
    assert dead.message_id == "bad"
    assert dead.dead_letter_reason == "MaxDeliveryCountExceeded"
    assert await receiver.receive_messages(max_wait_time=EMPTY_WAIT) == []


async def test_renew_message_lock_keeps_the_lock(handlers: Handlers) -> None:
    await handlers.queue_sender("q").send_messages(ServiceBusMessage(b"long"))
    receiver = handlers.queue_receiver("q", max_wait_time=WAIT)
    (got,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
    before = got.locked_until_utc
    assert before is not None
    for _ in range(3):
        await asyncio.sleep(LOCK_DURATION / 2)
        renewed = await receiver.renew_message_lock(got)
        assert renewed > before
    await receiver.complete_message(got)


@pytest.mark.slow
async def test_auto_lock_renewer_keeps_the_lock_past_its_duration() -> None:
    # The async AutoLockRenewer looks once a second and renews when half the lock (rounded
    # down to whole seconds) is left, so it needs a lock of a few seconds to keep up.
    lock_duration = 2.5
    with ServiceBusDouble(queues=["q"], options=EntityOptions(lock_duration=lock_duration)) as sb:
        async with ServiceBusClient.from_connection_string(sb.connection_string) as client:
            opened = Handlers(client)
            renewer = AutoLockRenewer(max_lock_renewal_duration=30)
            try:
                await opened.queue_sender("q").send_messages(ServiceBusMessage(b"long"))
                receiver = opened.queue_receiver("q", max_wait_time=WAIT, auto_lock_renewer=renewer)
                (got,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
                await asyncio.sleep(lock_duration * 1.5)
                assert got.auto_renew_error is None
                await receiver.complete_message(got)
                assert sb.namespace.count("q") == 0
            finally:
                await renewer.close()
                await opened.close()


async def test_session_receiver_gets_only_its_session(handlers: Handlers) -> None:
    await handlers.queue_sender("sq").send_messages(
        [
            ServiceBusMessage(b"a1", session_id="A"),
            ServiceBusMessage(b"b1", session_id="B"),
            ServiceBusMessage(b"a2", session_id="A"),
        ]
    )
    for_a = handlers.queue_receiver("sq", session_id="A", max_wait_time=WAIT)
    got = await for_a.receive_messages(max_message_count=5, max_wait_time=WAIT)
    assert [body(m) for m in got] == [b"a1", b"a2"]
    assert {m.session_id for m in got} == {"A"}
    for message in got:
        await for_a.complete_message(message)
    next_free = handlers.queue_receiver("sq", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=WAIT)
    (b1,) = await next_free.receive_messages(max_message_count=5, max_wait_time=WAIT)
    assert next_free.session.session_id == "B"
    assert body(b1) == b"b1"
    await next_free.complete_message(b1)


async def test_a_locked_session_cannot_be_accepted_twice(handlers: Handlers) -> None:
    await handlers.queue_sender("sq").send_messages(ServiceBusMessage(b"a", session_id="A"))
    holder = handlers.queue_receiver("sq", session_id="A", max_wait_time=WAIT)
    await holder.receive_messages(max_message_count=1, max_wait_time=WAIT)
    other = handlers.queue_receiver("sq", session_id="A", max_wait_time=WAIT)
    with pytest.raises(SessionCannotBeLockedError):
        await other.receive_messages(max_wait_time=WAIT)


async def test_session_state_round_trips(handlers: Handlers) -> None:
    # A session need not have messages to be locked; the first call opens the link. (Note
    # that receive_messages(max_wait_time=...) spends that budget on opening the link too.)
    receiver = handlers.queue_receiver("sq", session_id="S", max_wait_time=WAIT)
    assert await receiver.session.get_state() is None
    await receiver.session.set_state(b"checkpoint-1")
    assert await receiver.session.get_state() == b"checkpoint-1"
    before = receiver.session.locked_until_utc
    assert before is not None
    assert await receiver.session.renew_lock() >= before


async def test_next_available_session_times_out_when_none_is_free(handlers: Handlers) -> None:
    started = time.monotonic()
    receiver = handlers.queue_receiver("sq", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=1)
    with pytest.raises(OperationTimeoutError):
        await receiver.receive_messages(max_wait_time=1)
    assert time.monotonic() - started < 10


async def test_peek_does_not_lock(handlers: Handlers) -> None:
    await handlers.queue_sender("q").send_messages(
        [ServiceBusMessage(f"p{i}".encode()) for i in range(3)]
    )
    receiver = handlers.queue_receiver("q", max_wait_time=WAIT)
    peeked = await receiver.peek_messages(max_message_count=2)
    assert [body(m) for m in peeked] == [b"p0", b"p1"]
    assert [m.sequence_number for m in peeked] == [1, 2]
    got = await receiver.receive_messages(max_message_count=3, max_wait_time=WAIT)
    assert len(got) == 3


async def test_duplicate_message_id_is_dropped(
    handlers: Handlers, servicebus_double: ServiceBusDouble
) -> None:
    sender = handlers.queue_sender("q")
    await sender.send_messages(ServiceBusMessage(b"1", message_id="same"))
    await sender.send_messages(ServiceBusMessage(b"2", message_id="same"))
    assert servicebus_double.namespace.count("q") == 1


async def test_sender_to_an_unknown_entity_is_not_found(handlers: Handlers) -> None:
    with pytest.raises(MessagingEntityNotFoundError):
        await handlers.queue_sender("nope").send_messages(ServiceBusMessage(b"x"))


async def test_receiver_on_an_unknown_entity_is_not_found(handlers: Handlers) -> None:
    with pytest.raises(MessagingEntityNotFoundError):
        await handlers.queue_receiver("nope").receive_messages(max_wait_time=WAIT)


async def test_deferred_messages_are_received_by_sequence_number(handlers: Handlers) -> None:
    await handlers.queue_sender("q").send_messages(ServiceBusMessage(b"later"))
    receiver = handlers.queue_receiver("q", max_wait_time=WAIT)
    (got,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
    sequence_number = got.sequence_number
    assert sequence_number is not None
    await receiver.defer_message(got)
    assert await receiver.receive_messages(max_wait_time=EMPTY_WAIT) == []
    (deferred,) = await receiver.receive_deferred_messages([sequence_number])
    assert body(deferred) == b"later"
    await receiver.complete_message(deferred)


async def test_session_enabled_subscription() -> None:
    with ServiceBusDouble(session_topics={"st": ["s"]}, topics={"st": ["plain"]}) as sb:
        async with ServiceBusClient.from_connection_string(sb.connection_string) as client:
            opened = Handlers(client)
            try:
                await opened.topic_sender("st").send_messages(
                    ServiceBusMessage(b"x", session_id="vm-1")
                )
                receiver = opened.subscription_receiver(
                    "st", "s", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=WAIT
                )
                (got,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
                assert receiver.session.session_id == "vm-1"
                await receiver.complete_message(got)
                assert sb.namespace.count("st/Subscriptions/plain") == 1
            finally:
                await opened.close()


async def test_an_expired_message_is_not_delivered(handlers: Handlers) -> None:
    # The SDK sends whole seconds: int(time_to_live.total_seconds()) * 1000 ms, so anything
    # under a second goes out as 0, which means no expiry at all.
    sender = handlers.queue_sender("q")
    await sender.send_messages(
        ServiceBusMessage(b"stale", time_to_live=datetime.timedelta(seconds=1))
    )
    await sender.send_messages(ServiceBusMessage(b"fresh"))
    await asyncio.sleep(1.1)
    receiver = handlers.queue_receiver("q", max_wait_time=WAIT)
    (got,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
    assert body(got) == b"fresh"
    assert got.time_to_live is None


#: More connections than select() can watch (descriptors 0 to 1,023), beside the test's own.
HELD_CONNECTIONS = 1100


async def test_the_double_serves_more_connections_than_select_can_watch(
    servicebus_double: ServiceBusDouble, handlers: Handlers
) -> None:
    """proton's reactor watched its sockets with select(), which refuses a descriptor above
    1,023: once the double had accepted about a thousand connections (a fleet of 1,000 agents
    opens more), its thread died on "filedescriptor out of range in select()" and nothing was
    served any more. With 1,100 idle connections held, it accepts them all and the SDK still
    sends and receives."""
    import resource
    import socket

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * HELD_CONNECTIONS + 512  # both ends live in this process
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"this machine allows {hard} open files; the test needs {needed}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    held: list[socket.socket] = []
    try:
        for _ in range(HELD_CONNECTIONS):
            held.append(socket.create_connection(("127.0.0.1", servicebus_double.port)))
        await eventually(
            lambda: servicebus_double.usage().connections.now >= HELD_CONNECTIONS, within=15
        )
        await handlers.queue_sender("q").send_messages(ServiceBusMessage(b"still serving"))
        receiver = handlers.queue_receiver("q")
        (got,) = await receiver.receive_messages(max_message_count=1, max_wait_time=10)
        await receiver.complete_message(got)
    finally:
        for sock in held:
            sock.close()
    assert body(got) == b"still serving"
