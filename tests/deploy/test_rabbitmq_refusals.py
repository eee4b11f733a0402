"""Least privilege on the real RabbitMQ: in a throwaway vhost made by
deploy/rabbitmq/relay_rabbitmq.py, what a stolen VM (or approver, or audit) identity tries
beyond its role is refused by the broker itself, whatever client it uses. The tests speak AMQP
directly (aio-pika), as an attacker with the password would, not through the relay's client.

The legitimate flows with the same users are in test_rabbitmq_flows.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import aiormq.exceptions
import pytest

from schemas.channels import vm_word

from ._rabbitmq import RelayVhost, relay_vhost

pytestmark = [pytest.mark.rabbitmq]

EVENTS = "scheduled-events"
APPROVALS = "scheduled-events.vm-approvals"
VM_QUEUE = "scheduled-events.vm."
TIMEOUT = 20


@pytest.fixture(scope="module")
def names() -> dict[str, str]:
    import uuid

    u = uuid.uuid4().hex[:6]
    return {
        # a VM with a dot and capitals: its user is "web_<u>_7", its queue "...vm.web_<u>_7"
        "a": f"Web.{u}.7",
        "b": f"db-{u}-1",
        "scale_set": f"ss{u}",
        "approver": f"relay-approver-{u}",
        "audit": f"relay-audit-{u}",
    }


@pytest.fixture(scope="module")
def relay(amqp_url, names, tmp_path_factory) -> Iterator[RelayVhost]:
    with relay_vhost(
        amqp_url,
        tmp_path_factory.mktemp("relay"),
        vms=(names["a"], names["b"]),
        scale_sets=(names["scale_set"],),
        approvers=(names["approver"],),
        audits=(names["audit"],),
    ) as made:
        yield made


@pytest.fixture
async def topology(relay, names) -> None:
    """What the legitimate parties declare, each as itself: the central services first (they
    declare the exchanges and their groups), then both VMs' queues, as least-privilege agents
    (``declare=passive``) through the relay's own transport."""
    from schemas.transport.rabbitmq import RabbitMQTransport

    async with asyncio.timeout(TIMEOUT):
        async with RabbitMQTransport(relay.url(names["approver"])) as transport:
            await transport.declare_group("approver", exclusive=True)
        async with RabbitMQTransport(relay.url(names["audit"])) as transport:
            await transport.declare_group("audit")
        for vm in (names["a"], names["b"]):
            # The agent's own path: its approvals subscription declares its queue.
            async with (
                RabbitMQTransport(relay.url(vm_word(vm), declare="passive")) as transport,
                transport.approvals(vm),
            ):
                pass


@pytest.fixture
async def as_user(
    relay,
) -> AsyncIterator[Callable[[str], Awaitable[aio_pika.abc.AbstractConnection]]]:
    """Connect as one of the vhost's users (closed after the test)."""
    opened: list[aio_pika.abc.AbstractConnection] = []

    async def connect(user: str) -> aio_pika.abc.AbstractConnection:
        connection = await aio_pika.connect(relay.url(user), timeout=10)
        opened.append(connection)
        return connection

    yield connect
    for connection in opened:
        await connection.close()


Action = Callable[[aio_pika.abc.AbstractChannel], Awaitable[object]]


async def allowed(connection: aio_pika.abc.AbstractConnection, action: Action) -> None:
    async with asyncio.timeout(TIMEOUT):
        channel = await connection.channel(publisher_confirms=True)
        await action(channel)
        await channel.close()


async def refused(connection: aio_pika.abc.AbstractConnection, action: Action) -> str:
    """The broker refuses ``action`` (403 ACCESS_REFUSED closes the channel); its reason."""
    return await _closed_with(connection, action, aiormq.exceptions.ChannelAccessRefused)


async def _closed_with(
    connection: aio_pika.abc.AbstractConnection, action: Action, error: type[Exception]
) -> str:
    async with asyncio.timeout(TIMEOUT):
        channel = await connection.channel(publisher_confirms=True)
        try:
            await action(channel)
            await channel.close()  # a refused publish may only show when the channel closes
        except error as exc:
            return str(exc)
    raise AssertionError(f"the broker allowed it (expected {error.__name__})")


def publish(exchange: str, key: str, **properties: Any) -> Action:
    async def action(channel: aio_pika.abc.AbstractChannel) -> None:
        target = (
            channel.default_exchange
            if exchange == ""
            else await channel.get_exchange(exchange, ensure=False)
        )
        await target.publish(aio_pika.Message(b"{}", **properties), key, timeout=TIMEOUT)

    return action


async def _ignore(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    """A consumer that leaves the messages where they are (unacked, back on close)."""


def consume(queue: str) -> Action:
    async def action(channel: aio_pika.abc.AbstractChannel) -> None:
        declared = await channel.get_queue(queue, ensure=False)
        await declared.consume(_ignore)

    return action


def bind(queue: str, exchange: str, key: str) -> Action:
    async def action(channel: aio_pika.abc.AbstractChannel) -> None:
        declared = await channel.get_queue(queue, ensure=False)
        await declared.bind(exchange, key)

    return action


# -- a VM -------------------------------------------------------------------------------------


async def test_a_vm_publishes_lifecycle_messages_only_as_itself(topology, as_user, names):
    a, b = vm_word(names["a"]), vm_word(names["b"])
    vm = await as_user(a)

    await allowed(vm, publish(EVENTS, f"started.Reboot.{a}", user_id=a))
    await allowed(vm, publish(EVENTS, f"approval-applied.Reboot.{a}", user_id=a))
    await allowed(vm, publish(EVENTS, f"agent-heartbeat.agent.{a}"))

    reason = await refused(vm, publish(EVENTS, f"started.Reboot.{b}"))
    assert f"access to topic 'started.Reboot.{b}' in exchange '{EVENTS}'" in reason
    await refused(vm, publish(EVENTS, f"started.Reboot.x{a}"))  # a longer name ending like it
    await refused(vm, publish(EVENTS, f"started.Reboot.{a}.more"))  # a fourth word
    await refused(vm, publish(EVENTS, f"started.{a}"))  # two words


async def test_a_vm_cannot_sign_its_messages_as_another_user(topology, as_user, names):
    a, b = vm_word(names["a"]), vm_word(names["b"])
    vm = await as_user(a)
    reason = await _closed_with(
        vm,
        publish(EVENTS, f"started.Reboot.{a}", user_id=b),
        aiormq.exceptions.ChannelPreconditionFailed,
    )
    assert "user_id property set to" in reason


async def test_a_vm_cannot_read_another_vms_approvals(topology, as_user, names):
    a = vm_word(names["a"])
    other_queue = VM_QUEUE + vm_word(names["b"])
    own_queue = VM_QUEUE + vm_word(names["a"])
    vm = await as_user(a)

    await allowed(vm, consume(own_queue))
    await refused(vm, consume(other_queue))

    async def declare_other(channel: aio_pika.abc.AbstractChannel) -> None:
        await channel.declare_queue(other_queue, arguments={"x-message-ttl": 600000})

    async def purge_other(channel: aio_pika.abc.AbstractChannel) -> None:
        await (await channel.get_queue(other_queue, ensure=False)).purge()

    async def delete_other(channel: aio_pika.abc.AbstractChannel) -> None:
        await channel.queue_delete(other_queue)

    async def get_other(channel: aio_pika.abc.AbstractChannel) -> None:
        await (await channel.get_queue(other_queue, ensure=False)).get(fail=False)

    for action in (declare_other, purge_other, delete_other, get_other):
        await refused(vm, action)
    # Nor through the fleet stream: its own queue bound to every lifecycle message (it may
    # not read the events exchange at all).
    reason = await refused(vm, bind(own_queue, EVENTS, "#"))
    assert f"access to exchange '{EVENTS}'" in reason
    # Nor another VM's queue bound to anything.
    await refused(vm, bind(other_queue, APPROVALS, vm_word(names["b"])))


async def test_a_vm_cannot_publish_an_approval(topology, as_user, names):
    a, b = vm_word(names["a"]), vm_word(names["b"])
    vm = await as_user(a)
    reason = await refused(vm, publish(APPROVALS, vm_word(names["b"])))
    assert f"exchange '{APPROVALS}'" in reason
    await refused(vm, publish(APPROVALS, vm_word(names["a"])))  # not even to itself
    # Nor straight into another VM's queue through the default exchange.
    await refused(vm, publish("", VM_QUEUE + vm_word(names["b"])))
    await refused(vm, publish("", VM_QUEUE + vm_word(names["a"])))
    # Nor into a consumer group's queue.
    await refused(vm, publish("", "scheduled-events.group.approver"))
    assert a != b


async def test_a_1_0_agents_routing_keys_are_refused_with_a_vm_user(topology, as_user, names):
    """Agents before 1.1 published ``approval.applied.Reboot.<vm>`` (four words) and kept the
    VM name's case: a VM moves to its own user only once its agent runs 1.1 (deploy/README.md,
    "Rolling upgrade")."""
    a = vm_word(names["a"])
    vm = await as_user(a)
    await refused(vm, publish(EVENTS, f"approval.applied.Reboot.{a}"))
    await refused(vm, publish(EVENTS, f"agent.online.agent.{a}"))
    await refused(vm, publish(EVENTS, f"started.Reboot.{names['a'].replace('.', '_')}"))


# -- a scale set ------------------------------------------------------------------------------


async def test_a_scale_set_user_publishes_for_its_own_vms_only(topology, as_user, names):
    scale_set = vm_word(names["scale_set"])
    user = await as_user(scale_set)
    await allowed(user, publish(EVENTS, f"started.Reboot.{scale_set}_0"))
    await allowed(user, publish(EVENTS, f"scheduled.Freeze.{scale_set}_12"))
    await refused(user, publish(EVENTS, f"started.Reboot.{vm_word(names['a'])}"))
    await refused(user, publish(EVENTS, f"started.Reboot.{scale_set}x_0"))  # another scale set
    await refused(user, publish(EVENTS, f"started.Reboot.{scale_set}_0x"))
    await refused(user, publish(APPROVALS, f"{scale_set}_0"))

    async def own_vm_queue(channel: aio_pika.abc.AbstractChannel) -> None:
        queue = await channel.declare_queue(
            f"{VM_QUEUE}{scale_set}_3", arguments={"x-message-ttl": 600000}
        )
        await queue.bind(APPROVALS, f"{scale_set}_3")

    await allowed(user, own_vm_queue)
    await allowed(user, consume(f"{VM_QUEUE}{scale_set}_3"))
    await refused(user, consume(VM_QUEUE + vm_word(names["a"])))


# -- central services -------------------------------------------------------------------------


async def test_the_approver_publishes_approvals_but_no_lifecycle_message(topology, as_user, names):
    approver = await as_user(names["approver"])
    # (mandatory is off here: an approval for a VM without a queue would simply be dropped)
    await allowed(approver, publish(APPROVALS, vm_word(names["a"])))
    await allowed(approver, consume("scheduled-events.group.approver"))
    await refused(approver, publish(EVENTS, f"started.Reboot.{vm_word(names['a'])}"))
    await refused(approver, publish(EVENTS, ""))  # "#" would route an empty key
    await refused(approver, consume("scheduled-events.group.audit"))
    await refused(approver, consume(VM_QUEUE + vm_word(names["a"])))


async def test_the_audit_only_reads_its_group(topology, as_user, names):
    audit = await as_user(names["audit"])
    await allowed(audit, consume("scheduled-events.group.audit"))
    await refused(audit, publish(EVENTS, f"started.Reboot.{vm_word(names['a'])}"))
    await refused(audit, publish(EVENTS, ""))
    await refused(audit, publish(APPROVALS, vm_word(names["a"])))
    await refused(audit, publish("", "scheduled-events.group.audit"))
    await refused(audit, consume("scheduled-events.group.approver"))
    await refused(audit, consume(VM_QUEUE + vm_word(names["a"])))


# -- the shared entities and other VMs' approvals ------------------------------------------


async def test_a_vm_cannot_bind_its_queue_to_another_vms_approvals(topology, as_user, names):
    """The approvals exchange is a topic exchange: binding checks the user's topic read
    permission against the binding key, which allows only the VM's own word."""
    a, b = vm_word(names["a"]), vm_word(names["b"])
    vm = await as_user(a)
    own_queue = VM_QUEUE + a
    await allowed(vm, bind(own_queue, APPROVALS, a))
    reason = await refused(vm, bind(own_queue, APPROVALS, b))
    assert f"access to topic '{b}' in exchange '{APPROVALS}'" in reason
    for pattern in ("#", "*", f"{a}.#", f"#.{b}"):
        await refused(vm, bind(own_queue, APPROVALS, pattern))


async def test_a_scale_set_cannot_bind_to_a_vm_outside_it(topology, as_user, names):
    scale_set = vm_word(names["scale_set"])
    user = await as_user(scale_set)
    await refused(user, bind(f"{VM_QUEUE}{scale_set}_3", APPROVALS, vm_word(names["a"])))
    await refused(user, bind(f"{VM_QUEUE}{scale_set}_3", APPROVALS, f"{scale_set}_#"))


async def test_a_vm_can_neither_declare_nor_delete_the_shared_exchanges(topology, as_user, names):
    vm = await as_user(vm_word(names["a"]))
    for exchange in (EVENTS, APPROVALS, "scheduled-events.unrouted"):

        async def delete(channel: aio_pika.abc.AbstractChannel, name: str = exchange) -> None:
            await channel.exchange_delete(name)

        await refused(vm, delete)

    async def declare(channel: aio_pika.abc.AbstractChannel) -> None:
        await channel.declare_exchange(EVENTS, aio_pika.ExchangeType.TOPIC, durable=True)

    await refused(vm, declare)
    # Checking that it is there (a passive declare) is what its agent does, and allowed.
    await allowed(vm, lambda channel: channel.declare_exchange(EVENTS, passive=True))


async def test_a_vm_cannot_read_the_catch_all(topology, as_user, names):
    """What was published while no group existed waits in the catch-all: other VMs' messages,
    which a VM user may not read (its agent never declares the catch-all)."""
    vm = await as_user(vm_word(names["a"]))
    await refused(vm, consume("scheduled-events.unrouted"))
    await refused(vm, bind(VM_QUEUE + vm_word(names["a"]), "scheduled-events.unrouted", ""))


async def test_a_least_privilege_agent_started_before_the_central_services_says_so(
    amqp_url, names, tmp_path: Path
):
    from schemas import ConfigError
    from schemas.transport.rabbitmq import RabbitMQTransport

    vm = f"early-{names['b']}"

    async def connect(url: str) -> None:
        async with asyncio.timeout(TIMEOUT), RabbitMQTransport(url):
            pass

    with relay_vhost(amqp_url, tmp_path, vms=(vm,)) as own:
        url = own.url(vm_word(vm), declare="passive")
        with pytest.raises(ConfigError, match="start the central services"):
            await connect(url)
