"""The real azure-servicebus async SDK against the Service Bus double, over loopback."""

from __future__ import annotations

import asyncio
import time

import pytest
from azure.servicebus import (
    NEXT_AVAILABLE_SESSION,
    ServiceBusMessage,
    ServiceBusReceiveMode,
    ServiceBusSubQueue,
)
from azure.servicebus.aio import AutoLockRenewer, ServiceBusClient
from azure.servicebus.exceptions import (
    MessagingEntityNotFoundError,
    OperationTimeoutError,
    SessionCannotBeLockedError,
)

from tests.servicebus.conftest import LOCK_DURATION, MAX_DELIVERY_COUNT
from tests.servicebus_double import EntityOptions, ServiceBusDouble

pytestmark = [pytest.mark.servicebus, pytest.mark.timeout(30)]

WAIT = 2.0


async def _send(client: ServiceBusClient, queue: str, *messages: ServiceBusMessage) -> None:
    async with client.get_queue_sender(queue) as sender:
        await sender.send_messages(list(messages))


async def test_send_receive_complete_round_trips_properties(client: ServiceBusClient) -> None:
    sent = ServiceBusMessage(
        b'{"a": 1}',
        message_id="m-1",
        content_type="application/json",
        correlation_id="corr",
        subject="subj",
        reply_to="replies",
        application_properties={"kind": "test", "n": 7},
    )
    async with client.get_queue_sender("q") as sender:
        await sender.send_messages(sent)
    async with client.get_queue_receiver("q", max_wait_time=WAIT) as receiver:
        (got,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
        assert b"".join(got.body) == b'{"a": 1}'
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
        assert await receiver.receive_messages(max_wait_time=0.5) == []


async def test_topic_fans_out_to_every_subscription(client: ServiceBusClient) -> None:
    async with client.get_topic_sender("t") as sender:
        await sender.send_messages(ServiceBusMessage(b"x", message_id="fan"))
    for sub in ("a", "b"):
        async with client.get_subscription_receiver("t", sub, max_wait_time=WAIT) as receiver:
            got = await receiver.receive_messages(max_message_count=5, max_wait_time=WAIT)
            assert [m.message_id for m in got] == ["fan"]
            await receiver.complete_message(got[0])


async def test_queue_gives_each_message_to_one_receiver(client: ServiceBusClient) -> None:
    await _send(client, "q", *(ServiceBusMessage(b"x", message_id=f"m{i}") for i in range(4)))
    async with (
        client.get_queue_receiver("q", max_wait_time=WAIT) as first,
        client.get_queue_receiver("q", max_wait_time=WAIT) as second,
    ):
        got_first = await first.receive_messages(max_message_count=2, max_wait_time=WAIT)
        got_second = await second.receive_messages(max_message_count=4, max_wait_time=1)
        ids = [str(m.message_id) for m in got_first + got_second]
        assert sorted(ids) == ["m0", "m1", "m2", "m3"]
        assert len(got_first) == 2


async def test_batch_send_is_unpacked(client: ServiceBusClient) -> None:
    async with client.get_queue_sender("q") as sender:
        batch = await sender.create_message_batch()
        for i in range(3):
            batch.add_message(ServiceBusMessage(f"b{i}".encode(), message_id=f"b{i}"))
        await sender.send_messages(batch)
        await sender.send_messages([ServiceBusMessage(b"l0"), ServiceBusMessage(b"l1")])
    async with client.get_queue_receiver(
        "q", max_wait_time=WAIT, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE
    ) as receiver:
        got = await receiver.receive_messages(max_message_count=10, max_wait_time=WAIT)
        assert [b"".join(m.body) for m in got] == [b"b0", b"b1", b"b2", b"l0", b"l1"]


async def test_receive_and_delete_removes_the_message(
    client: ServiceBusClient, servicebus_double: ServiceBusDouble
) -> None:
    await _send(client, "q", ServiceBusMessage(b"gone"))
    async with client.get_queue_receiver(
        "q", max_wait_time=WAIT, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE
    ) as receiver:
        (got,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
        assert b"".join(got.body) == b"gone"
    assert servicebus_double.namespace.count("q") == 0


async def test_abandon_redelivers_with_delivery_count_plus_one(client: ServiceBusClient) -> None:
    await _send(client, "q", ServiceBusMessage(b"again"))
    async with client.get_queue_receiver("q", max_wait_time=WAIT) as receiver:
        (first,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
        await receiver.abandon_message(first)
        (second,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
        assert second.delivery_count == 1
        assert second.sequence_number == first.sequence_number
        await receiver.complete_message(second)


async def test_dead_letter_is_readable_from_the_dead_letter_queue(
    client: ServiceBusClient,
) -> None:
    await _send(client, "q", ServiceBusMessage(b"poison", message_id="p"))
    async with client.get_queue_receiver("q", max_wait_time=WAIT) as receiver:
        (got,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
        await receiver.dead_letter_message(got, reason="BadInput", error_description="not json")
        assert await receiver.receive_messages(max_wait_time=0.5) == []
    async with client.get_queue_receiver(
        "q", sub_queue=ServiceBusSubQueue.DEAD_LETTER, max_wait_time=WAIT
    ) as dlq:
        (dead,) = await dlq.receive_messages(max_message_count=1, max_wait_time=WAIT)
        assert dead.message_id == "p"
        assert dead.dead_letter_reason == "BadInput"
        assert dead.dead_letter_error_description == "not json"
        assert dead.dead_letter_source == "q"
        await dlq.complete_message(dead)


async def test_expired_lock_makes_the_message_available_again(client: ServiceBusClient) -> None:
    await _send(client, "q", ServiceBusMessage(b"slow"))
    async with client.get_queue_receiver("q", max_wait_time=WAIT) as receiver:
        (first,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
        assert first.delivery_count == 0
        await asyncio.sleep(LOCK_DURATION + 0.3)
        (second,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
        assert second.delivery_count == 1
        assert second.lock_token != first.lock_token
        await receiver.complete_message(second)


async def test_max_delivery_count_moves_the_message_to_the_dead_letter_queue(
    client: ServiceBusClient,
) -> None:
    await _send(client, "q", ServiceBusMessage(b"bad", message_id="bad"))
    async with client.get_queue_receiver("q", max_wait_time=WAIT) as receiver:
        for attempt in range(MAX_DELIVERY_COUNT):
            (got,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
            assert got.delivery_count == attempt
            await receiver.abandon_message(got)
        assert await receiver.receive_messages(max_wait_time=0.5) == []
    async with client.get_queue_receiver(
        "q", sub_queue=ServiceBusSubQueue.DEAD_LETTER, max_wait_time=WAIT
    ) as dlq:
        (dead,) = await dlq.receive_messages(max_message_count=1, max_wait_time=WAIT)
        assert dead.message_id == "bad"
        assert dead.dead_letter_reason == "MaxDeliveryCountExceeded"


async def test_renew_message_lock_keeps_the_lock(client: ServiceBusClient) -> None:
    await _send(client, "q", ServiceBusMessage(b"long"))
    async with client.get_queue_receiver("q", max_wait_time=WAIT) as receiver:
        (got,) = await receiver.receive_messages(max_message_count=1, max_wait_time=WAIT)
        before = got.locked_until_utc
        assert before is not None
        for _ in range(3):
            await asyncio.sleep(LOCK_DURATION / 2)
            renewed = await receiver.renew_message_lock(got)
            assert renewed > before
        await receiver.complete_message(got)


async def test_auto_lock_renewer_keeps_the_lock_past_its_duration() -> None:
    # The async AutoLockRenewer checks once a second and renews when less than half the lock
    # duration is left, so it needs a lock of a few seconds to keep up.
    lock_duration = 3.0
    with ServiceBusDouble(queues=["q"], options=EntityOptions(lock_duration=lock_duration)) as sb:
        async with ServiceBusClient.from_connection_string(sb.connection_string) as client:
            await _send(client, "q", ServiceBusMessage(b"long"))
            renewer = AutoLockRenewer(max_lock_renewal_duration=30)
            try:
                async with client.get_queue_receiver(
                    "q", max_wait_time=WAIT, auto_lock_renewer=renewer
                ) as receiver:
                    (got,) = await receiver.receive_messages(
                        max_message_count=1, max_wait_time=WAIT
                    )
                    await asyncio.sleep(lock_duration * 1.5)
                    assert got.auto_renew_error is None
                    await receiver.complete_message(got)
                    assert sb.namespace.count("q") == 0
            finally:
                await renewer.close()


async def test_session_receiver_gets_only_its_session(client: ServiceBusClient) -> None:
    await _send(
        client,
        "sq",
        ServiceBusMessage(b"a1", session_id="A"),
        ServiceBusMessage(b"b1", session_id="B"),
        ServiceBusMessage(b"a2", session_id="A"),
    )
    async with client.get_queue_receiver("sq", session_id="A", max_wait_time=WAIT) as receiver:
        got = await receiver.receive_messages(max_message_count=5, max_wait_time=WAIT)
        assert [b"".join(m.body) for m in got] == [b"a1", b"a2"]
        assert {m.session_id for m in got} == {"A"}
        for message in got:
            await receiver.complete_message(message)
    async with client.get_queue_receiver(
        "sq", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=WAIT
    ) as receiver:
        assert receiver.session.session_id == "B"
        (b1,) = await receiver.receive_messages(max_message_count=5, max_wait_time=WAIT)
        assert b"".join(b1.body) == b"b1"
        await receiver.complete_message(b1)


async def test_a_locked_session_cannot_be_accepted_twice(client: ServiceBusClient) -> None:
    await _send(client, "sq", ServiceBusMessage(b"a", session_id="A"))
    async with client.get_queue_receiver("sq", session_id="A", max_wait_time=WAIT) as holder:
        await holder.receive_messages(max_message_count=1, max_wait_time=WAIT)
        with pytest.raises(SessionCannotBeLockedError):
            async with client.get_queue_receiver("sq", session_id="A", max_wait_time=WAIT) as other:
                await other.receive_messages(max_wait_time=WAIT)


async def test_session_state_round_trips(client: ServiceBusClient) -> None:
    await _send(client, "sq", ServiceBusMessage(b"s", session_id="S"))
    async with client.get_queue_receiver("sq", session_id="S", max_wait_time=WAIT) as receiver:
        assert await receiver.session.get_state() is None
        await receiver.session.set_state(b"checkpoint-1")
        assert await receiver.session.get_state() == b"checkpoint-1"
        expiry = await receiver.session.renew_lock()
        assert expiry is not None


async def test_next_available_session_times_out_when_none_is_free(
    client: ServiceBusClient,
) -> None:
    started = time.monotonic()
    with pytest.raises(OperationTimeoutError):
        async with client.get_queue_receiver(
            "sq", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=1
        ) as receiver:
            await receiver.receive_messages(max_wait_time=1)
    assert time.monotonic() - started < 10


async def test_peek_does_not_lock(client: ServiceBusClient) -> None:
    await _send(client, "q", *(ServiceBusMessage(f"p{i}".encode()) for i in range(3)))
    async with client.get_queue_receiver("q", max_wait_time=WAIT) as receiver:
        peeked = await receiver.peek_messages(max_message_count=2)
        assert [b"".join(m.body) for m in peeked] == [b"p0", b"p1"]
        assert [m.sequence_number for m in peeked] == [1, 2]
        got = await receiver.receive_messages(max_message_count=3, max_wait_time=WAIT)
        assert len(got) == 3


async def test_duplicate_message_id_is_dropped(
    client: ServiceBusClient, servicebus_double: ServiceBusDouble
) -> None:
    await _send(client, "q", ServiceBusMessage(b"1", message_id="same"))
    await _send(client, "q", ServiceBusMessage(b"2", message_id="same"))
    assert servicebus_double.namespace.count("q") == 1


async def test_unknown_entity_is_not_found(client: ServiceBusClient) -> None:
    with pytest.raises(MessagingEntityNotFoundError):
        async with client.get_queue_sender("nope") as sender:
            await sender.send_messages(ServiceBusMessage(b"x"))


async def test_receiver_on_an_unknown_entity_is_not_found(client: ServiceBusClient) -> None:
    with pytest.raises(MessagingEntityNotFoundError):
        async with client.get_queue_receiver("nope", max_wait_time=WAIT) as receiver:
            await receiver.receive_messages(max_wait_time=WAIT)
