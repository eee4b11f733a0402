"""What the agent announces follows its scope, across restarts: with ``--all-events`` it
publishes every event its document shows (the other VMs of its placement group's), without it
only its own; switching the scope off and on again announces what it did not announce meanwhile,
and the events it sees but is not in never confuse its own. The simulator's topology delivers
an event to every VM of the placement group, as Azure does."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from pathlib import Path
from typing import Any

from publisher._state import STATE_FILE
from publisher.simulator import EventSpec, EventType
from schemas import MessageType, TransitionMessage
from schemas.channels import ChannelNames

from .harness import recorder, running, settings_for, simulator_server

# web_0 and web_3: one implicit scale set "web", zone 1, the same placement group.


async def test_switching_all_events_off_and_on_again_loses_no_event(tmp_path: Path) -> None:
    unique = uuid.uuid4().hex[:8]
    broker, channels = f"memory://scope-{unique}", ChannelNames().suffixed(unique)
    state = tmp_path / "state"
    async with simulator_server("web_0", "web_3") as server, recorder(broker, channels) as rec:
        sim = server.simulator

        def settings(all_events: bool) -> Any:
            return settings_for(
                server, "web_0", broker, channels, state, all_events=all_events, poll_interval=0.2
            )

        first = sim.add_event(
            EventSpec(event_type=EventType.REBOOT, resources=("web_3",), not_before_seconds=900)
        )
        async with running(settings(True)):
            await rec.wait_for(lambda ms: any(m.subject == first.event_id for m in ms))
        async with running(settings(False)):
            second = sim.add_event(
                EventSpec(event_type=EventType.REBOOT, resources=("web_3",), not_before_seconds=900)
            )
            own = sim.add_event(
                EventSpec(event_type=EventType.FREEZE, resources=("web_0",), not_before_seconds=900)
            )
            await rec.wait_for(lambda ms: any(m.subject == own.event_id for m in ms))
        assert not [m for m in rec.transitions() if m.subject == second.event_id]
        async with running(settings(True)):
            await rec.wait_for(lambda ms: any(m.subject == second.event_id for m in ms))
    announced = {(m.kind, m.subject) for m in rec.transitions()}
    assert announced == {
        (MessageType.SCHEDULED, first.event_id),
        (MessageType.SCHEDULED, own.event_id),
        (MessageType.SCHEDULED, second.event_id),
    }


async def test_a_neighbours_event_costs_the_agent_no_write_to_its_disk(tmp_path: Path) -> None:
    """A placement group of 100 VMs shows every VM each of the 100 events of a wave, three times
    over (scheduled, started, gone). Without ``--all-events`` none of that is the agent's to
    publish, so none of it is written to its state store (on a VM: a synchronous write, to
    disk, each): only a change of its own events is. After a restart it diffs from its last
    stored document, and a neighbour's changes are left out just the same."""
    unique = uuid.uuid4().hex[:8]
    broker, channels = f"memory://quiet-{unique}", ChannelNames().suffixed(unique)
    state = tmp_path / "state"
    async with simulator_server("web_0", "web_3") as server, recorder(broker, channels) as rec:
        sim = server.simulator
        settings = settings_for(server, "web_0", broker, channels, state, poll_interval=0.2)
        async with running(settings):
            await rec.wait_kind(MessageType.AGENT_ONLINE)
            await asyncio.sleep(1)  # its row confirmed and deleted
            stored = sqlite3.connect(state / STATE_FILE)
            before = stored.execute("PRAGMA data_version").fetchone()[0]
            neighbours = sim.add_event(
                EventSpec(event_type=EventType.FREEZE, resources=("web_3",), not_before_seconds=900)
            )
            await asyncio.sleep(1)
            sim.start_event(neighbours.event_id)
            await asyncio.sleep(1)
            sim.complete_event(neighbours.event_id)
            await asyncio.sleep(1)
            after_a_neighbours_event = stored.execute("PRAGMA data_version").fetchone()[0]
            own = sim.add_event(
                EventSpec(event_type=EventType.FREEZE, resources=("web_0",), not_before_seconds=900)
            )
            await rec.wait_kind(MessageType.SCHEDULED)
            after_its_own = stored.execute("PRAGMA data_version").fetchone()[0]
            stored.close()
        sim.cancel_event(own.event_id)
        async with running(settings):
            await rec.wait_kind(MessageType.CANCELED)
    assert after_a_neighbours_event == before, "the agent wrote for a neighbour's event"
    assert after_its_own != before
    assert [(m.kind, m.subject) for m in rec.transitions()] == [
        (MessageType.SCHEDULED, own.event_id),
        (MessageType.CANCELED, own.event_id),
    ]


async def test_an_event_that_stops_listing_the_vm_is_announced_once_more_then_left(
    tmp_path: Path,
) -> None:
    """Azure may change an event's Resources. When an event the agent announced stops listing
    its VM, the agent says so once (``updated``, with the Resources as they are now): the
    central services count a VM as in an event until the VM itself says it is out of it, so
    without that word the event would stay open for it. After that the event is a
    neighbour's: its start and end are not this agent's to announce."""
    unique = uuid.uuid4().hex[:8]
    broker, channels = f"memory://leave-{unique}", ChannelNames().suffixed(unique)
    async with simulator_server("web_0", "web_3") as server, recorder(broker, channels) as rec:
        sim = server.simulator
        settings = settings_for(
            server, "web_0", broker, channels, tmp_path / "state", poll_interval=0.2
        )
        async with running(settings):
            shared = sim.add_event(
                EventSpec(
                    event_type=EventType.REBOOT,
                    resources=("web_0", "web_3"),
                    not_before_seconds=900,
                )
            )
            await rec.wait_kind(MessageType.SCHEDULED)
            sim.update_event(shared.event_id, resources=("web_3",))
            await rec.wait_kind(MessageType.UPDATED)
            sim.start_event(shared.event_id)
            await asyncio.sleep(1)
            sim.complete_event(shared.event_id)
            await asyncio.sleep(1)
    announced = [
        (m.kind, m.data.event.resources)
        for m in rec.transitions()
        if isinstance(m, TransitionMessage)
    ]
    assert len(announced) == len(rec.transitions())
    assert announced == [
        (MessageType.SCHEDULED, ("web_0", "web_3")),
        (MessageType.UPDATED, ("web_3",)),
    ]
