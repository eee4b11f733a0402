"""The agent's outbox on Service Bus (the double, the real SDK): a message Service Bus will never
take does not hold back the agent's messages behind it."""

from __future__ import annotations

import sqlite3
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from publisher._state import STATE_FILE
from publisher.simulator import EventSpec, EventType, Simulator, SimulatorConfig
from schemas import ReplyAddress, ScheduledEventsDocument, TransitionMessage, VmIdentity, diff
from schemas.channels import ChannelNames
from schemas.messages import MAX_MESSAGE_BYTES
from schemas.wire import lifecycle_message
from tests.servicebus_double import STANDARD_MAX_MESSAGE_SIZE, ServiceBusDouble

from .harness import GROUP, recorder, running, settings_for, simulator_server

pytestmark = [pytest.mark.servicebus, pytest.mark.timeout(120)]

VM = "web-7"


def _description_for_a_body_of(size: int, channels: ChannelNames) -> str:
    """A Description that makes an event's ``scheduled`` message about ``size`` bytes of body
    (measured on such a message, as the agent builds it, on a simulator of its own)."""
    probe = "D" * 1000
    sim = Simulator(SimulatorConfig(rate_limit=0), vms=[VM])
    sim.add_event(
        EventSpec(
            event_type=EventType.REBOOT, resources=(VM,), not_before_seconds=900, description=probe
        )
    )
    (transition,) = diff(None, ScheduledEventsDocument.from_imds(sim.scheduled_events_document(VM)))
    message = TransitionMessage.build(
        transition,
        vm=VmIdentity.from_instance_metadata(sim.instance_document(VM)),
        reply_to=ReplyAddress(channel=channels.approvals_queue, key=VM),
        observed_at=datetime.now(UTC),
    )
    overhead = len(lifecycle_message(message).body) - len(probe)
    return "D" * (size - overhead)


async def test_a_message_over_the_links_max_size_is_set_aside_and_the_next_ones_go(
    tmp_path: Path,
) -> None:
    """An event whose Description (IMDS's free text: a hostile or odd one can be long) makes
    its ``scheduled`` message 1,000 bytes under the 256 KiB body cap, which the outbox checks
    itself; the agent's signing properties (~2 KB) take the whole message over Service Bus
    Standard's 262,144 bytes, and Service Bus refuses it as it arrives. The next event's
    message must still go out, and the refused one is set aside (kept in the state store).

    Before, the transport raised that refusal as PublishNotConfirmed, which the outbox retries
    for ever: the message was sent again twice a second and nothing of that agent behind it
    (its next transitions, its approvals' outcomes) was ever published."""
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:10])
    double = ServiceBusDouble(
        topics={channels.events_topic: [GROUP]}, session_queues=[channels.approvals_queue]
    )
    state = tmp_path / "state"
    with double:
        broker = double.connection_string
        async with simulator_server(VM) as server, recorder(broker, channels) as rec:
            sim = server.simulator
            long = _description_for_a_body_of(MAX_MESSAGE_BYTES - 1000, channels)
            big = sim.add_event(
                EventSpec(
                    event_type=EventType.REBOOT,
                    resources=(VM,),
                    not_before_seconds=900,
                    description=long,
                )
            )
            settings = settings_for(server, VM, broker, channels, state, poll_interval=0.2)
            assert settings.signs
            async with running(settings) as agent:
                # Ready once it polled: the big event's message is in the outbox, first.
                small = sim.add_event(
                    EventSpec(event_type=EventType.FREEZE, resources=(VM,), not_before_seconds=900)
                )
                await rec.wait_for(lambda ms: any(m.subject == small.event_id for m in ms), 20)
                assert agent.health()[1]["outbox_set_aside"] == 1
    assert not [m for m in rec.messages if m.subject == big.event_id]
    with sqlite3.connect(state / STATE_FILE) as db:
        ((body, why, reason),) = db.execute("SELECT body, why, reason FROM outbox_set_aside")
    assert MAX_MESSAGE_BYTES - 2000 < len(body) <= MAX_MESSAGE_BYTES  # under the body cap
    assert why == "refused"
    assert f"{len(body)} bytes" in reason
    assert str(STANDARD_MAX_MESSAGE_SIZE) in reason
