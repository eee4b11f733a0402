"""Failing like IMDS: throttling, the slow first call, injected faults."""

from __future__ import annotations

import time

import pytest

from publisher.simulator import FaultSpec, ManualClock

from .conftest import HEADERS, HarnessFactory

SE = "/metadata/scheduledevents?api-version=2020-07-01"
INSTANCE = "/metadata/instance?api-version=2021-02-01"


async def test_more_than_five_requests_a_second_is_429(make_harness: HarnessFactory) -> None:
    clock = ManualClock()
    async with make_harness(clock=clock, rate_limit=5) as h:
        responses = [await h.client.get(SE, headers=HEADERS) for _ in range(7)]
        assert [r.status_code for r in responses] == [200] * 5 + [429] * 2
        assert responses[-1].json() == {"error": "Too many requests"}
        # Another VM has its own budget.
        assert (await h.client.get("/vm/vm1" + SE, headers=HEADERS)).status_code == 200
        # POST and instance count against the same VM's budget.
        assert (await h.client.get(INSTANCE, headers=HEADERS)).status_code == 429
        clock.advance(0.5)
        assert (await h.client.get(SE, headers=HEADERS)).status_code == 429
        clock.advance(0.5)  # the window slid past the first five
        assert (await h.client.get(SE, headers=HEADERS)).status_code == 200
        throttled = [r for r in h.sim.requests(vm="vm0") if r.status == 429]
        assert len(throttled) == 4


async def test_the_rate_limit_is_configurable(make_harness: HarnessFactory) -> None:
    clock = ManualClock()
    async with make_harness(clock=clock, rate_limit=2) as h:
        statuses = [(await h.client.get(SE, headers=HEADERS)).status_code for _ in range(3)]
        assert statuses == [200, 200, 429]
    async with make_harness(clock=clock, rate_limit=0) as h:
        unthrottled = {(await h.client.get(SE, headers=HEADERS)).status_code for _ in range(30)}
        assert unthrottled == {200}


async def test_the_first_call_of_each_vm_is_slow(make_harness: HarnessFactory) -> None:
    async with make_harness(first_call_delay=60, speed=200) as h:  # 0.3 real seconds
        for vm in ("vm0", "vm1"):
            start = time.perf_counter()
            await h.document(vm)
            first = time.perf_counter() - start
            start = time.perf_counter()
            await h.document(vm)
            second = time.perf_counter() - start
            assert first >= 0.29
            assert second < 0.2


@pytest.mark.parametrize("status", [500, 503, 410, 429])
async def test_a_status_fault_answers_that_status_n_times(
    make_harness: HarnessFactory, status: int
) -> None:
    async with make_harness() as h:
        response = await h.client.post("/admin/faults", json={"status": status, "times": 2})
        assert response.status_code == 201
        statuses = [(await h.client.get(SE, headers=HEADERS)).status_code for _ in range(3)]
        assert statuses == [status, status, 200]


async def test_a_fault_for_one_vm_spares_the_others(make_harness: HarnessFactory) -> None:
    async with make_harness() as h:
        await h.client.post("/admin/faults", json={"vm": "vm1", "status": 503})
        assert (await h.client.get(SE, headers=HEADERS)).status_code == 200
        assert (await h.client.get("/vm/vm2" + SE, headers=HEADERS)).status_code == 200
        assert (await h.client.get("/vm/vm1" + SE, headers=HEADERS)).status_code == 503
        assert (await h.client.get("/vm/vm1" + SE, headers=HEADERS)).status_code == 200


async def test_a_fault_for_every_vm_counts_down_across_them(make_harness: HarnessFactory) -> None:
    async with make_harness() as h:
        await h.client.post("/admin/faults", json={"vm": None, "status": 500, "times": 2})
        assert (await h.client.get("/vm/vm1" + SE, headers=HEADERS)).status_code == 500
        assert (await h.client.get("/vm/vm2" + SE, headers=HEADERS)).status_code == 500
        assert (await h.client.get("/vm/vm0" + SE, headers=HEADERS)).status_code == 200


async def test_a_body_fault_serves_raw_text_with_200(make_harness: HarnessFactory) -> None:
    async with make_harness() as h:
        await h.client.post("/admin/faults", json={"body": '{"DocumentIncarnation": "x", '})
        response = await h.client.get(SE, headers=HEADERS)
        assert (response.status_code, response.text) == (200, '{"DocumentIncarnation": "x", ')


async def test_a_delay_fault_answers_late_then_normally(make_harness: HarnessFactory) -> None:
    async with make_harness(speed=10) as h:
        await h.client.post("/admin/faults", json={"delay_seconds": 3})  # 0.3 real seconds
        start = time.perf_counter()
        response = await h.client.get(SE, headers=HEADERS)
        assert time.perf_counter() - start >= 0.29
        assert response.json() == {"DocumentIncarnation": 1, "Events": []}


async def test_a_fault_can_target_one_endpoint(make_harness: HarnessFactory) -> None:
    async with make_harness() as h:
        h.sim.add_fault(FaultSpec(status=503, endpoint="instance"))
        assert (await h.client.get(SE, headers=HEADERS)).status_code == 200
        assert (await h.client.get(INSTANCE, headers=HEADERS)).status_code == 503


async def test_faults_never_touch_the_admin_api(make_harness: HarnessFactory) -> None:
    async with make_harness() as h:
        await h.client.post("/admin/faults", json={"status": 500})
        assert (await h.client.get("/admin/events")).status_code == 200
        assert (await h.client.get("/admin/faults")).json()["faults"][0]["remaining"] == 1


async def test_faults_can_be_listed_and_cleared(make_harness: HarnessFactory) -> None:
    async with make_harness() as h:
        await h.client.post("/admin/faults", json={"status": 500, "times": 3})
        await h.client.get(SE, headers=HEADERS)
        (fault,) = (await h.client.get("/admin/faults")).json()["faults"]
        assert (fault["status"], fault["times"], fault["remaining"]) == (500, 3, 2)
        assert (await h.client.delete("/admin/faults")).json() == {"cleared": 1}
        assert (await h.client.get(SE, headers=HEADERS)).status_code == 200


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "exactly one"),
        ({"status": 500, "body": "x"}, "exactly one"),
        ({"status": 404}, "status"),
        ({"status": 500, "times": 0}, "times"),
        ({"delay_seconds": -1}, "delay_seconds"),
        ({"status": 500, "vm": "nope"}, "nope"),
        ({"status": 500, "when": "now"}, "when"),
    ],
)
async def test_a_bad_fault_is_refused_naming_the_problem(
    make_harness: HarnessFactory, body: dict[str, object], field: str
) -> None:
    async with make_harness() as h:
        response = await h.client.post("/admin/faults", json=body)
        assert response.status_code in (400, 404)
        assert field in response.json()["error"]
