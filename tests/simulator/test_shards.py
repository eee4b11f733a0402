"""Fleet shards: several processes, each serving a disjoint set of whole delivery groups, with
the same identities and (same seed, same inputs) the same events."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from publisher.simulator import (
    ConfigError,
    EventSpec,
    EventType,
    Shard,
    Simulator,
    SimulatorConfig,
    Topology,
)

from .conftest import HEADERS, HarnessFactory
from .test_cli import run_cli, simulator_process

TOPOLOGY = Topology.fleet(
    60, scale_sets=2, zones=3, placement_group_size=4, availability_sets=3, availability_set_size=2
)
SE = "/metadata/scheduledevents?api-version=2020-07-01"


def _sharded(index: int, count: int, seed: int = 1) -> Simulator:
    config = SimulatorConfig(seed=seed, shard=Shard(index, count), rate_limit=0)
    return Simulator(config, vms=["lone-1", "lone-2"], topology=TOPOLOGY)


def test_shards_serve_disjoint_whole_groups_with_the_same_identities() -> None:
    whole = Simulator(SimulatorConfig(seed=1), vms=["lone-1", "lone-2"], topology=TOPOLOGY)
    shards = [_sharded(i, 3) for i in range(3)]
    served = [set(s.served_vm_names()) for s in shards]
    assert set().union(*served) == set(whole.vm_names())
    assert sum(len(s) for s in served) == whole.vm_count
    assert all(len(s) > 10 for s in served)  # round-robin over 24 groups
    for shard, names in zip(shards, served, strict=True):
        assert shard.vm_count == whole.vm_count  # every shard knows the whole fleet
        for name in names:
            assert set(shard.group_of(name)) <= names  # groups stay whole
            assert shard.identity(name) == whole.identity(name)
            assert shard.shard_of(name) == shards.index(shard)


def test_the_same_seed_and_inputs_give_the_same_events() -> None:
    one, two = _sharded(0, 2), _sharded(1, 2)
    spec = EventSpec(event_type=EventType.REBOOT, resources=("fleet-1_7",))
    assert one.add_event(spec).event_id == two.add_event(spec).event_id
    assert one.attestation_ca_pem == two.attestation_ca_pem


def test_a_shard_must_be_one_of_n() -> None:
    assert Shard.parse("2/3") == Shard(2, 3)
    assert str(Shard(2, 3)) == "2/3"
    for bad in ("3/3", "-1/2", "a/b", "1", "1/0"):
        with pytest.raises(ConfigError):
            Shard.parse(bad)


async def test_a_shard_answers_404_for_the_vms_of_another(make_harness: HarnessFactory) -> None:
    async with make_harness(vms=["lone-1", "lone-2"], seed=1, shard=Shard(1, 2)) as h:
        assert h.sim.served_vm_names() == ["lone-2"]
        assert h.sim.default_vm == "lone-2"
        response = await h.client.get("/vm/lone-1" + SE, headers=HEADERS)
        assert response.status_code == 404
        assert "shard 0/2" in response.json()["error"]
        assert (await h.client.get(SE, headers=HEADERS)).status_code == 200
        listed = (await h.client.get("/admin/vms")).json()
        assert (listed["shard"], [v["name"] for v in listed["vms"]]) == ("1/2", ["lone-2"])


async def test_two_shard_processes_split_the_fleet_and_agree_on_events() -> None:
    common = ["--fleet", "30", "--placement-group-size", "5", "--seed", "3"]
    common += ["--scenario", "fleet-wave", "--speed", "1000"]
    async with (
        simulator_process(*common, "--shard", "0/2") as (_, first),
        simulator_process(*common, "--shard", "1/2") as (_, second),
        httpx.AsyncClient(timeout=5) as client,
    ):
        served = []
        for url in (first, second):
            body = (await client.get(f"{url}/admin/vms")).json()
            served.append({v["name"] for v in body["vms"]})
        assert not served[0] & served[1]
        assert served[0] | served[1] == {f"fleet_{i}" for i in range(30)}
        events: list[set[str]] = []
        for url in (first, second):
            async with asyncio.timeout(10):
                while True:
                    listed = (await client.get(f"{url}/admin/events")).json()["Events"]
                    if len(listed) >= 6:
                        break
                    await asyncio.sleep(0.05)
            events.append({e["EventId"] for e in listed[:6]})
        assert events[0] == events[1]
        name = sorted(served[1])[0]
        compute = (
            await client.get(
                f"{second}/vm/{name}/metadata/instance?api-version=2021-02-01", headers=HEADERS
            )
        ).json()["compute"]
        assert compute["vmId"] == Simulator(vms=[name]).identity(name).vm_id


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shard", "0/2"], "--seed"),
        (["--shard", "2/2", "--seed", "1"], "--shard"),
        (["--shard", "x", "--seed", "1"], "--shard"),
    ],
)
async def test_bad_shard_flags_exit_2(args: list[str], message: str) -> None:
    code, _, err = await run_cli(*args)
    assert code == 2
    assert message in err
