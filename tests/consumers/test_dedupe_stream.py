"""One VM's flood of new ids through the fleet stream costs other VMs nothing: their messages
handled already still reach no handler twice, and another message under one of their ids is
still caught. Every VM may publish to the events exchange and ids are the senders' own, so a
hostile (or broken) VM can publish as many new ids as it likes. (With a broker-user origin
the window is fair between broker users, however many VMs one names: test_dedupe_senders.py, on
RabbitMQ.)"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from consumers import DeadLetterReason, DedupeWindow, FleetStream, Origin
from schemas import MessageType, TransitionMessage
from schemas.transport import DEAD_LETTER_REASON, MemoryTransport
from schemas.wire import lifecycle_message

from ._factory import event, transition, vm

#: The window of these tests: the flood is three times what it holds.
_WINDOW = 8
_FLOOD = 3 * _WINDOW


@pytest.fixture
async def transport():
    async with MemoryTransport(f"dedupe-{uuid.uuid4().hex}") as memory:
        yield memory


def _flood(name: str) -> list[TransitionMessage]:
    """New ids from VM ``name``: one event each, as a VM inventing events would send them.
    ``name`` may hold ``{n}``: a VM invented for each id."""
    messages = []
    for n in range(_FLOOD):
        vm_name = name.format(n=n)
        ev = event(f"EVT-FLOOD-{n}", resources=(vm_name,))
        messages.append(transition("scheduled", ev, vm(vm_name)))
    return messages


async def _run(
    transport: MemoryTransport,
    messages: list[TransitionMessage | tuple[MemoryTransport, TransitionMessage]],
    last: str,
    origin: Origin | None = None,
):
    """The messages (each published by ``transport``, or by the transport paired with it)
    through an approver-like stream with a window of ``_WINDOW`` ids, until the message with
    id ``last`` is handled: (the ids each handler call got, the stream)."""
    stream = FleetStream(transport, "approver", dedupe=DedupeWindow(size=_WINDOW), origin=origin)
    handled: list[str] = []

    @stream.on(MessageType.SCHEDULED)
    async def scheduled(message: TransitionMessage) -> None:
        handled.append(message.id)
        if message.id == last:
            stream.stop()

    await transport.declare_group("approver")
    for item in messages:
        publisher, message = item if isinstance(item, tuple) else (transport, item)
        await publisher.publish(lifecycle_message(message))
    async with asyncio.timeout(5):
        await stream.run()
    return handled, stream


async def test_a_vms_message_handled_before_another_vms_flood_reaches_the_handler_once(
    transport,
):
    own = transition("scheduled", event("EVT-A", resources=("web-a",)), vm("web-a"))
    flood = _flood("web-b")
    after = transition("scheduled", event("EVT-C", resources=("web-c",)), vm("web-c"))
    # web-a's message, web-b's flood, then web-a's agent republishes (a restart, a replay).
    handled, stream = await _run(transport, [own, *flood, own, after], after.id)
    assert handled.count(own.id) == 1
    assert handled == [own.id, *(m.id for m in flood), after.id]
    assert stream.stats.duplicates == 1
    assert len(stream.dedupe) == _WINDOW
    assert transport.broker.depth("approver") == 0


async def test_another_message_under_an_id_handled_before_a_flood_is_still_a_conflict(transport):
    own = transition("scheduled", event("EVT-A", resources=("web-a",)), vm("web-a"))
    other = transition("scheduled", event("EVT-A2", resources=("web-a",)), vm("web-a")).model_copy(
        update={"id": own.id}
    )
    flood = _flood("web-b")
    after = transition("scheduled", event("EVT-C", resources=("web-c",)), vm("web-c"))
    handled, stream = await _run(transport, [own, *flood, other, after], after.id)
    assert handled == [own.id, *(m.id for m in flood), after.id]
    assert stream.stats.conflicts == 1
    async with transport.dead_letters("approver") as dead:
        async with asyncio.timeout(2):
            letter = await anext(aiter(dead))
            await letter.ack()
    assert letter.properties[DEAD_LETTER_REASON] == DeadLetterReason.ID_CONFLICT
    assert letter.body == lifecycle_message(other).body


@pytest.mark.parametrize("origin", [None, Origin.ANY])
async def test_without_an_origin_check_agents_sharing_a_broker_user_are_fair_by_vm(
    transport, origin
):
    """Without an origin check the operator trusts the senders, who often share one broker
    user: the window is fair between the VMs they name, so one agent flooding new ids under its
    own name (a broken one) does not empty the window of the other agents on the same user,
    and another VM's message handled before the flood still reaches the handler once."""
    broker = transport.broker
    async with (
        MemoryTransport(broker, user="agents") as web_a,
        MemoryTransport(broker, user="agents") as web_b,
    ):
        own = transition("scheduled", event("EVT-A", resources=("web-a",)), vm("web-a"))
        flood = _flood("web-b")
        after = transition("scheduled", event("EVT-C", resources=("web-a",)), vm("web-a"))
        handled, stream = await _run(
            transport,
            [(web_a, own), *((web_b, m) for m in flood), (web_a, own), (web_a, after)],
            after.id,
            origin,
        )
    assert handled == [own.id, *(m.id for m in flood), after.id]
    assert stream.stats.duplicates == 1
    assert len(stream.dedupe) == _WINDOW
