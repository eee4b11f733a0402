"""What the Service Bus transport holds on the namespace, counted by the double: a sender only
around its sends, a session receiver only while the approvals subscription is open."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ssl
import weakref
from typing import Any

import pytest

from schemas import ChannelNames, ConfigError, PublishNotConfirmed, TransportError
from schemas.transport.servicebus import (
    ServiceBusSettings,
    ServiceBusTransport,
    parse_servicebus_address,
)
from tests.servicebus.conftest import close_what_the_sdk_left_open, eventually
from tests.servicebus_double import ServiceBusDouble
from tests.transport._helpers import outgoing, receive
from tests.transport.proxy import TcpProxy

pytestmark = [pytest.mark.servicebus, pytest.mark.timeout(60)]

IDLE = 0.5  # seconds: the tests' sender idle timeout


def _address(double: ServiceBusDouble, idle: float = IDLE) -> str:
    return f"{double.connection_string};sender_idle_timeout={idle:g}"


def test_options_come_from_the_connection_string_or_the_url_and_the_sdk_never_sees_them() -> None:
    conn = "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=s"
    sdk, settings = parse_servicebus_address(f"{conn};Sender_Idle_Timeout=2.5")
    assert sdk == conn
    assert settings.sender_idle_timeout == 2.5
    assert parse_servicebus_address(conn)[1] == ServiceBusSettings()
    url, settings = parse_servicebus_address("sb://ns?sender_idle_timeout=0")
    assert (url, settings.sender_idle_timeout) == ("sb://ns", 0.0)
    with pytest.raises(ConfigError, match="sender_idle_timeout"):
        parse_servicebus_address(f"{conn};sender_idle_timeout=-1")
    with pytest.raises(ConfigError, match="unknown Service Bus option 'idle'"):
        parse_servicebus_address("sb://ns?idle=3")


async def test_the_start_up_check_connects_and_then_lets_the_connection_go(
    double: ServiceBusDouble, channels: ChannelNames
) -> None:
    """Whatever the idle timeout (a central service that never publishes may set minutes)."""
    async with ServiceBusTransport(_address(double, idle=300), channels):
        # connect() opened the stream's sender: the address and the key were good.
        assert double.usage().send_links_by_entity[channels.events_topic].opened == 1
        await eventually(lambda: double.usage().connections.now == 0, within=2)


async def test_an_idle_sender_is_closed_and_the_next_publish_opens_a_new_one(
    double: ServiceBusDouble, channels: ChannelNames
) -> None:
    async with ServiceBusTransport(_address(double), channels) as transport:
        await transport.publish(outgoing("first"))
        await eventually(lambda: double.usage().connections.now == 0, within=IDLE + 3)
        await transport.publish(outgoing("second"))
        assert double.usage().connections.now == 1
        # A burst shares one connection: the idle timer starts again after each send.
        for n in range(3):
            await transport.publish(outgoing(f"burst {n}"))
        usage = double.usage()
        # The start-up check's sender, the first publish's, the second's (shared by the burst).
        assert usage.send_links_by_entity[channels.events_topic].opened == 3
    audit = f"{channels.events_topic}/Subscriptions/audit"
    assert double.namespace.count(audit) == 5


async def test_concurrent_publishes_during_an_idle_close_all_arrive(
    double: ServiceBusDouble, channels: ChannelNames
) -> None:
    """Sends that race the idle timer never meet a closed sender (the SDK cannot send on a
    closed one: 'The handler has already been shutdown')."""
    async with ServiceBusTransport(_address(double, idle=0), channels) as transport:
        await asyncio.gather(*(transport.publish(outgoing(f"m{n}")) for n in range(8)))
        await asyncio.gather(*(transport.publish(outgoing(f"n{n}")) for n in range(8)))
    assert double.namespace.count(f"{channels.events_topic}/Subscriptions/audit") == 16


async def test_an_approvals_subscription_holds_one_receive_link_only_while_open(
    double: ServiceBusDouble, channels: ChannelNames
) -> None:
    async with (
        ServiceBusTransport(_address(double), channels) as agent,
        ServiceBusTransport(_address(double), channels) as approver,
    ):
        queue = channels.approvals_queue
        for round_ in range(3):
            async with agent.approvals("vm-1") as inbox:
                sent = outgoing(f"approve {round_}", routing_key="vm-1", ttl_seconds=60)
                await approver.send_approval(agent.reply_address("vm-1"), sent)
                got = await receive(inbox)
                await got.ack()
                assert got.message_id == sent.message_id
                assert double.usage().receive_links_by_entity[queue].now == 1
            assert double.usage().receive_links.now == 0
        await eventually(lambda: double.usage().connections.now == 0, within=IDLE + 3)


async def test_a_closed_approvals_subscription_is_not_kept_by_the_transport(
    double: ServiceBusDouble, channels: ChannelNames
) -> None:
    """The agent opens and closes its approvals for every event: nothing may pile up."""
    async with ServiceBusTransport(_address(double), channels) as agent:
        inbox = agent.approvals("vm-1")
        async with inbox:
            task = asyncio.ensure_future(anext(inbox))
            await eventually(lambda: double.usage().receive_links.now == 1)
            task.cancel()
        gone = weakref.ref(inbox)
        del inbox, task
        gc.collect()
        assert gone() is None


async def test_application_properties_keep_their_types_bytes_included(
    double: ServiceBusDouble, channels: ChannelNames
) -> None:
    """The SDK reads AMQP strings and binaries alike as bytes; a signature must stay bytes and
    a text property text."""
    signature = bytes(range(256))[::-3]  # not UTF-8
    properties = {"sig": signature, "ascii": b"plain", "vm": "web-7", "n": 3, "ok": True}
    async with ServiceBusTransport(_address(double), channels) as transport:
        await transport.publish(outgoing(properties=properties))  # type: ignore[arg-type]
        async with transport.subscribe("audit") as subscription:
            got = await receive(subscription)
            await got.ack()
    assert dict(got.properties) == properties
    assert isinstance(got.properties["ascii"], bytes)
    assert isinstance(got.properties["vm"], str)


async def test_an_approval_is_handed_over_as_it_arrives(
    double: ServiceBusDouble, channels: ChannelNames
) -> None:
    """A receive call asking for a batch waits 0.2 s after the first message for more (the SDK's
    'further pull'); an approval is one message, and every 0.2 s counts in the round trip."""
    loop = asyncio.get_running_loop()
    async with (
        ServiceBusTransport(double.connection_string, channels) as agent,
        ServiceBusTransport(double.connection_string, channels) as approver,
        agent.approvals("vm-1") as inbox,
    ):
        took = []
        for n in range(4):
            began = loop.time()
            await approver.send_approval(agent.reply_address("vm-1"), outgoing(f"a{n}"))
            await (await receive(inbox)).ack()
            took.append(loop.time() - began)
    assert min(took[1:]) < 0.15, took  # the first one waited for the receiver to open


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("sender", ["open", "reopened"])
async def test_a_stalled_link_fails_the_publish_in_time_and_the_next_one_reconnects(
    double: ServiceBusDouble, channels: ChannelNames, sender: str
) -> None:
    """The SDK waits for ever on a link that went silent, at a send and at an open (a publish
    after an idle close opens a sender): the transport bounds both."""
    async with TcpProxy(double.host, double.port) as proxy:
        address = (
            f"Endpoint=sb://127.0.0.1:{proxy.port};SharedAccessKeyName=k;SharedAccessKey=s;"
            "UseDevelopmentEmulator=true;connect_timeout=2;send_timeout=2;"
            f"sender_idle_timeout={60 if sender == 'open' else IDLE}"
        )
        async with ServiceBusTransport(address, channels) as transport:
            await transport.publish(outgoing("before"))
            if sender == "reopened":
                await eventually(lambda: double.usage().connections.now == 0, within=IDLE + 3)
            proxy.pause()
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(PublishNotConfirmed, match="no answer within 2 s"):
                await transport.publish(outgoing("stalled"))
            assert loop.time() - began < 5
            proxy.resume()
            await transport.publish(outgoing("after"))
    close_what_the_sdk_left_open()


class _Gate:
    """Forwards to the double, except that its ``silent``-th connection is accepted and never
    answered (a link that went silent: only a bounded open gets past it), and that every other
    one from the ``slow_from``-th on is forwarded only ``delay`` seconds after it was accepted
    (a namespace slow to open links)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        silent: int | None = None,
        delay: float = 0.0,
        slow_from: int = 1,
    ) -> None:
        self._target = (host, port)
        self._nth = silent
        self._delay = delay
        self._slow_from = slow_from
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self._silent: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def __aenter__(self) -> _Gate:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._silent:
            writer.transport.abort()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.accepted == self._nth:
            self._silent.append(writer)
            return
        self._silent.append(writer)  # aborted at the end, if the delay is not over
        if self.accepted >= self._slow_from:
            await asyncio.sleep(self._delay)
        self._silent.remove(writer)
        up_reader, up_writer = await asyncio.open_connection(*self._target)

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                sink.transport.abort()

        for task in (pump(reader, up_writer), pump(up_reader, writer)):
            self._tasks.add(asyncio.ensure_future(task))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_an_approvals_receiver_that_stalls_while_opening_is_opened_again(
    double: ServiceBusDouble, channels: ChannelNames
) -> None:
    """The agent opens its approvals when an event appears: a link that is silent just then
    must not keep the approval from it."""
    async with (
        ServiceBusTransport(double.connection_string, channels) as approver,
        _Gate(double.host, double.port, silent=2) as proxy,  # 1: the start-up check
    ):
        address = (
            f"Endpoint=sb://127.0.0.1:{proxy.port};SharedAccessKeyName=k;SharedAccessKey=s;"
            "UseDevelopmentEmulator=true;connect_timeout=1"
        )
        sent = outgoing("approve", routing_key="vm-1", ttl_seconds=60)
        async with (
            ServiceBusTransport(address, channels) as agent,
            agent.approvals("vm-1") as inbox,
        ):
            await approver.send_approval(agent.reply_address("vm-1"), sent)
            got = await receive(inbox, within=20)
            await got.ack()
    close_what_the_sdk_left_open()
    assert got.message_id == sent.message_id


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_sender_slower_to_open_than_the_callers_deadline_still_opens_and_sends(
    double: ServiceBusDouble, channels: ChannelNames
) -> None:
    """Thousands of agents connecting at once make each opening slow. The outbox gives a publish
    10 s; an opening that takes longer was cancelled with it, and the next publish began a new
    one from nothing, so none ever got through (1,000 agents over the double: no message in 4
    minutes). The opening now goes on, bounded by ``connect_timeout``, and the next publish
    uses it."""
    async with _Gate(double.host, double.port, delay=2.0) as proxy:
        address = (
            f"Endpoint=sb://127.0.0.1:{proxy.port};SharedAccessKeyName=k;SharedAccessKey=s;"
            "UseDevelopmentEmulator=true;connect_timeout=10;sender_idle_timeout=60"
        )
        transport = ServiceBusTransport(address, channels)
        attempts = 0
        async with asyncio.timeout(20):
            while True:  # as the outbox does: each attempt under a deadline of its own
                attempts += 1
                try:
                    await asyncio.wait_for(transport.connect(), 1.0)
                    await asyncio.wait_for(transport.publish(outgoing("through")), 1.0)
                    break
                except TimeoutError:
                    await asyncio.sleep(0.1)
        await transport.close()
        opened = proxy.accepted
    close_what_the_sdk_left_open()
    assert double.namespace.count(f"{channels.events_topic}/Subscriptions/audit") == 1
    assert attempts <= 4, attempts
    assert opened == 1  # one opening, carried over from attempt to attempt


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_closing_the_transport_while_a_sender_opens_fails_the_waiting_publish(
    double: ServiceBusDouble, channels: ChannelNames
) -> None:
    """The publish waiting for that opening gets a transport error (the outbox keeps the
    message and tries again), not a cancellation it never asked for."""
    async with _Gate(double.host, double.port, delay=3.0) as proxy:
        address = (
            f"Endpoint=sb://127.0.0.1:{proxy.port};SharedAccessKeyName=k;SharedAccessKey=s;"
            "UseDevelopmentEmulator=true;connect_timeout=10"
        )
        transport = ServiceBusTransport(address, channels)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(transport.connect(), 0.5)  # leaves the opening going on
        publish = asyncio.ensure_future(transport.publish(outgoing("never")))
        await asyncio.sleep(0.5)
        await transport.close()
        with pytest.raises(TransportError):
            await asyncio.wait_for(publish, 5)
    close_what_the_sdk_left_open()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_openings_slower_than_connect_timeout_are_given_longer_until_one_opens(
    double: ServiceBusDouble, channels: ChannelNames
) -> None:
    """Every opening takes 2.5 s (a namespace under a storm of connections) and
    ``connect_timeout`` is 1 s: a fixed deadline would fail every opening for ever. Each one
    that timed out gives the next twice as long, so the start-up check's third (4 s) opens; it
    took about 2.6 s, so the publish's opening (the check lets its connection go) is given
    twice that, and opens at once."""
    async with _Gate(double.host, double.port, delay=2.5) as proxy:
        address = (
            f"Endpoint=sb://127.0.0.1:{proxy.port};SharedAccessKeyName=k;SharedAccessKey=s;"
            "UseDevelopmentEmulator=true;connect_timeout=1;sender_idle_timeout=60"
        )
        transport = ServiceBusTransport(address, channels)
        async with asyncio.timeout(30):
            while True:
                try:
                    await transport.connect()
                    await transport.publish(outgoing("through"))
                    break
                except TransportError:
                    await asyncio.sleep(0.1)
        await transport.close()
        opened = proxy.accepted
    close_what_the_sdk_left_open()
    assert double.namespace.count(f"{channels.events_topic}/Subscriptions/audit") == 1
    assert opened == 4  # the check's 1 s, 2 s and 4 s, then the publish's


class _CountingContext(ssl.SSLContext):
    """A spy on the standard library's boundary (nothing is replaced: every context still
    works): how many TLS contexts this process builds."""

    built = 0

    def __new__(cls, *args: Any, **kwargs: Any) -> _CountingContext:
        cls.built += 1
        return super().__new__(cls, *args, **kwargs)


async def test_openings_share_one_tls_context_instead_of_reading_the_ca_bundle_each_time(
    double: ServiceBusDouble, channels: ChannelNames, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK builds a TLS context for every connection it opens, reading certifi's CA bundle
    each time (about 16 ms of CPU and 0.7 MiB), even for a plain emulator connection; a sender
    opens for each heartbeat after its idle close, and a wave opens a sender and a receiver on
    every agent at once. 1,000 openings in one process spent 83 % of its CPU there, and none
    finished in four minutes (``servicebus_burst.py --transports 1000 --receivers``). The
    transport hands the SDK one context per process."""
    monkeypatch.setattr(ssl, "SSLContext", _CountingContext)
    monkeypatch.setattr(_CountingContext, "built", 0)
    async with ServiceBusTransport(_address(double, idle=0.05), channels) as transport:
        for n in range(6):
            await transport.publish(outgoing(f"m{n}"))
            await asyncio.sleep(0.2)  # idle: the next publish opens a new sender
        async with transport.approvals("vm-1") as inbox:
            approval = outgoing("approve", routing_key="vm-1", ttl_seconds=60)
            await transport.send_approval(transport.reply_address("vm-1"), approval)
            await (await receive(inbox, within=10)).ack()
    assert double.namespace.count(f"{channels.events_topic}/Subscriptions/audit") == 6
    assert _CountingContext.built <= 1, _CountingContext.built


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_an_approvals_receiver_slower_to_open_than_connect_timeout_is_given_longer(
    double: ServiceBusDouble, channels: ChannelNames
) -> None:
    """Receivers open under the same storm as senders (a wave: every agent opens its approvals
    session at once). With every opening taking 2.5 s and ``connect_timeout`` 1 s, a fixed
    deadline threw each one away half done, for ever; as for senders, each that timed out gives
    the next twice as long, so the third (4 s) opens and the approval arrives."""
    async with (
        ServiceBusTransport(double.connection_string, channels) as approver,
        _Gate(double.host, double.port, delay=2.5, slow_from=2) as proxy,  # 1: start-up check
    ):
        address = (
            f"Endpoint=sb://127.0.0.1:{proxy.port};SharedAccessKeyName=k;SharedAccessKey=s;"
            "UseDevelopmentEmulator=true;connect_timeout=1"
        )
        sent = outgoing("approve", routing_key="vm-1", ttl_seconds=60)
        await approver.send_approval(approver.reply_address("vm-1"), sent)
        async with (
            ServiceBusTransport(address, channels) as agent,
            agent.approvals("vm-1") as inbox,
        ):
            got = await receive(inbox, within=25)
            await got.ack()
        openings = proxy.accepted - 1
    close_what_the_sdk_left_open()
    assert got.message_id == sent.message_id
    assert openings == 3  # 1 s, 2 s, then 4 s: opened
