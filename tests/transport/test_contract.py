"""The transport contract: the same behaviour from every broker (see ``backends.py``).

Each test gets its own broker names (``ChannelNames().suffixed(unique)``), deleted afterwards.
"""

from __future__ import annotations

import asyncio

import pytest

from schemas import MessageRefused, PublishNotConfirmed, TransportError
from schemas.transport import (
    DEAD_LETTER_DESCRIPTION,
    DEAD_LETTER_REASON,
    ORIGINAL_SENDER,
    Transport,
)

from ._helpers import assert_nothing, outgoing, receive
from .backends import Backend
from .proxy import TcpProxy

BOUND = 30  # seconds: no test may take longer


async def test_is_a_transport(backend: Backend) -> None:
    assert isinstance(backend.make(), Transport)


async def test_published_messages_wait_in_a_declared_group(backend: Backend) -> None:
    group = backend.group("audit")
    async with asyncio.timeout(BOUND), backend.transport() as transport:
        await transport.declare_group(group)
        sent = [outgoing(f"message {n}") for n in range(3)]
        for message in sent:
            await transport.publish(message)
        async with transport.subscribe(group) as subscription:
            got = [await receive(subscription) for _ in sent]
            for delivery in got:
                await delivery.ack()
    assert [d.message_id for d in got] == [m.message_id for m in sent]
    assert [d.body for d in got] == [m.body for m in sent]
    assert [d.delivery_count for d in got] == [0, 0, 0]


async def test_every_group_gets_every_message(backend: Backend) -> None:
    first, second = backend.group("fleet"), backend.group("audit")
    async with asyncio.timeout(BOUND), backend.transport() as transport:
        await transport.declare_group(first)
        await transport.declare_group(second)
        sent = [outgoing(f"message {n}") for n in range(3)]
        for message in sent:
            await transport.publish(message)
        for group in (first, second):
            async with transport.subscribe(group) as subscription:
                ids = []
                for _ in sent:
                    delivery = await receive(subscription)
                    ids.append(delivery.message_id)
                    await delivery.ack()
                await assert_nothing(subscription, 0.3)
            assert ids == [m.message_id for m in sent], group


async def test_consumers_of_one_group_share_the_messages(backend: Backend) -> None:
    group = backend.group("approver")
    async with asyncio.timeout(BOUND), backend.transport() as one, backend.transport() as two:
        await one.declare_group(group)
        async with (
            one.subscribe(group, prefetch=1) as first,
            two.subscribe(group, prefetch=1) as second,
        ):
            sent = [outgoing("a"), outgoing("b")]
            for message in sent:
                await one.publish(message)
            # Each holds its message unsettled: the other one must get the other message.
            a = await receive(first)
            b = await receive(second)
            assert {a.message_id, b.message_id} == {m.message_id for m in sent}
            await a.ack()
            await b.ack()
            await assert_nothing(first, 0.3)
            await assert_nothing(second, 0.1)


async def test_an_acked_message_is_gone(backend: Backend) -> None:
    group = backend.group("audit")
    async with asyncio.timeout(BOUND), backend.transport() as transport:
        await transport.declare_group(group)
        await transport.publish(outgoing())
        async with transport.subscribe(group) as subscription:
            await (await receive(subscription)).ack()
        async with transport.subscribe(group) as again:
            await assert_nothing(again, 0.5)


async def test_retry_delivers_again_with_a_higher_count(backend: Backend) -> None:
    group = backend.group("audit")
    async with asyncio.timeout(BOUND), backend.transport() as transport:
        await transport.declare_group(group)
        sent = outgoing()
        await transport.publish(sent)
        async with transport.subscribe(group) as subscription:
            first = await receive(subscription)
            assert first.delivery_count == 0
            await first.retry()
            second = await receive(subscription)
            assert second.message_id == sent.message_id
            assert second.body == sent.body
            assert second.delivery_count == 1
            await second.ack()


async def test_settling_twice_is_an_error(backend: Backend) -> None:
    group = backend.group("audit")
    async with asyncio.timeout(BOUND), backend.transport() as transport:
        await transport.declare_group(group)
        await transport.publish(outgoing())
        async with transport.subscribe(group) as subscription:
            delivery = await receive(subscription)
            await delivery.ack()
            with pytest.raises(TransportError):
                await delivery.ack()
            with pytest.raises(TransportError):
                await delivery.retry()


async def test_an_unsettled_message_comes_back_when_its_consumer_closes(backend: Backend) -> None:
    group = backend.group("audit")
    async with asyncio.timeout(BOUND), backend.transport() as one, backend.transport() as two:
        await one.declare_group(group)
        sent = outgoing()
        await one.publish(sent)
        async with one.subscribe(group) as crashed:
            taken = await receive(crashed)
            assert taken.message_id == sent.message_id
        async with two.subscribe(group) as survivor:
            again = await receive(survivor)
            assert again.message_id == sent.message_id
            assert again.delivery_count == 1
            await again.ack()


async def test_a_dead_letter_keeps_its_message_and_says_why(backend: Backend) -> None:
    group = backend.group("policy")
    async with asyncio.timeout(BOUND), backend.transport() as transport:
        await transport.declare_group(group)
        sent = outgoing("not json", properties={"vm": "vm-9", "sequence": 4})
        await transport.publish(sent)
        async with transport.subscribe(group) as subscription:
            delivery = await receive(subscription)
            await delivery.dead_letter("schema", "body is not JSON")
            await assert_nothing(subscription, 0.3)
        async with transport.dead_letters(group) as dead:
            letter = await receive(dead)
            await letter.ack()
    assert letter.message_id == sent.message_id
    assert letter.body == sent.body
    assert letter.content_type == sent.content_type
    assert letter.routing_key == sent.routing_key
    assert letter.properties[DEAD_LETTER_REASON] == "schema"
    assert letter.properties[DEAD_LETTER_DESCRIPTION] == "body is not JSON"
    assert letter.properties["vm"] == "vm-9"
    assert letter.properties["sequence"] == 4


async def test_approvals_reach_only_their_vm(backend: Backend) -> None:
    vm_a, vm_b = backend.vm("vm-a"), backend.vm("vm-b")
    async with (
        asyncio.timeout(BOUND),
        backend.transport() as agent,
        backend.transport() as sender,
        agent.approvals(vm_a) as inbox_a,
        agent.approvals(vm_b) as inbox_b,
    ):
        approval = outgoing("approve", routing_key=vm_a, ttl_seconds=60)
        await sender.send_approval(agent.reply_address(vm_a), approval)
        got = await receive(inbox_a)
        await got.ack()
        await assert_nothing(inbox_b, 0.3)
    assert got.message_id == approval.message_id
    assert got.body == approval.body


async def test_vm_names_are_not_case_sensitive(backend: Backend) -> None:
    # Azure VM names are case-insensitive; IMDS and ARM may spell one differently.
    vm = backend.vm("web-7")
    async with (
        asyncio.timeout(BOUND),
        backend.transport() as transport,
        transport.approvals(vm) as inbox,
    ):
        approval = outgoing("approve", routing_key="WEB-7")
        await transport.send_approval(transport.reply_address("WEB-7"), approval)
        got = await receive(inbox)
        await got.ack()
    assert got.message_id == approval.message_id


async def test_an_approval_for_a_vm_without_a_queue(backend: Backend) -> None:
    vm = backend.vm("never-started")
    async with asyncio.timeout(BOUND), backend.transport() as transport:
        approval = outgoing("approve", routing_key=vm, ttl_seconds=60)
        address = transport.reply_address(vm)
        if backend.unroutable_approval_raises:
            # RabbitMQ: the sender must not create VM queues; mandatory + unroutable says so.
            with pytest.raises(PublishNotConfirmed, match="unroutable"):
                await transport.send_approval(address, approval)
        else:
            await transport.send_approval(address, approval)
            async with transport.approvals(vm) as inbox:
                got = await receive(inbox)
                await got.ack()
            assert got.message_id == approval.message_id


async def test_an_expired_approval_is_not_delivered(backend: Backend) -> None:
    vm = backend.vm("vm-slow")
    async with asyncio.timeout(BOUND), backend.transport() as transport:
        async with transport.approvals(vm) as inbox:
            await inbox.close()  # the queue exists; the agent is away
        await transport.send_approval(
            transport.reply_address(vm), outgoing("stale", routing_key=vm, ttl_seconds=1.0)
        )
        fresh = outgoing("fresh", routing_key=vm, ttl_seconds=60)
        await asyncio.sleep(1.5)  # Service Bus expires messages in whole seconds
        await transport.send_approval(transport.reply_address(vm), fresh)
        async with transport.approvals(vm) as inbox:
            got = await receive(inbox)
            await got.ack()
    assert got.message_id == fresh.message_id


async def test_an_exclusive_consumer_waits_for_the_active_one(backend: Backend) -> None:
    group = backend.group("ordered")
    async with asyncio.timeout(BOUND), backend.transport() as one, backend.transport() as two:
        active = one.subscribe(group, exclusive=True)
        async with active:
            first = outgoing("first")
            await one.publish(first)
            got = await receive(active)
            assert got.message_id == first.message_id
            await got.ack()
            async with two.subscribe(group, exclusive=True) as standby:
                second = outgoing("second")
                await one.publish(second)
                waiting = asyncio.ensure_future(anext(standby))
                await asyncio.sleep(0.5)
                assert not waiting.done(), "the standby consumer got a message while one is active"
                await active.close()
                async with asyncio.timeout(10):
                    taken = await waiting
                assert taken.message_id == second.message_id
                await taken.ack()


async def test_message_attributes_round_trip(backend: Backend) -> None:
    group = backend.group("audit")
    properties: dict[str, str | int | float | bool] = {
        "cloudEvents:type": "io.github.scheduledeventsrelay.started",
        "cloudEvents:sequence": 42,
        "ratio": 0.25,
        "replay": True,
        "vm": "web-7",
    }
    async with asyncio.timeout(BOUND), backend.transport() as transport:
        await transport.declare_group(group)
        sent = outgoing('{"ok": true}', routing_key="started.Reboot.web-7", properties=properties)
        await transport.publish(sent)
        async with transport.subscribe(group) as subscription:
            got = await receive(subscription)
            await got.ack()
    assert got.body == sent.body
    assert got.message_id == sent.message_id
    assert got.content_type == "application/json"
    assert got.routing_key == "started.Reboot.web-7"
    assert dict(got.properties) == properties
    assert type(got.properties["replay"]) is bool
    assert type(got.properties["cloudEvents:sequence"]) is int


async def test_using_a_transport_before_connecting_is_a_transport_error(backend: Backend) -> None:
    transport = backend.make()
    with pytest.raises(TransportError):
        await transport.publish(outgoing())


async def test_an_unreachable_broker_is_a_transport_error(backend: Backend) -> None:
    if backend.unreachable is None:
        pytest.skip(f"a {backend.name} broker cannot be unreachable")
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with asyncio.timeout(BOUND):
        with pytest.raises(TransportError) as caught:
            async with backend.unreachable():
                pass
    assert loop.time() - started < 10
    assert isinstance(caught.value.__cause__, BaseException)
    assert "guest:guest" not in str(caught.value)


# -- nothing lost while nobody listens, nothing blocked by one refusal --------------------------


@pytest.mark.parametrize("declared_by", ["declare_group", "subscribe"])
async def test_a_message_published_before_any_group_reaches_the_first_group(
    backend: Backend, declared_by: str
) -> None:
    if backend.drops_without_groups:
        pytest.skip(backend.drops_without_groups)
    group, later_group = backend.group("audit"), backend.group("fleet")
    properties: dict[str, str | int | float | bool] = {"vm": "web-7", "cloudEvents:sequence": 3}
    async with asyncio.timeout(BOUND), backend.transport() as agent, backend.transport() as central:
        early = outgoing(
            "before any group", routing_key="started.Reboot.web-7", properties=properties
        )
        await agent.publish(early)
        if declared_by == "declare_group":
            await central.declare_group(group)
        late = outgoing("after the group")
        async with central.subscribe(group) as subscription:
            await agent.publish(late)
            got = {}
            for _ in range(2):
                delivery = await receive(subscription, within=10)
                got[delivery.message_id] = delivery
                await delivery.ack()
            await assert_nothing(subscription, 0.5)  # once
        await central.declare_group(later_group)  # it went to the first group, not to each
        async with central.subscribe(later_group) as subscription:
            await assert_nothing(subscription, 0.5)
    assert set(got) == {early.message_id, late.message_id}
    kept = got[early.message_id]
    assert kept.body == early.body
    assert kept.routing_key == early.routing_key
    assert kept.content_type == early.content_type
    assert dict(kept.properties) == properties
    assert kept.delivery_count == 0
    assert kept.sender == backend.sender


async def test_a_refused_message_does_not_block_the_next_ones(backend: Backend) -> None:
    if backend.refused_message is None:
        pytest.skip(f"no way to make a {backend.name} broker refuse one message")
    group = backend.group("audit")
    async with asyncio.timeout(BOUND), backend.transport() as transport:
        await transport.declare_group(group)
        refused = await backend.refused_message(transport)
        with pytest.raises(PublishNotConfirmed) as caught:
            await transport.publish(refused)
        # Refused for good: the sender sets it aside instead of trying it again.
        assert isinstance(caught.value, MessageRefused) == backend.refuses_for_good
        sent = [outgoing(f"next {n}") for n in range(2)]
        for message in sent:
            await transport.publish(message)
        async with transport.subscribe(group) as subscription:
            ids: list[str] = []
            while not set(ids) >= {m.message_id for m in sent}:
                delivery = await receive(subscription)
                ids.append(delivery.message_id)
                await delivery.ack()
    # (RabbitMQ nacks when one queue refused it; the others may have kept their copy.)
    assert [i for i in ids if i != refused.message_id] == [m.message_id for m in sent]


async def test_a_message_arrives_with_its_sender(backend: Backend) -> None:
    group = backend.group("audit")
    async with asyncio.timeout(BOUND), backend.transport() as transport:
        await transport.declare_group(group)
        await transport.publish(outgoing())
        async with transport.subscribe(group) as subscription:
            delivery = await receive(subscription)
            await delivery.ack()
    assert delivery.sender == backend.sender


async def test_a_dead_letter_names_the_original_sender(backend: Backend) -> None:
    """The sender the broker vouches for, or none: never a property of that name (or a reason)
    the publisher wrote, which would point an operator at another VM."""
    group = backend.group("policy")
    forged: dict[str, str | int | float | bool] = {
        "vm": "vm-1",
        ORIGINAL_SENDER: "web-7",
        DEAD_LETTER_REASON: "forged",
    }
    async with asyncio.timeout(BOUND), backend.transport() as transport:
        await transport.declare_group(group)
        await transport.publish(outgoing("poison", properties=forged))
        async with transport.subscribe(group) as subscription:
            await (await receive(subscription)).dead_letter("schema", "not JSON")
        async with transport.dead_letters(group) as dead:
            letter = await receive(dead)
            await letter.ack()
    assert letter.properties[DEAD_LETTER_REASON] == "schema"
    if backend.sender is None:
        assert ORIGINAL_SENDER not in letter.properties
    else:
        assert letter.properties[ORIGINAL_SENDER] == backend.sender


# -- a cut link ----------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_consumer_keeps_receiving_after_a_five_second_cut(backend: Backend) -> None:
    if backend.address is None or backend.via is None:
        pytest.skip(f"a {backend.name} broker has no link to cut")
    group = backend.group("audit")
    acked: list[str] = []
    async with (
        asyncio.timeout(BOUND + 30),
        TcpProxy(*backend.address) as proxy,
        backend.transport() as publisher,
        backend.via(proxy.port) as consumer,
    ):
        await publisher.declare_group(group)
        async with consumer.subscribe(group, prefetch=4) as subscription:
            before = outgoing("acked before the cut")
            await publisher.publish(before)
            delivery = await receive(subscription)
            await delivery.ack()
            acked.append(delivery.message_id)
            held = outgoing("held across the cut")
            await publisher.publish(held)
            in_hand = await receive(subscription)
            assert in_hand.message_id == held.message_id
            await proxy.cut()
            during = outgoing("published during the cut")
            await publisher.publish(during)
            await asyncio.sleep(5)
            await proxy.restore()
            try:
                await in_hand.ack()
            except TransportError:
                pass  # its channel or lock went with the link: the broker delivers it again
            else:
                acked.append(in_hand.message_id)
            after = outgoing("published after the cut")
            await publisher.publish(after)
            expected = {held.message_id, during.message_id, after.message_id}
            while not expected <= set(acked):
                delivery = await receive(subscription, within=30)
                assert delivery.message_id != before.message_id, "an acked message came back"
                try:
                    await delivery.ack()
                except TransportError:
                    continue  # lost again before it was settled: it comes back
                acked.append(delivery.message_id)
            await assert_nothing(subscription, 1.0)
    duplicates = {i for i in acked if acked.count(i) > 1}
    assert not duplicates, f"acked twice: {duplicates}"
