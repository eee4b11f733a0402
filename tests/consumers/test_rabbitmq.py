"""The consumers on the real RabbitMQ: poison messages of every kind dead-lettered with their
reason while good ones flow, repeats and redeliveries handled once, and two approver processes
on one group with the active one killed mid-stream: no decision lost."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from consumers import FleetStream
from schemas import Approval, ChannelNames, MessageType, TransitionMessage
from schemas.approvals import write_key_pair
from schemas.transport import OutgoingMessage, open_transport
from schemas.transport.rabbitmq import RabbitMQTransport
from schemas.wire import lifecycle_message

from ._factory import event, heartbeat, transition, vm

pytestmark = pytest.mark.rabbitmq

ROOT = Path(__file__).parents[2]


@pytest.fixture
async def rabbit(amqp_url, unique):
    channels = ChannelNames().suffixed(unique)
    groups = ["audit", "approver"]
    vms: list[str] = []
    async with open_transport(amqp_url, channels) as transport:
        assert isinstance(transport, RabbitMQTransport)
        transport.test_vms = vms  # type: ignore[attr-defined]
        yield transport
        await transport.delete_topology(groups=groups, vms=vms, exchanges=True)


def raw(body: bytes, message_id: str) -> OutgoingMessage:
    return OutgoingMessage(body=body, message_id=message_id, content_type="application/json")


async def test_poison_of_each_kind_is_dead_lettered_with_its_reason_and_good_ones_flow(rabbit):
    good = [transition("scheduled", event(f"E{i}"), vm("web-1")) for i in range(3)]
    envelope = json.loads(good[0].to_bytes())
    poison = [
        b"\x00garbage",
        b'{"hello": "world"}',
        json.dumps(dict(envelope, schemaversion="2.0", id="v2")).encode(),
        json.dumps(dict(envelope, type="com.example.unknown", id="foreign")).encode(),
        json.dumps(dict(envelope, time="yesterday", id="invalid")).encode(),
    ]
    stream = FleetStream(rabbit, "audit")
    async with stream:
        for index, body in enumerate(poison):
            await rabbit.publish(lifecycle_message(good[0]) if index == 2 else raw(body, "p"))
            if index == 2:
                await rabbit.publish(raw(body, "p"))
        for message in good[1:]:
            await rabbit.publish(lifecycle_message(message))
        await rabbit.publish(lifecycle_message(good[1]))  # an agent's repeat
        got = []
        async with asyncio.timeout(10):
            async for received in stream:
                got.append(received.id)
                if len(got) == 3:
                    break
    assert got == [m.id for m in good]
    reasons = {}
    async with rabbit.dead_letters("audit") as dead:
        async with asyncio.timeout(10):
            async for delivery in dead:
                reasons[delivery.properties["dead_letter_reason"]] = delivery.properties[
                    "dead_letter_description"
                ]
                await delivery.ack()
                if len(reasons) == 5:
                    break
    assert set(reasons) == {
        "not-json",
        "not-cloudevent",
        "version-mismatch",
        "unknown-type",
        "invalid",
    }
    assert "2.0" in str(reasons["version-mismatch"])
    assert "com.example.unknown" in str(reasons["unknown-type"])


async def test_a_redelivered_message_reaches_the_handler_once(rabbit):
    message = transition("started", event("EVT-R", status="Started"), vm("web-1"))
    await rabbit.declare_group("audit")
    # A first consumer takes it and dies before acking: the broker delivers it again.
    async with rabbit.subscribe("audit") as first:
        await rabbit.publish(lifecycle_message(message))
        async with asyncio.timeout(10):
            delivery = await anext(aiter(first))
        assert delivery.delivery_count == 0
    stream = FleetStream(rabbit, "audit")
    seen: list[tuple[str, int]] = []

    @stream.on(MessageType.STARTED)
    async def started(msg: TransitionMessage) -> None:
        seen.append((msg.id, 1))
        await rabbit.publish(lifecycle_message(msg))  # and the agent repeats it
        await rabbit.publish(lifecycle_message(heartbeat(vm("web-1"))))

    @stream.on(MessageType.AGENT_HEARTBEAT)
    async def beat(msg) -> None:
        stream.stop()

    async with asyncio.timeout(10):
        await stream.run()
    assert seen == [(message.id, 1)]
    assert stream.stats.duplicates == 1


def _approver(amqp_url: str, suffix: str, key: Path, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with log.open("wb") as stderr:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "consumers",
                "approver",
                "--broker",
                amqp_url,
                "--channel-suffix",
                suffix,
                "--signing-key",
                str(key),
                # the test publishes every VM's messages as guest: no origin to check here
                "--origin",
                "any",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )


async def _approvals_of(rabbit, names: list[str]):
    """Each VM's approvals queue, subscribed: what arrives there (by VM), the subscriptions,
    and the coroutine that collects one VM's."""
    received: dict[str, list[Approval]] = {name: [] for name in names}
    subscriptions = [rabbit.approvals(name) for name in names]
    for subscription in subscriptions:
        await subscription.start()

    async def collect(name: str, subscription) -> None:
        async for delivery in subscription:
            received[name].append(Approval.from_bytes(delivery.body))
            await delivery.ack()

    return received, subscriptions, collect


async def _wait_for_text(path: Path, text: str, within: float = 20) -> None:
    async with asyncio.timeout(within):
        while text not in path.read_text():  # noqa: ASYNC110, ASYNC240 - another process writes
            await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_two_approvers_one_killed_mid_stream_lose_no_decision(
    rabbit, amqp_url, unique, tmp_path
):
    key, _ = write_key_pair(tmp_path)
    count = 40
    names = [f"vm-{i:02d}" for i in range(count)]
    rabbit.test_vms.extend(names)
    now = datetime.now(UTC)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    received, subscriptions, collect = await _approvals_of(rabbit, names)

    first = _approver(amqp_url, unique, key, logs[0])
    second = None
    try:
        await _wait_for_text(logs[0], "reading group")
        await asyncio.sleep(1.0)  # the first consumer of the queue is the active one
        second = _approver(amqp_url, unique, key, logs[1])
        await _wait_for_text(logs[1], "reading group")
        await asyncio.sleep(0.5)
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(collect(n, s)) for n, s in zip(names, subscriptions, strict=False)
            ]
            for index, name in enumerate(names):
                identity = vm(name)
                reply = rabbit.channels.approvals_exchange
                await rabbit.publish(
                    lifecycle_message(heartbeat(identity, at=now, approvals=reply))
                )
                user_reboot = event(f"EVT-{index:02d}", source="User", resources=(name,))
                scheduled = transition("scheduled", user_reboot, identity, at=now, approvals=reply)
                await rabbit.publish(lifecycle_message(scheduled))
                if index == count // 2:
                    async with asyncio.timeout(10):
                        while sum(map(len, received.values())) < 5:  # noqa: ASYNC110
                            await asyncio.sleep(0.01)
                    first.send_signal(signal.SIGKILL)  # mid-stream, no goodbye
            async with asyncio.timeout(30):
                while not all(received.values()):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            for task in tasks:
                task.cancel()
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(10)
                if process.poll() is None:
                    process.kill()
        for subscription in subscriptions:
            await subscription.close()
        for path in logs:  # shown by pytest when the test fails
            print(path.name, path.read_text() if path.exists() else "(none)")
    assert {name: [a.event_id for a in got][:1] for name, got in received.items()} == {
        name: [f"EVT-{i:02d}"] for i, name in enumerate(names)
    }
    assert first.returncode == -signal.SIGKILL
    assert "decision on EVT-" in logs[0].read_text()  # the first decided some...
    assert "decision on EVT-" in logs[1].read_text()  # ...and the standby took over


def journal(service, handled: Counter[str], *, after=None) -> None:
    """Count in ``handled`` each message ``service`` committed (then await ``after``)."""
    pending: list[str] = []

    async def given(message) -> None:
        pending.append(message.id)

    commit = service.stream.before_ack
    assert commit is not None

    async def commit_then_count() -> None:
        batch = list(pending)  # what this commit covers (the rest is the next one's)
        pending.clear()
        durable = await commit()
        if durable is not None:
            await durable  # failed: not committed, they come back
        handled.update(batch)
        if after is not None:
            await after()

    service.stream.add_handler(given)
    service.stream.before_ack = commit_then_count


@pytest.mark.slow
async def test_a_standby_taking_over_a_batch_committed_but_not_acked_handles_none_of_it_again(
    rabbit, amqp_url, unique, state_url
):
    """The active approver commits a batch, then its link dies before the ack: the broker gives
    the batch to the standby (redelivered), which has never seen it. None of it is handled
    again (the group's state holds it), what the first one handled on its dead link is handled
    by one of them only, and the approvals the first one could not send go out (same ids)
    though no message the standby is given is new.

    What a process handled counts once its commit succeeded, as for the services: a handling
    whose commit failed changed nothing and comes back (the fault storm journals the same)."""
    from consumers._approver import ApproverService
    from consumers._db import open_database
    from consumers._schema import ensure_schema
    from schemas.approvals import generate_signing_key
    from tests.transport.proxy import TcpProxy

    count = 20
    names = [f"vm-{i:02d}" for i in range(count)]
    rabbit.test_vms.extend(names)
    key = generate_signing_key()
    now = datetime.now(UTC)
    reply = rabbit.channels.approvals_exchange
    handled: Counter[str] = Counter()  # message id -> times either approver committed it

    databases = [open_database(state_url) for _ in range(2)]
    for database in databases:
        await database.connect()
    await ensure_schema(databases[0])
    received, subscriptions, collect = await _approvals_of(rabbit, names)

    split = urlsplit(amqp_url)
    runners: list[asyncio.Task[None]] = []
    services: list[ApproverService] = []
    async with contextlib.AsyncExitStack() as stack:
        proxy = await stack.enter_async_context(
            TcpProxy(split.hostname or "127.0.0.1", split.port or 5672)
        )
        proxied = f"amqp://guest:guest@127.0.0.1:{proxy.port}/?reconnect_interval=0.2"
        for index, (url, database) in enumerate(zip((proxied, amqp_url), databases, strict=True)):
            transport = await stack.enter_async_context(open_transport(url, rabbit.channels))
            service = ApproverService(
                transport, key, db=database, decided_by=f"approver-{'ab'[index]}"
            )
            services.append(service)
        cut = asyncio.Event()

        async def cut_once() -> None:
            if not cut.is_set():  # the batch is durable; its ack will not reach the broker
                cut.set()
                await proxy.cut()

        active, standby = services
        journal(active, handled, after=cut_once)
        journal(standby, handled)
        for service in services:  # the first consumer of the queue is the active one
            runners.append(asyncio.create_task(service.run()))
            async with asyncio.timeout(10):
                while not service.stream.subscribed:  # noqa: ASYNC110 - the stream's flag
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(collect(n, s))
                    for n, s in zip(names, subscriptions, strict=True)
                ]
                for index, name in enumerate(names):
                    identity = vm(name)
                    for message in (
                        heartbeat(identity, at=now, approvals=reply),
                        transition(
                            "scheduled",
                            event(f"EVT-{index:02d}", source="User", resources=(name,)),
                            identity,
                            at=now,
                            approvals=reply,
                        ),
                    ):
                        await rabbit.publish(lifecycle_message(message))
                async with asyncio.timeout(30):
                    while not all(received.values()):  # noqa: ASYNC110 - other tasks fill it
                        await asyncio.sleep(0.05)
                await asyncio.sleep(1.0)  # anything handled twice would be by now
                for task in tasks:
                    task.cancel()
        finally:
            for service in services:
                service.stop()
            await proxy.restore()
            async with asyncio.timeout(20):
                await asyncio.gather(*runners, return_exceptions=True)
            for subscription in subscriptions:
                await subscription.close()
            for database in databases:
                await database.close()
    assert cut.is_set()
    assert standby.stream.stats.received > 0, "the standby never took over"
    assert len(handled) == 2 * count
    assert {m: n for m, n in handled.items() if n > 1} == {}
    assert standby.stream.stats.recalled > 0  # given again what the other one committed
    # Every VM got its event's approval: one id (a copy sent again is the same approval).
    assert {name: {a.event_id for a in got} for name, got in received.items()} == {
        name: {f"EVT-{i:02d}"} for i, name in enumerate(names)
    }
    assert all(len({a.approval_id for a in got}) == 1 for got in received.values())
