"""Who may talk to RabbitMQ, and who said what: a refused login or vhost in one line and no
library noise, the validated sender of each message, a forged ``user_id`` refused, a refused
routing key that does not block the next message, dead letters that name the original sender."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from schemas import PublishNotConfirmed, TransportError
from schemas.channels import ChannelNames
from schemas.transport import DEAD_LETTER_REASON, ORIGINAL_SENDER
from schemas.transport.rabbitmq import AmqpSettings, RabbitMQTransport

from ._helpers import assert_nothing, outgoing, receive
from ._rabbitmqctl import BrokerUser, rabbitmqctl, throwaway_user

pytestmark = pytest.mark.rabbitmq

BOUND = 60
SETTINGS = AmqpSettings(connect_timeout=3, reconnect_timeout=5, confirm_timeout=5)


def _with_login(amqp_url: str, user: str, password: str, vhost: str | None = None) -> str:
    return BrokerUser(user, password).url(amqp_url, vhost)


async def _refused(url: str, caplog: pytest.LogCaptureFixture) -> str:
    """Connect as an agent does, three times; the error, once the logs were checked."""
    caplog.set_level(logging.INFO)  # every logger, the libraries' included
    caplog.clear()
    errors = []
    for _ in range(3):
        with pytest.raises(TransportError) as caught:
            async with RabbitMQTransport(url, ChannelNames(), settings=SETTINGS):
                pass
        errors.append(caught.value)
    await asyncio.sleep(1.5)  # past the reconnect interval: nothing keeps trying in the back
    noise = [f"{r.name} {r.levelname}: {r.getMessage()}" for r in caplog.records]
    assert noise == [], "the caller reports the error; nobody else may log it"
    text = str(errors[0])
    assert "\n" not in text
    assert "Connection.Close object" not in text
    assert "guest:" not in text
    assert {str(error) for error in errors} == {text}
    return text


async def test_a_wrong_password_is_one_clear_line(
    amqp_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with asyncio.timeout(BOUND):
        text = await _refused(_with_login(amqp_url, "guest", "not-the-password"), caplog)
    assert text == (
        "RabbitMQ at 127.0.0.1:5672 refused the login for user 'guest' on vhost '/' "
        "(wrong user name or password)"
    )


async def test_an_unknown_vhost_is_one_clear_line(
    amqp_url: str, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    vhost = f"no-such-vhost-{unique}"
    async with asyncio.timeout(BOUND):
        text = await _refused(_with_login(amqp_url, "guest", "guest", vhost), caplog)
    assert text == (
        f"RabbitMQ at 127.0.0.1:5672 refused vhost '{vhost}' to user 'guest': vhost '{vhost}' "
        "does not exist or user 'guest' may not use it"
    )


async def test_a_vhost_the_user_may_not_use_is_one_clear_line(
    amqp_url: str, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with asyncio.timeout(BOUND), throwaway_user(unique, permissions=None) as user:
        text = await _refused(user.url(amqp_url), caplog)
    assert text == (
        f"RabbitMQ at 127.0.0.1:5672 refused vhost '/' to user '{user.name}': vhost '/' does "
        f"not exist or user '{user.name}' may not use it"
    )


async def test_an_unreachable_broker_is_not_logged_twice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from .backends import closed_port

    caplog.set_level(logging.INFO)
    url = f"amqp://guest:guest@127.0.0.1:{closed_port()}/"
    async with asyncio.timeout(BOUND):
        with pytest.raises(TransportError, match="cannot connect to RabbitMQ"):
            async with RabbitMQTransport(url, ChannelNames(), settings=SETTINGS):
                pass
    assert [r.getMessage() for r in caplog.records] == []


# -- senders ---------------------------------------------------------------------------------


@pytest.fixture
async def central(amqp_url: str, unique: str) -> AsyncIterator[RabbitMQTransport]:
    """Consumers, as guest; deletes the test's entities afterwards."""
    channels = ChannelNames().suffixed(unique)
    async with RabbitMQTransport(amqp_url, channels, settings=SETTINGS) as transport:
        try:
            yield transport
        finally:
            await transport.delete_topology(groups=["audit"], exchanges=True)


async def test_a_message_arrives_with_its_publishers_user(
    amqp_url: str, alice: BrokerUser, central: RabbitMQTransport
) -> None:
    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(alice.url(amqp_url), central.channels, settings=SETTINGS) as agent,
    ):
        await central.declare_group("audit")
        await agent.publish(sent := outgoing("from alice"))
        await central.publish(outgoing("from guest"))
        async with central.subscribe("audit") as subscription:
            first, second = await receive(subscription), await receive(subscription)
            await first.ack()
            await second.ack()
    assert first.message_id == sent.message_id
    assert first.sender == alice.name
    assert second.sender == "guest"


async def test_a_publish_that_claims_another_user_is_refused(
    amqp_url: str, alice: BrokerUser, central: RabbitMQTransport
) -> None:
    forger = AmqpSettings(
        connect_timeout=3, reconnect_timeout=5, confirm_timeout=5, user_id="guest"
    )
    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(alice.url(amqp_url), central.channels, settings=forger) as agent,
    ):
        await central.declare_group("audit")
        with pytest.raises(PublishNotConfirmed, match="user_id") as caught:
            await agent.publish(outgoing("pretending to be guest"))
        assert alice.name in str(caught.value)
        async with central.subscribe("audit") as subscription:
            await assert_nothing(subscription, 0.5)


async def test_a_routing_key_the_user_may_not_use_does_not_block_the_next(
    amqp_url: str, alice: BrokerUser, central: RabbitMQTransport
) -> None:
    # A per-VM user may publish only keys that end in its own name (README, channels.py).
    events = central.channels.events_exchange
    await rabbitmqctl("set_topic_permissions", "-p", "/", alice.name, events, r"^.*\.vm-a$", ".*")
    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(alice.url(amqp_url), central.channels, settings=SETTINGS) as agent,
    ):
        await central.declare_group("audit")
        with pytest.raises(PublishNotConfirmed, match="ACCESS_REFUSED"):
            await agent.publish(outgoing("not mine", routing_key="started.Reboot.vm-b"))
        # The broker closed the publishing channel; it reopens for the next message.
        await agent.publish(mine := outgoing("mine", routing_key="started.Reboot.vm-a"))
        async with central.subscribe("audit") as subscription:
            delivery = await receive(subscription)
            await delivery.ack()
            await assert_nothing(subscription, 0.5)
    assert delivery.message_id == mine.message_id


async def test_dead_letters_name_the_original_sender(
    amqp_url: str, alice: BrokerUser, unique: str
) -> None:
    channels = ChannelNames().suffixed(unique)
    limited = AmqpSettings(
        connect_timeout=3, reconnect_timeout=5, confirm_timeout=5, delivery_limit=1
    )
    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(amqp_url, channels, settings=limited) as central,
        RabbitMQTransport(alice.url(amqp_url), channels, settings=SETTINGS) as agent,
    ):
        try:
            await central.declare_group("audit")
            await agent.publish(by_hand := outgoing("dead-lettered by the consumer"))
            await agent.publish(by_broker := outgoing("dead-lettered by the broker"))
            async with central.subscribe("audit", prefetch=1) as subscription:
                delivery = await receive(subscription)
                assert delivery.message_id == by_hand.message_id
                await delivery.dead_letter("schema", "not JSON")
                for _ in range(2):  # over the delivery limit: the broker dead-letters it
                    delivery = await receive(subscription)
                    assert delivery.message_id == by_broker.message_id
                    await delivery.retry()
                await assert_nothing(subscription, 0.5)
            async with central.dead_letters("audit") as dead:
                letters = {}
                for _ in range(2):
                    letter = await receive(dead)
                    letters[letter.message_id] = letter
                    await letter.ack()
        finally:
            await central.delete_topology(groups=["audit"], exchanges=True)
    copied, moved = letters[by_hand.message_id], letters[by_broker.message_id]
    assert copied.properties[ORIGINAL_SENDER] == alice.name
    assert copied.properties[DEAD_LETTER_REASON] == "schema"
    assert copied.sender is None  # the copy is the consumer's; it claims nobody
    assert moved.properties[ORIGINAL_SENDER] == alice.name
    assert moved.properties[DEAD_LETTER_REASON] == "delivery_limit"
    assert moved.sender == alice.name  # moved by the broker: the original, user_id and all


async def test_a_login_refused_on_reconnect_is_logged_once_not_at_every_attempt(
    amqp_url: str, alice: BrokerUser, central: RabbitMQTransport, caplog: pytest.LogCaptureFixture
) -> None:
    # The password is changed (rotated) while the agent runs, and its connection is closed.
    name = f"agent-{alice.name}"
    settings = AmqpSettings(
        connect_timeout=3,
        reconnect_timeout=5,
        confirm_timeout=5,
        reconnect_interval=0.2,
        name=name,
    )
    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(alice.url(amqp_url), central.channels, settings=settings) as agent,
    ):
        await rabbitmqctl("change_password", alice.name, "rotated")
        caplog.set_level(logging.INFO)
        caplog.clear()
        await _close_connection(name)
        await asyncio.sleep(3)  # some 15 reconnect attempts
        lines = caplog.text.splitlines()  # formatted when logged (aio-pika's records may not
        # format later: a OneShotCallback's repr fails once it has run)
        refusals = [line for line in lines if "refused the login" in line]
        assert len(refusals) == 1, lines
        assert f"refused the login for user '{alice.name}' on vhost '/'" in refusals[0]
        assert not [line for line in lines if "Connection attempt to" in line], lines
        assert len([line for line in lines if "lost the link" in line]) == 1, lines
        # Given its password back, it reconnects by itself, and says the refusal again if it
        # comes back.
        await rabbitmqctl("change_password", alice.name, alice.password)
        await central.declare_group("audit")
        await agent.publish(outgoing("after the password came back"))


async def _close_connection(name: str) -> None:
    listing = await rabbitmqctl("list_connections", "pid", "client_properties")
    pids = [line.split("\t")[0] for line in listing.splitlines() if name in line]
    assert pids, f"no connection named {name}"
    for pid in pids:
        await rabbitmqctl("close_connection", pid, "test: password rotated")
