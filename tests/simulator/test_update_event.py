"""Updating a Scheduled event in place: every VM that sees it gets a new incarnation."""

from __future__ import annotations

from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import pytest

from publisher.simulator import (
    EventSpec,
    EventState,
    EventStateError,
    EventType,
    InvalidEventError,
    ManualClock,
    Simulator,
    load_scenario,
    run_scenario,
)

from .conftest import Harness


def _freeze(harness: Harness, *resources: str) -> str:
    spec = EventSpec(event_type=EventType.FREEZE, resources=resources, duration_in_seconds=5)
    return harness.sim.add_event(spec).event_id


async def _incarnations(harness: Harness) -> dict[str, int]:
    return {
        vm: (await harness.document(vm))["DocumentIncarnation"] for vm in harness.sim.vm_names()
    }


async def test_duration_and_description_change_for_every_vm_that_sees_it(
    harness: Harness,
) -> None:
    event_id = _freeze(harness, "vm0", "vm1")
    before = await _incarnations(harness)
    info = harness.sim.update_event(event_id, duration_in_seconds=30, description="longer")
    assert (info.duration_in_seconds, info.description) == (30, "longer")
    after = await _incarnations(harness)
    assert after == {"vm0": before["vm0"] + 1, "vm1": before["vm1"] + 1, "vm2": before["vm2"]}
    (shown,) = (await harness.document("vm1"))["Events"]
    assert (shown["DurationInSeconds"], shown["Description"]) == (30, "longer")
    assert shown["EventStatus"] == "Scheduled"


async def test_a_new_notice_moves_not_before_and_the_start(
    harness: Harness, clock: ManualClock
) -> None:
    event_id = _freeze(harness, "vm0")  # 900 s of notice
    clock.advance(100)
    harness.sim.update_event(event_id, not_before_seconds=1800)
    (shown,) = (await harness.document("vm0"))["Events"]
    not_before = parsedate_to_datetime(shown["NotBefore"]).timestamp()
    assert not_before == pytest.approx(clock.time() + 1800, abs=1)
    clock.advance(1000)  # past the first NotBefore: nothing happens
    assert harness.sim.get_event(event_id).state is EventState.SCHEDULED
    clock.advance(800)
    assert harness.sim.get_event(event_id).state is EventState.STARTED


async def test_new_resources_move_the_event_between_vms_oldest_first(harness: Harness) -> None:
    first = _freeze(harness, "vm0")
    older = _freeze(harness, "vm1")
    newer = _freeze(harness, "vm2")
    before = await _incarnations(harness)
    harness.sim.update_event(older, resources=["vm0", "vm2"])
    after = await _incarnations(harness)
    assert after == {vm: before[vm] + 1 for vm in before}
    assert (await harness.document("vm1"))["Events"] == []
    listed = [e["EventId"] for e in (await harness.document("vm2"))["Events"]]
    assert listed == [older, newer]
    listed = [e["EventId"] for e in (await harness.document("vm0"))["Events"]]
    assert listed == [first, older]
    (shown,) = [e for e in (await harness.document("vm0"))["Events"] if e["EventId"] == older]
    assert shown["Resources"] == ["vm0", "vm2"]


async def test_the_event_type_can_change(harness: Harness) -> None:
    event_id = _freeze(harness, "vm0")
    harness.sim.update_event(event_id, event_type=EventType.REBOOT)
    (shown,) = (await harness.document("vm0"))["Events"]
    assert shown["EventType"] == "Reboot"


async def test_an_update_that_changes_nothing_visible_keeps_the_incarnation(
    harness: Harness,
) -> None:
    event_id = _freeze(harness, "vm0")
    before = await harness.document("vm0")
    harness.sim.update_event(event_id, duration_in_seconds=5, resources=["vm0"])
    assert await harness.document("vm0") == before


def test_only_a_scheduled_event_can_be_updated(clock: ManualClock) -> None:
    sim = Simulator(clock=clock, vms=["a", "b"])
    event = sim.add_event(EventSpec(event_type=EventType.REBOOT))
    sim.start_event(event.event_id)
    with pytest.raises(EventStateError, match="only a Scheduled event"):
        sim.update_event(event.event_id, duration_in_seconds=10)
    other = sim.add_event(EventSpec(event_type=EventType.REBOOT))
    with pytest.raises(InvalidEventError, match="ghost"):
        sim.update_event(other.event_id, resources=["a", "ghost"])
    with pytest.raises(InvalidEventError, match="at least one"):
        sim.update_event(other.event_id)
    with pytest.raises(InvalidEventError, match="duration_in_seconds"):
        sim.update_event(other.event_id, duration_in_seconds=-2)
    deletion = sim.add_event(
        EventSpec(event_type=EventType.TERMINATE, resources=("a",), operation_id="op")
    )
    with pytest.raises(InvalidEventError, match="stays a Terminate"):
        sim.update_event(deletion.event_id, event_type=EventType.REBOOT)
    # A refused update changed nothing.
    assert sim.get_event(other.event_id).resources == ("a", "b")


async def test_patch_admin_events(harness: Harness) -> None:
    event_id = _freeze(harness, "vm0")
    url = f"/admin/events/{event_id}"
    response = await harness.client.patch(
        url, json={"DurationInSeconds": 12, "Resources": ["vm0", "vm1"], "NotBeforeSeconds": 60}
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    assert (body["DurationInSeconds"], body["Resources"]) == (12, ["vm0", "vm1"])
    assert body["SeenBy"] == ["vm0", "vm1"]
    for bad, mentions in (
        ({}, "at least one"),
        ({"Colour": "red"}, "Colour"),
        ({"Resources": ["ghost"]}, "ghost"),
        ({"EventType": "Explode"}, "EventType"),
        ({"DurationInSeconds": -5}, "DurationInSeconds"),
    ):
        refused = await harness.client.patch(url, json=bad)
        assert refused.status_code == 400, bad
        assert mentions in refused.json()["error"], bad
    missing = "F020BA2E-3BC0-4C40-A10B-86575A9EABD5"
    assert (await harness.client.patch(f"/admin/events/{missing}", json=body)).status_code in (
        400,
        404,
    )
    assert (
        await harness.client.patch(f"/admin/events/{missing}", json={"DurationInSeconds": 1})
    ).status_code == 404
    await harness.client.post(f"{url}/start")
    started = await harness.client.patch(url, json={"DurationInSeconds": 1})
    assert started.status_code == 409


async def test_a_scenario_can_update_an_event(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(
        """
vms = ["a", "b"]
[[actions]]
at = 0
action = "create_event"
ref = "e"
event = { EventType = "Freeze", Resources = ["a"] }
[[actions]]
at = 0
action = "update_event"
event = "e"
changes = { DurationInSeconds = 20, Resources = ["a", "b"] }
""",
        encoding="utf-8",
    )
    sim = Simulator(clock=ManualClock())
    refs = await run_scenario(sim, load_scenario(path))
    info = sim.get_event(refs["e"][0])
    assert (info.duration_in_seconds, info.resources) == (20, ("a", "b"))
