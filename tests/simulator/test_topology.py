"""Fleet topology: scale sets with placement groups over zones, availability sets, standalone
VMs; an event reaches every VM of the sets of the VMs it affects, and any of them may approve it."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest

from publisher.simulator import (
    AvailabilitySetSpec,
    EventSpec,
    EventState,
    EventType,
    ManualClock,
    ScaleSetSpec,
    Simulator,
    SimulatorConfig,
    Topology,
)

from .conftest import HEADERS, HarnessFactory

INSTANCE = "/metadata/instance?api-version=2021-02-01"
GUID = re.compile(r"^[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$")

# Two placement groups per zone in "web" (2 x 3 zones), one availability set, one lone VM.
SMALL = Topology(
    scale_sets=(
        ScaleSetSpec(name="web", capacity=12, zones=("1", "2", "3"), placement_group_size=2),
    ),
    availability_sets=(AvailabilitySetSpec(name="db", vms=("db-a", "db-b", "db-c")),),
    vms=("jump",),
)


def test_a_generated_fleet_of_scale_sets_over_zones_and_availability_sets() -> None:
    topology = Topology.fleet(
        2000, scale_sets=20, zones=3, availability_sets=2, availability_set_size=10
    )
    sim = Simulator(topology=topology)
    assert sim.vm_count == 2020
    names = sim.vm_names()
    assert names[0] == "fleet-0_0"
    assert names[-1] == "avset-1-9"
    members = [sim.membership(n) for n in names]
    assert Counter(m.scale_set for m in members) == {
        **{f"fleet-{k}": 100 for k in range(20)},
        "": 20,
    }
    assert Counter(m.zone for m in members if m.scale_set) == {"1": 680, "2": 660, "3": 660}
    # A placement group holds at most 100 VMs, all in one zone.
    groups: dict[str, set[str]] = {}
    for m in members:
        if m.scale_set:
            groups.setdefault(m.placement_group_id, set()).add(m.zone)
    assert all(len(zones) == 1 for zones in groups.values())
    assert len(groups) == 60  # 20 scale sets x 3 zones, 33 or 34 VMs each
    assert [m.availability_set for m in members[2000:2002]] == ["avset-0", "avset-0"]


def test_the_same_topology_gives_the_same_identities() -> None:
    one, two = Simulator(topology=SMALL), Simulator(topology=SMALL)
    for name in one.vm_names():
        assert one.identity(name) == two.identity(name)
        assert one.membership(name) == two.membership(name)


async def test_instance_metadata_tells_the_topology(make_harness: HarnessFactory) -> None:
    async with make_harness(vms=()) as h:
        h.sim.add_topology(SMALL)
        computes: dict[str, dict[str, Any]] = {}
        for name in h.sim.vm_names():
            response = await h.client.get(f"/vm/{name}{INSTANCE}", headers=HEADERS)
            computes[name] = response.json()["compute"]
        web = computes["web_4"]
        assert (web["vmScaleSetName"], web["zone"]) == ("web", "2")
        assert GUID.match(web["placementGroupId"])
        assert (web["platformFaultDomain"], web["platformUpdateDomain"]) == ("4", "4")
        assert web["resourceId"].endswith("/virtualMachineScaleSets/web/virtualMachines/4")
        # web_1, web_4 are zone 2's first group; web_7, web_10 its second.
        assert computes["web_1"]["placementGroupId"] == web["placementGroupId"]
        assert computes["web_7"]["placementGroupId"] != web["placementGroupId"]
        db = computes["db-b"]
        assert (db["vmScaleSetName"], db["placementGroupId"], db["zone"]) == ("", "", "")
        assert (db["platformFaultDomain"], db["platformUpdateDomain"]) == ("1", "1")
        assert db["resourceId"].endswith("/virtualMachines/db-b")
        assert computes["jump"]["placementGroupId"] == ""


async def test_the_admin_api_adds_and_describes_a_topology(make_harness: HarnessFactory) -> None:
    async with make_harness(vms=["lone"]) as h:
        body = SMALL.model_dump(mode="json")
        response = await h.client.post("/admin/topology", json=body)
        assert response.status_code == 201, response.text
        assert len(response.json()["vms"]) == 16
        again = await h.client.post("/admin/topology", json=body)
        assert again.status_code == 409
        bad = await h.client.post("/admin/topology", json={"scale_sets": [{"name": "x"}]})
        assert bad.status_code == 400
        assert "capacity" in bad.json()["error"]
        described = (await h.client.get("/admin/topology")).json()
    (web,) = described["scale_sets"]
    assert web["name"] == "web"
    assert web["vms"] == 12
    assert [len(g["vms"]) for g in web["placement_groups"]] == [2] * 6
    assert {g["zone"] for g in web["placement_groups"]} == {"1", "2", "3"}
    assert described["availability_sets"] == [{"name": "db", "vms": ["db-a", "db-b", "db-c"]}]
    assert described["standalone"] == ["lone", "jump"]


async def test_an_event_reaches_the_whole_placement_group_only(
    make_harness: HarnessFactory,
) -> None:
    async with make_harness(vms=(), clock=ManualClock()) as h:
        h.sim.add_topology(SMALL)
        event = h.sim.add_event(EventSpec(event_type=EventType.FREEZE, resources=("web_1",)))
        for vm in ("web_1", "web_4"):  # zone 2, first group
            (shown,) = (await h.document(vm))["Events"]
            assert shown["EventId"] == event.event_id
            assert shown["Resources"] == ["web_1"]  # only who is hit
        for vm in ("web_7", "web_0", "db-a", "jump"):
            assert (await h.document(vm))["Events"] == [], vm
        assert h.sim.get_event(event.event_id).seen_by == ("web_1", "web_4")


async def test_an_event_reaches_the_whole_availability_set(make_harness: HarnessFactory) -> None:
    async with make_harness(vms=(), clock=ManualClock()) as h:
        h.sim.add_topology(SMALL)
        event = h.sim.add_event(EventSpec(event_type=EventType.REBOOT, resources=("db-b",)))
        for vm in ("db-a", "db-b", "db-c"):
            document = await h.document(vm)
            assert document["DocumentIncarnation"] == 2
            assert [e["Resources"] for e in document["Events"]] == [["db-b"]]
        assert (await h.document("jump"))["Events"] == []
        assert h.sim.group_of("db-c") == ("db-a", "db-b", "db-c")
        assert h.sim.group_of("jump") == ("jump",)
        # Started and gone: every VM of the set sees both changes.
        h.sim.start_event(event.event_id)
        h.sim.complete_event(event.event_id)
        assert await h.document("db-c") == {"DocumentIncarnation": 4, "Events": []}


async def test_a_standalone_vm_sees_only_its_own_events(make_harness: HarnessFactory) -> None:
    async with make_harness(vms=["solo-1", "solo-2"]) as h:
        h.sim.add_event(EventSpec(event_type=EventType.REBOOT, resources=("solo-1",)))
        assert len((await h.document("solo-1"))["Events"]) == 1
        assert (await h.document("solo-2")) == {"DocumentIncarnation": 1, "Events": []}


async def test_any_vm_that_sees_an_event_may_approve_it_for_all(
    make_harness: HarnessFactory,
) -> None:
    """The bug third-party cluster agents hit: a VM of the set, not in Resources, approves."""
    async with make_harness(vms=(), clock=ManualClock()) as h:
        h.sim.add_topology(SMALL)
        event = h.sim.add_event(EventSpec(event_type=EventType.FREEZE, resources=("db-a", "db-b")))
        response = await h.approve("db-c", event.event_id)
        assert response.status_code == 200, response.text
        info = h.sim.get_event(event.event_id)
        assert info.state is EventState.STARTED
        assert [a.vm for a in info.approvals] == ["db-c"]
        for vm in ("db-a", "db-b", "db-c"):
            (shown,) = (await h.document(vm))["Events"]
            assert (shown["EventStatus"], shown["NotBefore"]) == ("Started", "")
        # A VM outside the set does not see it, and cannot approve it.
        other = h.sim.add_event(EventSpec(event_type=EventType.FREEZE, resources=("db-a",)))
        assert (await h.approve("jump", other.event_id)).status_code == 400
        assert (await h.approve("web_0", other.event_id)).status_code == 400
        assert h.sim.get_event(other.event_id).state is EventState.SCHEDULED


async def test_names_alone_make_implicit_scale_sets_with_placement_groups(
    make_harness: HarnessFactory,
) -> None:
    """``ss_0`` .. ``ss_5``: one implicit scale set over zones 1-3, one group per zone."""
    async with make_harness(vms=[f"ss_{i}" for i in range(6)]) as h:
        h.sim.add_event(EventSpec(event_type=EventType.FREEZE, resources=("ss_0",)))
        seen = [vm for vm in h.sim.vm_names() if (await h.document(vm))["Events"]]
        assert seen == ["ss_0", "ss_3"]  # zone 1
        assert h.sim.identity("ss_3").zone == "1"


def test_a_topology_validates_its_sets() -> None:
    with pytest.raises(ValueError, match="given twice"):
        Topology(scale_sets=(ScaleSetSpec(name="a", capacity=1),) * 2)
    with pytest.raises(ValueError, match="either size or vms"):
        AvailabilitySetSpec(name="a")
    with pytest.raises(ValueError, match="zones"):
        ScaleSetSpec(name="a", capacity=1, zones=("1", "1"))


def test_a_regional_scale_set_splits_into_placement_groups_by_size() -> None:
    sim = Simulator(
        SimulatorConfig(rate_limit=0),
        topology=Topology(scale_sets=(ScaleSetSpec(name="r", capacity=250),)),
    )
    groups = Counter(sim.membership(n).placement_group_id for n in sim.vm_names())
    assert sorted(groups.values()) == [50, 100, 100]
    assert {sim.membership(n).zone for n in sim.vm_names()} == {""}
    assert len(sim.group_of("r_0")) == 100


def test_a_topology_is_added_whole_or_not_at_all() -> None:
    sim = Simulator(vms=["db-b"])
    with pytest.raises(ValueError, match="db-b"):
        sim.add_topology(SMALL)
    with pytest.raises(ValueError, match="bad VM name"):
        sim.add_topology(Topology(vms=("ok", "not/ok")))
    with pytest.raises(ValueError, match="'x'"):
        sim.add_topology(Topology(vms=("x", "x")))
    assert sim.vm_names() == ["db-b"]
