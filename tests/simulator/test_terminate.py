"""Scale-set Terminate: one event per deleted VM, each approved by its own VM; an approved one
waits for the unapproved events of the same delete operation (until approved or NotBefore)."""

from __future__ import annotations

import pytest

from publisher.simulator import (
    EventSpec,
    EventState,
    EventType,
    ManualClock,
    ScaleSetSpec,
    Simulator,
    SimulatorConfig,
    Topology,
)

from .conftest import Harness, HarnessFactory

# One regional scale set of four VMs: one placement group, every VM sees every event.
WEB = Topology(scale_sets=(ScaleSetSpec(name="web", capacity=4),))


def _delete(
    sim: Simulator, *vms: str, operation: str = "scale-in-1", notice: float = 300
) -> list[str]:
    return [
        sim.add_event(
            EventSpec(
                event_type=EventType.TERMINATE,
                resources=(vm,),
                operation_id=operation,
                not_before_seconds=notice,
            )
        ).event_id
        for vm in vms
    ]


async def _states(h: Harness, *ids: str) -> list[EventState]:
    return [h.sim.get_event(i).state for i in ids]


async def test_each_vm_gets_its_own_event_and_the_group_sees_them_all(
    make_harness: HarnessFactory,
) -> None:
    async with make_harness(vms=(), clock=ManualClock()) as h:
        h.sim.add_topology(WEB)
        one, two = _delete(h.sim, "web_1", "web_2")
        for vm in ("web_0", "web_1", "web_2", "web_3"):
            events = (await h.document(vm))["Events"]
            assert [(e["EventId"], e["Resources"]) for e in events] == [
                (one, ["web_1"]),
                (two, ["web_2"]),
            ]
            assert {e["EventType"] for e in events} == {"Terminate"}


async def test_an_approved_terminate_waits_for_the_rest_of_its_operation(
    make_harness: HarnessFactory,
) -> None:
    async with make_harness(vms=(), clock=ManualClock()) as h:
        h.sim.add_topology(WEB)
        one, two = _delete(h.sim, "web_1", "web_2")
        before = await h.document("web_2")
        assert (await h.approve("web_2", two)).status_code == 200
        assert await _states(h, one, two) == [EventState.SCHEDULED, EventState.SCHEDULED]
        assert await h.document("web_2") == before  # waiting changes nothing visible
        assert [a.vm for a in h.sim.get_event(two).approvals] == ["web_2"]
        assert (await h.approve("web_1", one)).status_code == 200
        assert await _states(h, one, two) == [EventState.STARTED, EventState.STARTED]
        statuses = [e["EventStatus"] for e in (await h.document("web_3"))["Events"]]
        assert statuses == ["Started", "Started"]


async def test_the_unapproved_one_timing_out_releases_the_approved(
    make_harness: HarnessFactory,
) -> None:
    clock = ManualClock()
    async with make_harness(vms=(), clock=clock) as h:
        h.sim.add_topology(WEB)
        (two,) = _delete(h.sim, "web_2", notice=600)
        (one,) = _delete(h.sim, "web_1", notice=300)  # same operation, earlier NotBefore
        await h.approve("web_2", two)
        clock.advance(299)
        assert await _states(h, one, two) == [EventState.SCHEDULED, EventState.SCHEDULED]
        clock.advance(1)  # web_1's NotBefore: it starts, and nothing holds web_2 back
        assert await _states(h, one, two) == [EventState.STARTED, EventState.STARTED]
        info = h.sim.get_event(two)
        assert info.started_at == h.sim.get_event(one).started_at


async def test_an_approved_terminate_still_starts_at_its_own_not_before(
    make_harness: HarnessFactory,
) -> None:
    clock = ManualClock()
    async with make_harness(vms=(), clock=clock) as h:
        h.sim.add_topology(WEB)
        (two,) = _delete(h.sim, "web_2", notice=300)
        (one,) = _delete(h.sim, "web_1", notice=900)
        await h.approve("web_2", two)
        clock.advance(300)
        assert await _states(h, one, two) == [EventState.SCHEDULED, EventState.STARTED]


async def test_canceling_the_unapproved_one_releases_the_approved(harness: Harness) -> None:
    sim = harness.sim
    sim.add_vms(["ss_0", "ss_3"])  # one implicit placement group (zone 1)
    one, two = _delete(sim, "ss_0", "ss_3")
    sim.approve("ss_3", [two])
    sim.cancel_event(one)
    assert await _states(harness, one, two) == [EventState.CANCELED, EventState.STARTED]


async def test_operations_do_not_wait_for_each_other(harness: Harness) -> None:
    sim = harness.sim
    sim.add_vms(["ss_0", "ss_3"])
    (one,) = _delete(sim, "ss_0", operation="delete-a")
    (two,) = _delete(sim, "ss_3", operation="delete-b")
    sim.approve("ss_3", [two])
    assert await _states(harness, one, two) == [EventState.SCHEDULED, EventState.STARTED]


async def test_a_forced_start_of_the_unapproved_one_releases_the_approved(
    harness: Harness,
) -> None:
    sim = harness.sim
    sim.add_vms(["ss_0", "ss_3"])
    one, two = _delete(sim, "ss_0", "ss_3")
    sim.approve("ss_3", [two])
    sim.start_event(one)
    assert await _states(harness, one, two) == [EventState.STARTED, EventState.STARTED]


async def test_an_operation_id_only_goes_with_terminate(harness: Harness) -> None:
    response = await harness.client.post(
        "/admin/events", json={"EventType": "Reboot", "OperationId": "op-1"}
    )
    assert response.status_code == 400
    assert "OperationId" in response.json()["error"]
    created = await harness.client.post(
        "/admin/events",
        json={"EventType": "Terminate", "Resources": ["vm1"], "OperationId": "op-1"},
    )
    assert created.status_code == 201
    assert created.json()["OperationId"] == "op-1"


def test_the_property_holds_for_a_whole_wave() -> None:
    """Ten VMs deleted in one operation: nine approvals start nothing, the tenth starts all."""
    sim = Simulator(
        SimulatorConfig(rate_limit=0),
        clock=ManualClock(),
        topology=Topology(scale_sets=(ScaleSetSpec(name="w", capacity=10),)),
    )
    ids = _delete(sim, *sim.vm_names())
    for vm, event_id in list(zip(sim.vm_names(), ids, strict=True))[:-1]:
        sim.approve(vm, [event_id])
    assert {sim.get_event(i).state for i in ids} == {EventState.SCHEDULED}
    sim.approve("w_9", [ids[-1]])
    assert {sim.get_event(i).state for i in ids} == {EventState.STARTED}


@pytest.mark.parametrize("require_all", [False, True])
def test_require_all_approvals_still_works_alongside(require_all: bool) -> None:
    sim = Simulator(SimulatorConfig(rate_limit=0), clock=ManualClock(), vms=["a", "b"])
    event = sim.add_event(
        EventSpec(
            event_type=EventType.TERMINATE,
            resources=("a", "b"),
            require_all_approvals=require_all,
        )
    )
    sim.approve("a", [event.event_id])
    expected = EventState.SCHEDULED if require_all else EventState.STARTED
    assert sim.get_event(event.event_id).state is expected
