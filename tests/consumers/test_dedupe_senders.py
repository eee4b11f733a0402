"""The dedupe window is fair between senders the broker vouches for, not between the VM names
they claim: with ``--origin scale-set-user`` one broker user may speak for every
``<scale set>_<n>`` VM, so a hostile (or broken) one can invent as many VM names as it likes.
Before, each invented name was a party of its own in the window: the flood evicted every other
VM's ids, and a republish of another VM's message handled before it reached the handler twice.
Now the flood costs its broker user's own entries only.

On the real RabbitMQ, with a broker user of their own for each sender (``rabbitmqctl``)."""

from __future__ import annotations

import asyncio

import pytest

from consumers import DedupeWindow, FleetStream, Origin
from schemas import ChannelNames, MessageType, TransitionMessage
from schemas.transport import open_transport
from schemas.transport.rabbitmq import RabbitMQTransport
from schemas.wire import lifecycle_message
from tests.transport._rabbitmqctl import throwaway_user

from ._factory import event, transition, vm

pytestmark = pytest.mark.rabbitmq

#: The window of this test: the flood is three times what it holds, each id under a new name.
_WINDOW = 8
_FLOOD = 3 * _WINDOW


def _scheduled(vm_name: str, event_id: str) -> TransitionMessage:
    return transition("scheduled", event(event_id, resources=(vm_name,)), vm(vm_name))


async def test_a_broker_user_inventing_vm_names_cannot_flood_out_another_vms_ids(
    amqp_url: str, unique: str
) -> None:
    channels = ChannelNames().suffixed(unique)
    async with (
        asyncio.timeout(60),
        throwaway_user(f"flood-{unique}") as flooder,
        throwaway_user(f"web-{unique}") as web,
        open_transport(amqp_url, channels) as central,
    ):
        assert isinstance(central, RabbitMQTransport)
        try:
            # The flooder's scale set is its user's name: every "<its name>_<n>" is its to speak
            # for, and it names a new VM for each new id.
            flood = [_scheduled(f"{flooder.name}_{n}", f"EVT-FLOOD-{n}") for n in range(_FLOOD)]
            own = _scheduled(f"{web.name}_0", "EVT-WEB")
            after = _scheduled(f"{web.name}_0", "EVT-WEB-AFTER")
            await central.declare_group("approver")
            async with (
                open_transport(flooder.url(amqp_url), channels) as flooding,
                open_transport(web.url(amqp_url), channels) as agent,
            ):
                await agent.publish(lifecycle_message(own))
                for message in flood:
                    await flooding.publish(lifecycle_message(message))
                # web's agent restarts and publishes what it published before, then news.
                await agent.publish(lifecycle_message(own))
                await agent.publish(lifecycle_message(after))

            # ack_batch=1: each message is remembered in the window before the next is read,
            # as when the republish comes long after (a batch not yet remembered catches a
            # repeat by itself).
            stream = FleetStream(
                central,
                "approver",
                origin=Origin.SCALE_SET_USER,
                dedupe=DedupeWindow(size=_WINDOW),
                ack_batch=1,
            )
            handled: list[str] = []

            @stream.on(MessageType.SCHEDULED)
            async def scheduled(message: TransitionMessage) -> None:
                handled.append(message.id)
                if message.id == after.id:
                    stream.stop()

            await stream.run()
        finally:
            await central.delete_topology(groups=["approver"], exchanges=True)
    assert stream.stats.forged == 0  # the broker vouched for every name the flooder claimed
    assert handled.count(own.id) == 1
    assert handled == [own.id, *(m.id for m in flood), after.id]
    assert stream.stats.duplicates == 1
    assert len(stream.dedupe) == _WINDOW
