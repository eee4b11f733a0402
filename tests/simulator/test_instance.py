"""GET /metadata/instance: a realistic compute section, stable per name."""

from __future__ import annotations

import re

import pytest

from publisher.simulator import DEFAULT_SUBSCRIPTION_ID, Placement, Simulator, SimulatorConfig

from .conftest import HEADERS, HarnessFactory

INSTANCE = "/metadata/instance?api-version=2021-02-01"
COMPUTE_FIELDS = {
    "name",
    "vmId",
    "subscriptionId",
    "resourceGroupName",
    "location",
    "zone",
    "vmScaleSetName",
    "platformFaultDomain",
    "platformUpdateDomain",
    "resourceId",
}


async def test_instance_metadata_for_a_standalone_vm(make_harness: HarnessFactory) -> None:
    async with make_harness(vms=["db-01", "WestNO_1"]) as h:
        response = await h.client.get(INSTANCE, headers=HEADERS)
        assert response.status_code == 200
        compute = response.json()["compute"]
        assert set(compute) >= COMPUTE_FIELDS
        assert compute["name"] == "db-01"
        assert compute["vmScaleSetName"] == ""
        assert compute["subscriptionId"] == DEFAULT_SUBSCRIPTION_ID
        assert compute["resourceId"] == (
            f"/subscriptions/{DEFAULT_SUBSCRIPTION_ID}/resourceGroups/relay-sim-rg"
            "/providers/Microsoft.Compute/virtualMachines/db-01"
        )
        assert re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", compute["vmId"])


async def test_instance_metadata_for_a_scale_set_vm(make_harness: HarnessFactory) -> None:
    async with make_harness(vms=["db-01", "WestNO_7"]) as h:
        response = await h.client.get("/vm/WestNO_7" + INSTANCE, headers=HEADERS)
        compute = response.json()["compute"]
        assert compute["name"] == "WestNO_7"
        assert compute["vmScaleSetName"] == "WestNO"
        assert compute["resourceId"].endswith(
            "/providers/Microsoft.Compute/virtualMachineScaleSets/WestNO/virtualMachines/7"
        )
        # Domains and zone come from the instance number: stable, spread.
        assert (compute["platformFaultDomain"], compute["platformUpdateDomain"]) == ("2", "2")
        assert compute["zone"] == "2"


def test_the_vm_id_is_stable_per_name() -> None:
    one = Simulator(vms=["a", "b"])
    two = Simulator(vms=["b", "a"])
    assert one.identity("a").vm_id == two.identity("a").vm_id
    assert one.identity("a").vm_id != one.identity("b").vm_id


def test_domains_spread_deterministically() -> None:
    sim = Simulator(vms=[f"web_{i}" for i in range(10)])
    update_domains = [sim.identity(f"web_{i}").platform_update_domain for i in range(10)]
    assert update_domains == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("name", ["vm0", "web_0"])
def test_the_placement_is_configurable(name: str) -> None:
    placement = Placement("11111111-2222-3333-4444-555555555555", "rg-x", "northeurope")
    compute = Simulator(SimulatorConfig(placement=placement), vms=[name]).instance_document(name)[
        "compute"
    ]
    assert compute["subscriptionId"] == placement.subscription_id
    assert compute["resourceGroupName"] == "rg-x"
    assert compute["location"] == "northeurope"
    assert compute["resourceId"].startswith(
        "/subscriptions/11111111-2222-3333-4444-555555555555/resourceGroups/rg-x/"
    )
