"""A hostile IMDS: stale documents, a reset incarnation, a body that drips, a huge body."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from pydantic import ValidationError

from publisher.simulator import EventSpec, EventType, FaultSpec, ManualClock, Simulator, serve

from .conftest import HEADERS, Harness, HarnessFactory

SE = "/metadata/scheduledevents?api-version=2020-07-01"
INSTANCE = "/metadata/instance?api-version=2021-02-01"


async def _incarnation(h: Harness, vm: str | None = None) -> int:
    return int((await h.document(vm))["DocumentIncarnation"])


async def test_stale_serves_an_older_document_then_the_current_again(harness: Harness) -> None:
    sim = harness.sim
    event = sim.add_event(EventSpec(event_type=EventType.FREEZE, resources=("vm0",)))
    second = await harness.document()
    sim.start_event(event.event_id)
    third = await harness.document()
    assert (second["DocumentIncarnation"], third["DocumentIncarnation"]) == (2, 3)

    sim.add_fault(FaultSpec(vm="vm0", stale=1, times=2))
    assert await harness.document() == second  # inc 2, the event as it was: Scheduled
    assert await harness.document() == second
    assert await harness.document() == third


async def test_stale_further_back_than_known_serves_the_oldest(harness: Harness) -> None:
    sim = harness.sim
    sim.add_event(EventSpec(event_type=EventType.REBOOT, resources=("vm1",)))
    sim.add_event(EventSpec(event_type=EventType.REBOOT, resources=("vm1",)))
    assert await _incarnation(harness, "vm1") == 3
    response = await harness.client.post("/admin/faults", json={"vm": "vm1", "stale": 9})
    assert response.status_code == 201
    assert response.json()["stale"] == 9
    assert await harness.document("vm1") == {"DocumentIncarnation": 1, "Events": []}
    # A VM that never had another document has nothing older: it gets the current one.
    sim.add_fault(FaultSpec(vm="vm2", stale=1))
    assert await harness.document("vm2") == {"DocumentIncarnation": 1, "Events": []}


async def test_stale_renders_the_old_document_for_the_version_asked(harness: Harness) -> None:
    sim = harness.sim
    event = sim.add_event(EventSpec(event_type=EventType.FREEZE, resources=("vm0", "vm1")))
    await harness.document()
    sim.cancel_event(event.event_id)
    sim.add_fault(FaultSpec(stale=1))
    (old,) = (await harness.document(version="2017-03-01"))["Events"]
    assert old["Resources"] == ["_vm0", "_vm1"]
    assert "Description" not in old


async def test_reset_answers_incarnation_zero_with_no_events(harness: Harness) -> None:
    harness.sim.add_event(EventSpec(event_type=EventType.REBOOT, resources=("vm0",)))
    await harness.client.post("/admin/faults", json={"reset": True})
    assert await harness.document() == {"DocumentIncarnation": 0, "Events": []}
    assert await _incarnation(harness) == 2


async def test_stale_and_reset_pass_by_posts_and_instance_metadata(harness: Harness) -> None:
    event = harness.sim.add_event(EventSpec(event_type=EventType.REBOOT, resources=("vm0",)))
    harness.sim.add_fault(FaultSpec(reset=True))
    assert (await harness.client.get(INSTANCE, headers=HEADERS)).status_code == 200
    assert (await harness.approve(None, event.event_id)).status_code == 200
    assert [f.remaining for f in harness.sim.faults()] == [1]
    assert (await harness.document())["DocumentIncarnation"] == 0


async def test_drip_sends_one_byte_at_a_time(make_harness: HarnessFactory) -> None:
    async with make_harness() as h:
        expected = await h.document()
        length = len(json.dumps(expected, separators=(",", ":")))
        await h.client.post("/admin/faults", json={"drip_seconds": 0.02, "times": 2})

        # A per-read timeout restarts with every byte: the client waits the whole drip.
        start = time.perf_counter()
        timeout = httpx.Timeout(5.0, read=0.5)
        response = await h.client.get(SE, headers=HEADERS, timeout=timeout)
        elapsed = time.perf_counter() - start
        assert response.status_code == 200
        assert response.json() == expected
        assert int(response.headers["content-length"]) == length
        assert elapsed >= 0.02 * (length - 1) * 0.9

        # Only an overall deadline stops it.
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await h.client.get(SE, headers=HEADERS, timeout=timeout)
        # The simulator is not stuck: the next request is answered at once.
        assert await h.document() == expected


async def test_a_dripping_answer_does_not_hold_the_server_at_exit() -> None:
    sim = Simulator(vms=["a"])
    sim.add_fault(FaultSpec(drip_seconds=1.0))
    loop = asyncio.get_running_loop()
    async with serve(sim, shutdown_timeout=1.0) as server:
        client = httpx.AsyncClient(base_url=server.base_url, timeout=5)
        request = asyncio.create_task(client.get(SE, headers=HEADERS))
        await asyncio.sleep(0.3)
        started = loop.time()
    assert loop.time() - started < 4
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    await client.aclose()


async def test_huge_sends_megabytes_of_a_valid_document(make_harness: HarnessFactory) -> None:
    async with make_harness() as h:
        expected = await h.document()
        h.sim.add_fault(FaultSpec(huge_mb=2, endpoint="scheduledevents"))
        response = await h.client.get(SE, headers=HEADERS)
        assert response.status_code == 200
        assert len(response.content) == 2 * 2**20
        assert int(response.headers["content-length"]) == 2 * 2**20
        assert response.json() == expected  # JSON whitespace pads it
        assert len((await h.client.get(SE, headers=HEADERS)).content) < 100


@pytest.mark.parametrize(
    ("body", "mentions"),
    [
        ({"stale": 0}, "stale"),
        ({"stale": 1, "reset": True}, "exactly one"),
        ({"reset": False}, "reset"),
        ({"drip_seconds": 0}, "drip_seconds"),
        ({"huge_mb": 0}, "huge_mb"),
        ({"huge_mb": 4096}, "huge_mb"),
        ({"huge_mb": 1, "body": "x"}, "exactly one"),
    ],
)
def test_bad_hostile_faults_are_refused(body: dict[str, object], mentions: str) -> None:
    with pytest.raises(ValidationError) as caught:
        FaultSpec.model_validate(body)
    assert mentions in str(caught.value)


def test_stale_documents_come_from_what_imds_produced(clock: ManualClock) -> None:
    sim = Simulator(clock=clock, vms=["a"])
    event = sim.add_event(EventSpec(event_type=EventType.PREEMPT, run_seconds=30))
    assert sim.scheduled_events_document("a")["DocumentIncarnation"] == 2
    clock.advance(3600)  # Started and gone while nobody looked: incarnation 4
    assert sim.scheduled_events_document("a")["DocumentIncarnation"] == 4
    old = sim.stale_document("a", 1)
    assert old["DocumentIncarnation"] == 2
    assert [e["EventId"] for e in old["Events"]] == [event.event_id]
    assert old["Events"][0]["EventStatus"] == "Scheduled"
