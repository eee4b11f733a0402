"""The life of an event over HTTP, with time moved by hand: Scheduled -> Started -> gone."""

from __future__ import annotations

from email.utils import parsedate_to_datetime

import pytest

from publisher.simulator import (
    DEFAULT_NOTICE_SECONDS,
    EventSource,
    EventSpec,
    EventState,
    EventStatus,
    EventType,
    ManualClock,
)

from .conftest import Harness, HarnessFactory


async def test_the_documents_live_migration_sequence(harness: Harness, clock: ManualClock) -> None:
    """Incarnation 1 (empty), 2 (Scheduled), 3 (Started, NotBefore ""), 4 (empty)."""
    assert await harness.document("vm0") == {"DocumentIncarnation": 1, "Events": []}
    event = harness.sim.add_event(
        EventSpec(
            event_type=EventType.FREEZE,
            resources=("vm0", "vm1"),
            duration_in_seconds=5,
            run_seconds=600,
        )
    )
    second = await harness.document("vm0")
    assert second["DocumentIncarnation"] == 2
    assert second["Events"][0]["EventStatus"] == "Scheduled"
    assert second["Events"][0]["NotBefore"] == event.not_before != ""

    clock.advance(899.5)
    assert await harness.document("vm0") == second  # not before NotBefore

    clock.advance(0.5)
    third = await harness.document("vm0")
    assert third["DocumentIncarnation"] == 3
    assert third["Events"][0]["EventStatus"] == "Started"
    assert third["Events"][0]["NotBefore"] == ""

    clock.advance(599.9)
    assert await harness.document("vm0") == third
    clock.advance(0.1)
    assert await harness.document("vm0") == {"DocumentIncarnation": 4, "Events": []}
    assert (await harness.document("vm1"))["DocumentIncarnation"] == 4
    assert harness.sim.get_event(event.event_id).state is EventState.COMPLETED


async def test_not_before_is_the_real_wall_clock_time_of_the_deadline(
    harness: Harness, clock: ManualClock
) -> None:
    created = clock.time()
    harness.sim.add_event(EventSpec(event_type=EventType.REDEPLOY))
    (event,) = (await harness.document())["Events"]
    not_before = parsedate_to_datetime(event["NotBefore"]).timestamp()
    assert not_before == pytest.approx(created + 600, abs=1)
    assert event["NotBefore"].endswith(" GMT")


@pytest.mark.parametrize("event_type", list(EventType))
async def test_default_notice_per_type_divided_by_speed(
    make_harness: HarnessFactory, event_type: EventType
) -> None:
    clock = ManualClock()
    async with make_harness(clock=clock, speed=60) as h:
        h.sim.add_event(EventSpec(event_type=event_type))
        (event,) = (await h.document(version="2020-07-01"))["Events"]
        not_before = parsedate_to_datetime(event["NotBefore"]).timestamp()
        expected = {"Freeze": 900, "Reboot": 900, "Redeploy": 600, "Preempt": 30, "Terminate": 300}
        assert DEFAULT_NOTICE_SECONDS[event_type] == expected[event_type.value]
        assert not_before == pytest.approx(clock.time() + expected[event_type.value] / 60, abs=1)
        clock.advance(expected[event_type.value] / 60)
        (event,) = (await h.document())["Events"]
        assert event["EventStatus"] == "Started"


async def test_an_approval_from_any_listed_vm_starts_it_for_all(harness: Harness) -> None:
    event = harness.sim.add_event(EventSpec(event_type=EventType.REBOOT, resources=("vm0", "vm1")))
    response = await harness.approve("vm1", event.event_id)
    assert response.status_code == 200
    for vm in ("vm0", "vm1"):
        document = await harness.document(vm)
        assert document["DocumentIncarnation"] == 3
        assert document["Events"][0]["EventStatus"] == "Started"
        assert document["Events"][0]["NotBefore"] == ""
    assert (await harness.document("vm2"))["DocumentIncarnation"] == 1


async def test_require_all_approvals_waits_for_every_listed_vm(
    harness: Harness, clock: ManualClock
) -> None:
    event = harness.sim.add_event(
        EventSpec(
            event_type=EventType.TERMINATE,
            resources=("vm1", "vm2"),
            require_all_approvals=True,
        )
    )
    assert (await harness.approve("vm1", event.event_id)).status_code == 200
    clock.advance(10)
    document = await harness.document("vm1")
    assert document["Events"][0]["EventStatus"] == "Scheduled"
    assert document["DocumentIncarnation"] == 2  # a partial approval changes nothing visible
    assert [a.vm for a in harness.sim.get_event(event.event_id).approvals] == ["vm1"]

    assert (await harness.approve("vm2", event.event_id)).status_code == 200
    document = await harness.document("vm1")
    assert document["Events"][0]["EventStatus"] == "Started"
    assert document["DocumentIncarnation"] == 3


async def test_require_all_approvals_still_starts_at_not_before(
    harness: Harness, clock: ManualClock
) -> None:
    event = harness.sim.add_event(
        EventSpec(
            event_type=EventType.TERMINATE,
            resources=("vm1", "vm2"),
            require_all_approvals=True,
            not_before_seconds=300,
        )
    )
    await harness.approve("vm1", event.event_id)
    clock.advance(300)
    assert (await harness.document("vm2"))["Events"][0]["EventStatus"] == "Started"


async def test_a_canceled_event_goes_from_scheduled_to_gone(harness: Harness) -> None:
    event = harness.sim.add_event(EventSpec(event_type=EventType.REDEPLOY, resources=("vm0",)))
    assert (await harness.document("vm0"))["DocumentIncarnation"] == 2
    harness.sim.cancel_event(event.event_id)
    assert await harness.document("vm0") == {"DocumentIncarnation": 3, "Events": []}
    assert harness.sim.get_event(event.event_id).state is EventState.CANCELED


async def test_a_hardware_failure_is_born_started(harness: Harness, clock: ManualClock) -> None:
    harness.sim.add_event(
        EventSpec(
            event_type=EventType.REBOOT,
            event_status=EventStatus.STARTED,
            resources=("vm2",),
            run_seconds=30,
        )
    )
    document = await harness.document("vm2")
    assert document["DocumentIncarnation"] == 2
    assert document["Events"][0]["EventStatus"] == "Started"
    assert document["Events"][0]["NotBefore"] == ""
    clock.advance(30)
    assert await harness.document("vm2") == {"DocumentIncarnation": 3, "Events": []}


async def test_an_event_is_listed_for_exactly_the_vms_in_its_resources(harness: Harness) -> None:
    harness.sim.add_event(EventSpec(event_type=EventType.FREEZE, resources=("vm0", "vm2")))
    everyone = harness.sim.add_event(EventSpec(event_type=EventType.REBOOT))
    assert everyone.resources == ("vm0", "vm1", "vm2")
    counts = {vm: len((await harness.document(vm))["Events"]) for vm in ("vm0", "vm1", "vm2")}
    assert counts == {"vm0": 2, "vm1": 1, "vm2": 2}


async def test_the_incarnation_moves_only_when_the_list_changes(
    harness: Harness, clock: ManualClock
) -> None:
    first = await harness.document("vm0")
    clock.advance(5)
    assert await harness.document("vm0") == first  # polling changes nothing
    harness.sim.add_event(EventSpec(event_type=EventType.FREEZE, resources=("vm1",)))
    assert (await harness.document("vm0"))["DocumentIncarnation"] == 1  # another VM's event

    event = harness.sim.add_event(EventSpec(event_type=EventType.FREEZE, resources=("vm0",)))
    assert (await harness.document("vm0"))["DocumentIncarnation"] == 2
    await harness.approve("vm0", event.event_id)
    assert (await harness.document("vm0"))["DocumentIncarnation"] == 3
    await harness.approve("vm0", event.event_id)  # already Started: nothing changes
    assert (await harness.document("vm0"))["DocumentIncarnation"] == 3


async def test_a_late_poll_sees_every_change_counted(harness: Harness, clock: ManualClock) -> None:
    """Two transitions while nobody asked: +2, and the times are those of the deadlines."""
    event = harness.sim.add_event(
        EventSpec(event_type=EventType.PREEMPT, resources=("vm0",), run_seconds=30)
    )
    clock.advance(3600)
    assert await harness.document("vm0") == {"DocumentIncarnation": 4, "Events": []}
    info = harness.sim.get_event(event.event_id)
    assert info.started_at == pytest.approx(info.created_at + 30)
    assert info.ended_at == pytest.approx(info.created_at + 60)


async def test_events_are_listed_oldest_first(harness: Harness) -> None:
    ids = [
        harness.sim.add_event(EventSpec(event_type=t, resources=("vm0",))).event_id
        for t in (EventType.REBOOT, EventType.FREEZE, EventType.REDEPLOY)
    ]
    assert [e["EventId"] for e in (await harness.document("vm0"))["Events"]] == ids


async def test_user_events_carry_their_source(harness: Harness) -> None:
    harness.sim.add_event(
        EventSpec(event_type=EventType.REBOOT, event_source=EventSource.USER, description="x")
    )
    (event,) = (await harness.document())["Events"]
    assert (event["EventSource"], event["Description"], event["DurationInSeconds"]) == (
        "User",
        "x",
        -1,
    )


async def test_state_counts_tell_how_many_events_are_in_each_state(
    harness: Harness, clock: ManualClock
) -> None:
    """What a fleet's progress is asked from, often: every remembered event counted by state."""
    assert harness.sim.state_counts() == {}
    for _ in range(3):
        harness.sim.add_event(EventSpec(event_type=EventType.FREEZE, resources=("vm0",)))
    started = harness.sim.add_event(EventSpec(event_type=EventType.REBOOT, resources=("vm1",)))
    harness.sim.start_event(started.event_id)
    assert harness.sim.state_counts() == {EventState.SCHEDULED: 3, EventState.STARTED: 1}
    clock.advance(3600)  # the Freezes' NotBefore and every run are past: all of them over
    assert harness.sim.state_counts() == {EventState.COMPLETED: 4}
