"""Request accounting per VM: the busiest one-second window, and totals by endpoint, method and
status, since the last reset; in-process and over the admin API."""

from __future__ import annotations

import asyncio

from publisher.simulator import EventSpec, EventType, FaultSpec, ManualClock

from .conftest import HEADERS, Harness, HarnessFactory

SE = "/metadata/scheduledevents?api-version=2020-07-01"
INSTANCE = "/metadata/instance?api-version=2021-02-01"
ATTESTED = "/metadata/attested/document?api-version=2020-09-01"


async def test_the_busiest_second_is_found_over_the_period(
    harness: Harness, clock: ManualClock
) -> None:
    for _ in range(3):
        await harness.document("vm1")
    clock.advance(0.5)
    await harness.document("vm1")
    clock.advance(0.7)  # t = 1.2: the window (0.2, 1.2] holds 0.5 and what follows
    await harness.document("vm1")
    await harness.document("vm1")
    stats = harness.sim.request_stats("vm1")
    assert stats.vm == "vm1"
    assert stats.total == 6
    assert stats.max_per_second == 4
    assert stats.busiest_second == clock.time() - 1.2
    assert harness.sim.request_stats("vm2").total == 0
    assert harness.sim.request_stats("vm2").max_per_second == 0


async def test_totals_by_endpoint_method_and_status(make_harness: HarnessFactory) -> None:
    async with make_harness(clock=ManualClock(), rate_limit=4) as h:
        event = h.sim.add_event(EventSpec(event_type=EventType.FREEZE, resources=("vm0",)))
        await h.client.get(SE, headers=HEADERS)
        await h.client.get(INSTANCE, headers=HEADERS)
        await h.client.get(ATTESTED, headers=HEADERS)
        await h.approve(None, event.event_id)
        throttled = await h.client.get(SE, headers=HEADERS)
        assert throttled.status_code == 429
        h.sim.add_fault(FaultSpec(status=503))
        await h.client.get("/vm/vm1" + SE, headers=HEADERS)
        await h.client.get("/vm/ghost" + SE, headers=HEADERS)  # no such VM: nobody's request
        stats = h.sim.request_stats("vm0")
        assert stats.total == 5
        assert stats.count(endpoint="scheduledevents") == 3
        assert stats.count(method="POST") == 1
        assert stats.count(method="POST", status=429) == 0
        assert stats.count(endpoint="scheduledevents", method="GET", status=429) == 1
        assert stats.count(endpoint="instance") == stats.count(endpoint="attested") == 1
        assert stats.count(status=200) == 4
        assert stats.max_per_second == 5
        assert h.sim.request_stats("vm1").count(status=503) == 1
        assert [s.vm for s in h.sim.all_request_stats()] == ["vm0", "vm1"]


async def test_a_reset_starts_a_new_period(harness: Harness, clock: ManualClock) -> None:
    await harness.document("vm0")
    await harness.document("vm0")
    clock.advance(10)
    harness.sim.reset_request_stats()
    await harness.document("vm0")
    stats = harness.sim.request_stats("vm0")
    assert (stats.total, stats.max_per_second) == (1, 1)
    assert stats.since == clock.time()


async def test_the_admin_api_reports_and_resets(harness: Harness) -> None:
    await harness.document("vm2")
    await harness.approve("vm2", "F020BA2E-3BC0-4C40-A10B-86575A9EABD5")  # 400
    body = (await harness.client.get("/admin/requests/stats")).json()
    (vm2,) = body["vms"]
    assert vm2["vm"] == "vm2"
    assert (vm2["total"], vm2["max_per_second"]) == (2, 2)
    assert vm2["since"].endswith("Z")
    assert vm2["busiest_second"].endswith("Z")
    assert sorted(
        (r["endpoint"], r["method"], r["status"], r["count"]) for r in vm2["requests"]
    ) == [("scheduledevents", "GET", 200, 1), ("scheduledevents", "POST", 400, 1)]
    one = (await harness.client.get("/admin/requests/stats", params={"vm": "vm0"})).json()
    assert one["vms"] == [
        {
            "vm": "vm0",
            "since": vm2["since"],
            "total": 0,
            "max_per_second": 0,
            "busiest_second": None,
            "requests": [],
        }
    ]
    assert (await harness.client.get("/admin/requests/stats?vm=ghost")).status_code == 404
    assert (await harness.client.delete("/admin/requests/stats")).status_code == 200
    assert (await harness.client.get("/admin/requests/stats")).json()["vms"] == []


async def test_on_the_real_clock_a_burst_is_one_window(make_harness: HarnessFactory) -> None:
    async with make_harness() as h:
        for _ in range(3):
            await h.document("vm1")
        await asyncio.sleep(1.05)
        await h.document("vm1")
        stats = h.sim.request_stats("vm1")
        assert (stats.total, stats.max_per_second) == (4, 3)
