"""The agent's heartbeat says it is alive when nothing else does: it goes once
``heartbeat_interval`` went by without any other message, so a VM busy with its events adds no
heartbeat to the stream (the consumers count a VM live from its last message of any kind)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from publisher.simulator import EventSpec, EventType
from schemas import AgentMessage, MessageType

from .conftest import Broker
from .harness import recorder, running, settings_for, simulator_server

INTERVAL = 2.0


async def test_a_heartbeat_goes_only_after_the_interval_without_any_other_message(
    broker: Broker, tmp_path: Path
) -> None:
    async with (
        simulator_server("web-7") as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        sim = server.simulator
        settings = settings_for(
            server,
            "web-7",
            broker.url,
            broker.channels,
            tmp_path,
            heartbeat_interval=INTERVAL,
            poll_interval=0.5,
        )
        async with running(settings):
            event = sim.add_event(EventSpec(event_type=EventType.REBOOT, not_before_seconds=3600))
            await rec.wait_kind(MessageType.SCHEDULED)
            # Busy for three intervals: the event changes again as soon as the agent published
            # its last change (an ``updated`` at its next poll), and a little later.
            loop = asyncio.get_running_loop()
            busy_until = loop.time() + 3 * INTERVAL
            revision = 0
            while loop.time() < busy_until:
                revision += 1
                sim.update_event(event.event_id, description=f"revision {revision}")
                await rec.wait_kind(MessageType.UPDATED, revision)
                await asyncio.sleep(0.2)
            # Then quiet: two heartbeats, an interval apart.
            await rec.wait_kind(MessageType.AGENT_HEARTBEAT, 2, within=3 * INTERVAL)

    online = rec.of(MessageType.AGENT_ONLINE)[0]
    transitions = rec.transitions()
    heartbeats = rec.of(MessageType.AGENT_HEARTBEAT)
    last_transition = transitions[-1].time
    gaps = [
        (later.time - earlier.time).total_seconds()
        for earlier, later in zip([online, *transitions], transitions, strict=False)
    ]
    assert max(gaps) < INTERVAL, gaps  # never quiet for an interval while busy
    # None while busy: the transitions said the agent was alive.
    assert [h.time for h in heartbeats if h.time < last_transition] == []
    first, second = heartbeats[0].time, heartbeats[1].time
    # The first an interval after the last message, the next an interval after that one.
    assert (first - last_transition).total_seconds() >= INTERVAL - 0.1
    assert (second - first).total_seconds() >= INTERVAL - 0.1
    assert (second - last_transition).total_seconds() < 3 * INTERVAL
    # Each of the agent's own messages says how long it may stay quiet: the consumers count it
    # live for 2.5 of these intervals (a fleet on a longer interval stays live between them).
    own = [m for m in [online, *heartbeats] if isinstance(m, AgentMessage)]
    assert [m.data.heartbeat_interval for m in own] == [INTERVAL] * (1 + len(heartbeats))
