"""RabbitMQ's catch-all: what is published while no group is bound waits in ``unrouted`` and
joins the stream unchanged once one is; an events exchange an older version declared without
the alternate exchange keeps working and says how to fix it (and the fix it gives works)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shlex
from collections.abc import AsyncIterator

import aio_pika
import pytest

from schemas import ConfigError, PublishNotConfirmed
from schemas.channels import ChannelNames
from schemas.transport import DEAD_LETTER_REASON
from schemas.transport.rabbitmq import AmqpSettings, RabbitMQTransport

from ._helpers import assert_nothing, outgoing, receive
from ._rabbitmqctl import rabbitmqctl, require_rabbitmqctl

pytestmark = pytest.mark.rabbitmq

BOUND = 60
SETTINGS = AmqpSettings(connect_timeout=3, reconnect_timeout=5, confirm_timeout=5)


@pytest.fixture
def channels(unique: str) -> ChannelNames:
    return ChannelNames().suffixed(unique)


@pytest.fixture
async def cleanup(amqp_url: str, channels: ChannelNames) -> AsyncIterator[None]:
    yield
    async with RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as transport:
        await transport.delete_topology(groups=["audit", "fleet"], exchanges=True)


async def _depth(amqp_url: str, queue: str) -> int:
    connection = await aio_pika.connect(amqp_url)
    async with connection, connection.channel() as channel:
        declared = await channel.declare_queue(queue, passive=True)
        return declared.declaration_result.message_count or 0


@pytest.mark.usefixtures("cleanup")
async def test_a_backlog_is_handed_on_whole_and_once(amqp_url: str, channels: ChannelNames) -> None:
    count = 600  # more than one drain batch (prefetch 256)
    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as agent,
    ):
        sent = [outgoing(f"kept {n}") for n in range(count)]
        await asyncio.gather(*(agent.publish(message) for message in sent))
        assert await _depth(amqp_url, channels.unrouted) == count
        async with RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as central:
            await central.declare_group("audit")
            await central.declare_group("audit")  # again: nothing more to hand on
            async with central.subscribe("audit", prefetch=100) as subscription:
                got = []
                for _ in range(count):
                    delivery = await receive(subscription, within=10)
                    got.append(delivery.message_id)
                    await delivery.ack()
                await assert_nothing(subscription, 0.5)
        assert await _depth(amqp_url, channels.unrouted) == 0
    assert sorted(got) == sorted(m.message_id for m in sent)


@contextlib.asynccontextmanager
async def _rejections_held_back() -> AsyncIterator[None]:
    """RabbitMQ behind on a quorum queue: each channel holds its acks and rejections for the
    queue back while ``quorum_commands_soft_limit`` of its commands wait to be applied (32 by
    default, reached on a loaded broker), and sends them once the queue catches up. Here the
    limit is 1, so it happens on every run and not only on a loaded machine; broker-wide, so
    only for as long as the body runs."""
    await require_rabbitmqctl()
    key = "application:get_env(rabbit, quorum_commands_soft_limit)"
    match = re.fullmatch(r"\{ok,(\d+)\}", (await rabbitmqctl("eval", f"{key}.")).strip())
    assert match, "the broker has no quorum_commands_soft_limit"
    await rabbitmqctl("eval", "application:set_env(rabbit, quorum_commands_soft_limit, 1).")
    try:
        yield
    finally:
        await rabbitmqctl(
            "eval", f"application:set_env(rabbit, quorum_commands_soft_limit, {match[1]})."
        )


async def _arrived(amqp_url: str, queue: str, count: int) -> int:
    """How many messages ``queue`` holds once it holds ``count``, or after 10 s."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(10):  # the broker dead-letters them into it meanwhile
            while await _depth(amqp_url, queue) < count:  # noqa: ASYNC110 - the broker's
                await asyncio.sleep(0.1)
    return await _depth(amqp_url, queue)


@pytest.mark.broker_wide  # the soft limit is the node's: no other test may meet it meanwhile
@pytest.mark.usefixtures("cleanup")
async def test_a_backlog_is_handed_on_by_one_declaration_while_rabbitmq_holds_rejections_back(
    amqp_url: str, channels: ChannelNames
) -> None:
    # The drain rejected what it received and closed its channel at once: the rejections
    # RabbitMQ still held back were dropped with the channel, and those messages went back into
    # the catch-all queue, to wait there for the next declaration of a group. Whether any was
    # still held back at the end depends on timing (most rounds here), so three rounds.
    count = 600
    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as agent,
        RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as central,
    ):
        for round_ in range(3):
            group = f"round-{round_}"  # no group bound yet: the messages wait in the catch-all
            await asyncio.gather(*(agent.publish(outgoing(f"kept {n}")) for n in range(count)))
            try:
                async with _rejections_held_back():
                    await central.declare_group(group)  # once, and nothing else declares it
                arrived = await _arrived(amqp_url, central.group_queue(group), count)
                waiting = await _depth(amqp_url, channels.unrouted)
            finally:
                await central.delete_topology(groups=[group])
            assert (arrived, waiting) == (count, 0), (
                f"round {round_}: {arrived} of {count} reached the group; {waiting} wait in "
                "the catch-all"
            )


@pytest.mark.usefixtures("cleanup")
async def test_a_handed_on_message_dead_letters_for_its_own_reason(
    amqp_url: str, channels: ChannelNames
) -> None:
    # It went through the broker's dead-lettering once (out of the catch-all): the group's
    # deliveries do not say so, and its own dead letter names the group's reason.
    limited = AmqpSettings(
        connect_timeout=3, reconnect_timeout=5, confirm_timeout=5, delivery_limit=1
    )
    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(amqp_url, channels, settings=limited) as transport,
    ):
        await transport.publish(sent := outgoing("poison", properties={"vm": "vm-1"}))
        await transport.declare_group("audit")
        async with transport.subscribe("audit") as subscription:
            for _ in range(2):
                delivery = await receive(subscription, within=10)
                assert dict(delivery.properties) == {"vm": "vm-1"}
                await delivery.retry()
        async with transport.dead_letters("audit") as dead:
            letter = await receive(dead)
            await letter.ack()
    assert letter.message_id == sent.message_id
    assert letter.properties[DEAD_LETTER_REASON] == "delivery_limit"


@pytest.mark.usefixtures("cleanup")
async def test_a_transient_reader_does_not_drain_the_catch_all(
    amqp_url: str, channels: ChannelNames
) -> None:
    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as transport,
    ):
        await transport.publish(outgoing("kept"))
        async with transport.subscribe("tail", transient=True) as tail:
            await assert_nothing(tail, 0.5)
        assert await _depth(amqp_url, channels.unrouted) == 1


async def _old_events_exchange(amqp_url: str, channels: ChannelNames) -> None:
    """The events exchange as versions before the catch-all declared it: no arguments."""
    connection = await aio_pika.connect(amqp_url)
    async with connection, connection.channel() as channel:
        await channel.declare_exchange(
            channels.events_exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )


@pytest.mark.usefixtures("cleanup")
async def test_an_old_events_exchange_keeps_working_and_says_how_to_fix_it(
    amqp_url: str, channels: ChannelNames, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="schemas.transport.rabbitmq")
    await _old_events_exchange(amqp_url, channels)
    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as transport,
    ):
        problem = transport.catch_all_problem
        assert isinstance(problem, ConfigError)
        assert "rabbitmqctl set_policy" in str(problem)
        assert str(problem) in caplog.text
        # Without a group, a message is refused (and says why and how to fix it)...
        with pytest.raises(PublishNotConfirmed, match="unroutable") as caught:
            await transport.publish(outgoing())
        assert "alternate-exchange" in str(caught.value)
        # ...but everything else works: groups, publishing, consuming.
        await transport.declare_group("audit")
        await transport.publish(sent := outgoing())
        async with transport.subscribe("audit") as subscription:
            delivery = await receive(subscription)
            await delivery.ack()
        assert delivery.message_id == sent.message_id


@pytest.mark.usefixtures("cleanup")
async def test_the_policy_the_error_gives_fixes_an_old_events_exchange(
    amqp_url: str, channels: ChannelNames
) -> None:
    await require_rabbitmqctl()
    await _old_events_exchange(amqp_url, channels)
    policy = f"{channels.events_exchange}-catch-all"
    try:
        async with (
            asyncio.timeout(BOUND),
            RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as agent,
        ):
            problem = agent.catch_all_problem
            assert problem is not None
            match = re.search(r"rabbitmqctl (set_policy .*?) ; ", str(problem))
            assert match, str(problem)
            await rabbitmqctl(*shlex.split(match.group(1)))
            await agent.publish(kept := outgoing("kept thanks to the policy"))
            central = RabbitMQTransport(amqp_url, channels, settings=SETTINGS)
            async with central, central.subscribe("audit") as subscription:
                delivery = await receive(subscription, within=10)
                await delivery.ack()
        assert delivery.message_id == kept.message_id
        assert delivery.sender == "guest"
    finally:
        await rabbitmqctl("clear_policy", "-p", "/", policy)


@pytest.mark.usefixtures("cleanup")
async def test_a_group_whose_binding_went_with_the_exchange_is_bound_again(
    amqp_url: str, channels: ChannelNames
) -> None:
    # The fix for an old events exchange may be to delete it: the groups' queues stay, unbound.
    async with asyncio.timeout(BOUND):
        async with RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as central:
            await central.declare_group("audit")
        connection = await aio_pika.connect(amqp_url)
        async with connection, connection.channel() as channel:
            await channel.exchange_delete(channels.events_exchange)
        async with RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as agent:
            await agent.publish(kept := outgoing("while the group was unbound"))
            async with RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as central:
                await central.declare_group("audit")  # exists: taken as it is, bound again
                await agent.publish(outgoing("after"))
                queue = central.group_queue("audit")
                async with asyncio.timeout(10):  # both there, without a subscribe's help
                    while await _depth(amqp_url, queue) < 2:  # noqa: ASYNC110 - the broker's
                        await asyncio.sleep(0.1)
                async with central.subscribe("audit") as subscription:
                    got = {(await receive(subscription)).message_id for _ in range(2)}
    assert kept.message_id in got
