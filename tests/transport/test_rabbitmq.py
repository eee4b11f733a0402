"""RabbitMQ-only behaviour: URL options, fixed queue arguments, broker-side dead-lettering,
message properties on the wire, and a link cut and restored by a TCP proxy."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aio_pika
import pytest

from schemas import ConfigError, PublishNotConfirmed, TransportError
from schemas.channels import ChannelNames
from schemas.transport import DEAD_LETTER_REASON, open_transport
from schemas.transport.rabbitmq import AmqpSettings, RabbitMQTransport

from ._helpers import assert_nothing, outgoing, receive, via_proxy
from .proxy import TcpProxy

BOUND = 60


def test_open_transport_picks_rabbitmq_for_amqp_urls() -> None:
    for url in ("amqp://guest:guest@127.0.0.1/", "amqps://relay:secret@rabbit.example:5671/prod"):
        transport = open_transport(url)
        assert isinstance(transport, RabbitMQTransport)
        assert transport.name == "rabbitmq"


def test_importing_the_transport_package_does_not_import_aio_pika() -> None:
    code = "import schemas.transport, sys; assert 'aio_pika' not in sys.modules, 'imported'"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


def test_url_options_configure_the_transport() -> None:
    transport = RabbitMQTransport(
        "amqp://relay:s3cret@rabbit.internal:5672/prod?reconnect_interval=1&confirm_timeout=2.5"
        "&reconnect_max_interval=30&approval_ttl=120&delivery_limit=5&heartbeat=15&name=agent-web-7&cafile=/etc/ca.pem"
    )
    settings = transport.settings
    assert settings.reconnect_interval == 1
    assert settings.reconnect_max_interval == 30
    assert settings.confirm_timeout == 2.5
    assert settings.approval_ttl == 120
    assert settings.delivery_limit == 5
    assert settings.heartbeat == 15
    assert settings.connection_name == "agent-web-7"
    assert "s3cret" not in transport.display_url
    assert transport.display_url.startswith("amqp://relay:***@rabbit.internal:5672/prod")


def test_code_settings_are_the_defaults_the_url_overrides() -> None:
    base = AmqpSettings(confirm_timeout=7, reconnect_timeout=3)
    transport = RabbitMQTransport("amqp://h/?confirm_timeout=1", settings=base)
    assert transport.settings.confirm_timeout == 1
    assert transport.settings.reconnect_timeout == 3
    assert "scheduled-events-relay" in transport.settings.connection_name


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("amqp://h/?reconect_interval=1", "unknown RabbitMQ URL option 'reconect_interval'"),
        ("amqp://h/?confirm_timeout=soon", "confirm_timeout='soon' is not a number"),
        ("amqp://h/?reconnect_interval=0", "reconnect_interval must be a positive"),
        ("amqp://h/?reconnect_timeout=nan", "reconnect_timeout must be a positive"),
        ("amqp://h/?reconnect_max_interval=inf", "reconnect_max_interval must be a positive"),
        ("amqp://h/?heartbeat=70000", "heartbeat must be 0..65535"),
        ("amqp://h/?delivery_limit=0", "delivery_limit must be at least 1"),
        ("amqp://h:port/", "bad port"),
        ("amqp:///vhost", "no host"),
    ],
)
def test_bad_url_options_are_config_errors(url: str, complaint: str) -> None:
    with pytest.raises(ConfigError, match=complaint.replace("(", r"\(").replace(".", r"\.")):
        RabbitMQTransport(url)


def test_a_bad_option_does_not_leak_the_password() -> None:
    with pytest.raises(ConfigError) as caught:
        RabbitMQTransport("amqp://u:hunter2@h/?bogus=1")
    assert "hunter2" not in str(caught.value)


# -- against the broker ---------------------------------------------------------------------


@pytest.fixture
async def rabbit(amqp_url: str, unique: str) -> AsyncIterator[RabbitMQTransport]:
    channels = ChannelNames().suffixed(unique)
    settings = AmqpSettings(connect_timeout=3, reconnect_timeout=5, confirm_timeout=5)
    async with RabbitMQTransport(amqp_url, channels, settings=settings) as transport:
        yield transport
        await transport.delete_topology(
            groups=["g", "ordered", "limited"], vms=["vm-1"], exchanges=True
        )


@pytest.mark.rabbitmq
async def test_asking_for_the_other_exclusive_setting_is_a_config_error(
    rabbit: RabbitMQTransport,
) -> None:
    async with asyncio.timeout(BOUND):
        async with rabbit.subscribe("ordered", exclusive=True):
            pass
        with pytest.raises(ConfigError, match="x-single-active-consumer") as caught:
            async with rabbit.subscribe("ordered", exclusive=False):
                pass
        assert "exclusive=" in str(caught.value)
        # The refusal cost one throwaway channel, nothing else: the transport still works.
        await rabbit.publish(outgoing())
        async with rabbit.subscribe("ordered", exclusive=True) as subscription:
            await (await receive(subscription)).ack()


@pytest.mark.rabbitmq
async def test_declare_group_accepts_an_exclusive_group_as_it_is(
    rabbit: RabbitMQTransport,
) -> None:
    async with asyncio.timeout(BOUND):
        async with rabbit.subscribe("ordered", exclusive=True):
            pass
        await rabbit.declare_group("ordered")
        await rabbit.declare_group("ordered")


@pytest.mark.rabbitmq
async def test_another_approval_ttl_is_a_config_error(
    rabbit: RabbitMQTransport, amqp_url: str
) -> None:
    async with asyncio.timeout(BOUND):
        async with rabbit.approvals("vm-1"):
            pass
        other = RabbitMQTransport(amqp_url, rabbit.channels, settings=AmqpSettings(approval_ttl=60))
        async with other:
            with pytest.raises(ConfigError, match="x-message-ttl"):
                async with other.approvals("vm-1"):
                    pass


@pytest.mark.rabbitmq
async def test_publishes_sharing_a_connection_are_sent_at_once_not_ten_a_turn(
    rabbit: RabbitMQTransport,
) -> None:
    """aiormq queues 10 frames a connection before a sender waits for room, and each slot freed
    costs a waiting sender a turn of the event loop: with a thousand agents on one connection
    and a busy loop, publishes waited seconds before they were even sent. Here 500 publishes
    made at once are all handed to the connection in the first turns, then all confirmed."""
    async with asyncio.timeout(BOUND):
        await rabbit.declare_group("g")
        await rabbit.publish(outgoing())
        _, channel = rabbit._require()
        underlay = await channel.get_underlay_channel()
        before = underlay.delivery_tag
        tasks = [asyncio.create_task(rabbit.publish(outgoing(str(n)))) for n in range(500)]
        for _ in range(3):
            await asyncio.sleep(0)
        handed = underlay.delivery_tag - before
        await asyncio.gather(*tasks)
    assert handed == 500, f"only {handed} of 500 publishes were sent in 3 turns of the loop"


@pytest.mark.rabbitmq
async def test_the_broker_dead_letters_after_the_delivery_limit(amqp_url: str, unique: str) -> None:
    channels = ChannelNames().suffixed(unique)
    settings = AmqpSettings(delivery_limit=1, reconnect_timeout=5, confirm_timeout=5)
    async with (
        asyncio.timeout(BOUND),
        RabbitMQTransport(amqp_url, channels, settings=settings) as t,
    ):
        try:
            await t.declare_group("limited")
            sent = outgoing("poison")
            await t.publish(sent)
            async with t.subscribe("limited") as subscription:
                for count in (0, 1):
                    delivery = await receive(subscription)
                    assert delivery.delivery_count == count
                    await delivery.retry()
                await assert_nothing(subscription, 0.5)
            async with t.dead_letters("limited") as dead:
                letter = await receive(dead)
                await letter.ack()
            assert letter.message_id == sent.message_id
            assert letter.properties[DEAD_LETTER_REASON] == "delivery_limit"
        finally:
            await t.delete_topology(groups=["limited"], exchanges=True)


@pytest.mark.rabbitmq
async def test_messages_are_persistent_timestamped_and_expire_when_asked(
    rabbit: RabbitMQTransport, amqp_url: str
) -> None:
    async with asyncio.timeout(BOUND):
        await rabbit.declare_group("g")
        await rabbit.publish(outgoing("event"))
        async with rabbit.approvals("vm-1"):
            pass
        await rabbit.send_approval(
            rabbit.reply_address("vm-1"), outgoing("approval", routing_key="vm-1", ttl_seconds=90)
        )
        # Read them raw, as any AMQP client would.
        connection = await aio_pika.connect(amqp_url)
        async with connection, connection.channel() as channel:
            queue = await channel.declare_queue(rabbit.group_queue("g"), passive=True)
            event = await _first(queue)
            queue = await channel.declare_queue(rabbit.vm_queue("vm-1"), passive=True)
            approval = await _first(queue)
    assert event.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert event.timestamp is not None
    assert event.expiration is None
    assert approval.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert approval.expiration == 90


async def _first(queue: aio_pika.abc.AbstractQueue) -> aio_pika.abc.AbstractIncomingMessage:
    async with queue.iterator(timeout=5) as messages:
        async for message in messages:
            await message.ack()
            return message
    raise AssertionError(f"{queue.name} is empty")


# -- a link cut and restored ----------------------------------------------------------------


@pytest.mark.rabbitmq
@pytest.mark.slow
async def test_publishing_and_consuming_survive_a_cut_link(
    amqp_url: str, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="schemas.transport.rabbitmq")
    split = urlsplit(amqp_url)
    channels = ChannelNames().suffixed(unique)
    settings = AmqpSettings(connect_timeout=2, reconnect_timeout=20, confirm_timeout=5)
    loop = asyncio.get_running_loop()
    async with (
        asyncio.timeout(BOUND),
        TcpProxy(split.hostname or "127.0.0.1", split.port or 5672) as proxy,
    ):
        url = via_proxy(amqp_url, proxy.port)
        publisher = RabbitMQTransport(url, channels, settings=settings)
        consumer = RabbitMQTransport(url, channels, settings=settings)
        async with publisher, consumer:
            try:
                await publisher.declare_group("g")
                sent: list[str] = []
                confirmed_at: list[float] = []
                received: set[str] = set()
                halfway = asyncio.Event()

                async def publish_all() -> None:
                    for n in range(60):
                        message = outgoing(f"message {n}")
                        await publisher.publish(message)
                        sent.append(message.message_id)
                        confirmed_at.append(loop.time())
                        if n == 15:
                            halfway.set()
                        await asyncio.sleep(0.02)

                async def consume_all(subscription: object) -> None:
                    while len(received) < 60 or received != set(sent):
                        delivery = await receive(subscription, within=30)
                        received.add(delivery.message_id)
                        await delivery.ack()

                async with (
                    consumer.subscribe("g", prefetch=8) as subscription,
                    asyncio.TaskGroup() as group,
                ):
                    publishing = group.create_task(publish_all())
                    group.create_task(consume_all(subscription))
                    await halfway.wait()
                    await proxy.cut()
                    cut_at = loop.time()
                    before = len(sent)
                    await asyncio.sleep(1.5)
                    during = len(sent) - before
                    await proxy.restore()
                    restored_at = loop.time()
                    await publishing
                resumed = next(t for t in confirmed_at if t > restored_at) - restored_at
            finally:
                await publisher.delete_topology(groups=["g"], exchanges=True)
    print(
        f"\nlink down {restored_at - cut_at:.2f} s; first publish confirmed {resumed:.3f} s "
        f"after the link came back (reconnect_interval {settings.reconnect_interval} s)"
    )
    assert during <= 1, "publish must wait for the link, not report success while it is down"
    assert received == set(sent)
    assert len(sent) == 60
    assert resumed < 3.0
    assert "lost the link to RabbitMQ" in caplog.text
    assert "restored after" in caplog.text
    assert proxy.accepted >= 4  # both connections, then both again


@pytest.mark.rabbitmq
async def test_publish_gives_up_when_the_link_stays_down(amqp_url: str, unique: str) -> None:
    split = urlsplit(amqp_url)
    channels = ChannelNames().suffixed(unique)
    settings = AmqpSettings(connect_timeout=2, reconnect_timeout=1, confirm_timeout=5)
    loop = asyncio.get_running_loop()
    async with (
        asyncio.timeout(BOUND),
        TcpProxy(split.hostname or "127.0.0.1", split.port or 5672) as proxy,
    ):
        transport = RabbitMQTransport(via_proxy(amqp_url, proxy.port), channels, settings=settings)
        async with transport:
            try:
                await transport.declare_group("g")
                await proxy.cut()
                started = loop.time()
                with pytest.raises(TransportError, match="unreachable") as caught:
                    await transport.publish(outgoing())
                waited = loop.time() - started
                assert 0.5 < waited < 3, waited
                assert "guest:guest" not in str(caught.value)
                await proxy.restore()
                await transport.publish(outgoing())  # the same transport carries on
            finally:
                await transport.delete_topology(groups=["g"], exchanges=True)


@pytest.mark.rabbitmq
async def test_a_publish_without_a_confirm_in_time_is_not_confirmed(
    amqp_url: str, unique: str
) -> None:
    split = urlsplit(amqp_url)
    channels = ChannelNames().suffixed(unique)
    settings = AmqpSettings(connect_timeout=2, reconnect_timeout=5, confirm_timeout=0.5)
    async with (
        asyncio.timeout(BOUND),
        TcpProxy(split.hostname or "127.0.0.1", split.port or 5672) as proxy,
    ):
        transport = RabbitMQTransport(via_proxy(amqp_url, proxy.port), channels, settings=settings)
        async with transport:
            try:
                await transport.declare_group("g")
                proxy.pause()
                with pytest.raises(PublishNotConfirmed, match="no confirm"):
                    await transport.publish(outgoing())
                proxy.resume()
                await transport.publish(outgoing())
            finally:
                proxy.resume()
                await transport.delete_topology(groups=["g"], exchanges=True)


@pytest.mark.rabbitmq
async def test_a_nack_is_not_confirmed(rabbit: RabbitMQTransport, amqp_url: str) -> None:
    full = f"{rabbit.channels.group_prefix}full"
    async with asyncio.timeout(BOUND):
        connection = await aio_pika.connect(amqp_url)
        async with connection, connection.channel() as channel:
            # A queue that takes nothing and says so: the broker nacks what is routed to it.
            queue = await channel.declare_queue(
                full, arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
            )
            await queue.bind(rabbit.channels.events_exchange, "#")
            try:
                with pytest.raises(PublishNotConfirmed, match="nack"):
                    await rabbit.publish(outgoing())
            finally:
                await queue.delete(if_unused=False, if_empty=False)


@pytest.mark.rabbitmq
async def test_cancelling_a_subscription_while_it_opens_is_a_cancel_not_a_link_error(
    rabbit: RabbitMQTransport, caplog: pytest.LogCaptureFixture
) -> None:
    """A stop (SIGTERM) cancels whatever is opening a consumer or declaring: the caller must
    see the cancel, never a TransportError it would take for a lost link and retry (the agent
    did, and never stopped), and the connection must survive it (a cancel cut into aiormq's
    channel opening made RabbitMQ close the whole connection). Cancelled at many points."""
    opened = 0

    async def hold() -> None:
        nonlocal opened
        async with rabbit.approvals("vm-1"):
            opened += 1
            await asyncio.Event().wait()

    async with asyncio.timeout(BOUND):
        for step in range(40):
            task = asyncio.create_task(hold())
            await asyncio.sleep(step * 0.0005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert 0 < opened < 40, "the cancels should land at every stage, opened or not"
        for step in range(20):
            task = asyncio.create_task(rabbit.declare_group("g"))
            await asyncio.sleep(step * 0.0005)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await rabbit.publish(outgoing())
    lost = [r.getMessage() for r in caplog.records if "lost the link" in r.getMessage()]
    assert not lost


@pytest.mark.rabbitmq
async def test_a_stalled_broker_costs_the_operation_not_the_connection(
    amqp_url: str, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A broker too busy to answer within ``confirm_timeout`` (a fleet's start-up burst) fails
    the declaration or consumer opening that waited, as a TransportError the caller retries;
    it must not close the *connection* that every other channel of the process shares. Giving
    up by cancelling aiormq's channel opening or closing made RabbitMQ close the connection
    (``CHANNEL_ERROR - expected 'channel.open'``): 2,000 agents over four shared connections
    lost them all within seconds of starting. Stalled at many points of the exchange."""
    caplog.set_level(logging.INFO, logger="schemas.transport.rabbitmq")
    split = urlsplit(amqp_url)
    channels = ChannelNames().suffixed(unique)
    settings = AmqpSettings(connect_timeout=2, reconnect_timeout=2, confirm_timeout=0.3)
    async with (
        asyncio.timeout(BOUND),
        TcpProxy(split.hostname or "127.0.0.1", split.port or 5672) as proxy,
    ):
        transport = RabbitMQTransport(via_proxy(amqp_url, proxy.port), channels, settings=settings)
        async with transport:
            try:
                await transport.declare_group("g")
                failed = 0
                for step in range(24):
                    operation = asyncio.create_task(
                        transport.declare_group("g")
                        if step % 2
                        else _open_and_close(transport.approvals("vm-1"))
                    )
                    await asyncio.sleep(step * 0.0007)
                    proxy.pause()
                    try:
                        await operation
                    except TransportError:
                        failed += 1
                    finally:
                        await asyncio.sleep(0.4)
                        proxy.resume()
                    await asyncio.sleep(0.2)
                assert failed, "the stalls should have outlasted some operations"
                await transport.publish(outgoing())
            finally:
                proxy.resume()
                await transport.delete_topology(groups=["g"], vms=["vm-1"], exchanges=True)
    lost = [r.getMessage() for r in caplog.records if "lost the link" in r.getMessage()]
    assert not lost


async def _open_and_close(subscription: object) -> None:
    async with subscription:  # type: ignore[attr-defined]
        pass


@pytest.mark.rabbitmq
async def test_a_subscription_opened_while_the_link_is_down_fails_as_a_lost_link(
    amqp_url: str, unique: str
) -> None:
    """aiormq raises a bare ``RuntimeError("<Connection ...> closed")`` when a channel is opened
    on a connection that has closed and not reconnected yet. In a 10,000-VM fleet run that
    escaped the agents' approvals listener (the link dropped between declaring an agent's
    approvals queue and consuming it) and ended every agent on that connection: callers retry a
    TransportError, none expects a RuntimeError."""
    split = urlsplit(amqp_url)
    channels = ChannelNames().suffixed(unique)
    settings = AmqpSettings(connect_timeout=2, reconnect_timeout=5, confirm_timeout=2)
    async with (
        asyncio.timeout(BOUND),
        TcpProxy(split.hostname or "127.0.0.1", split.port or 5672) as proxy,
    ):
        transport = RabbitMQTransport(via_proxy(amqp_url, proxy.port), channels, settings=settings)
        async with transport:
            try:
                await proxy.cut()
                await asyncio.sleep(0.2)  # the reset has reached the connection
                # A transient subscription declares nothing first: it opens its channel at
                # once, on the connection that has just closed.
                with pytest.raises(TransportError, match="link closed before a channel opened"):
                    async with transport.subscribe("g", transient=True):
                        pass
                # The caller's retry, once the link is back (the robust connection reconnects
                # after its interval), consumes as usual.
                await proxy.restore()
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 20
                message = outgoing("after the link came back")
                while True:
                    try:
                        async with transport.subscribe("g", transient=True) as subscription:
                            await transport.publish(message)
                            delivery = await receive(subscription, within=10)
                            await delivery.ack()
                        break
                    except TransportError:
                        if loop.time() > deadline:
                            raise
                        await asyncio.sleep(0.5)
                assert delivery.message_id == message.message_id
            finally:
                await transport.delete_topology(exchanges=True)
