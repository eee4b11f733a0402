"""The documents' own sample logic, run unchanged in spirit against the simulator.

The Python sample of the Scheduled Events documents polls, then approves every user-initiated
event and every short Freeze, logging the rest; the pseudo-code sample keeps the previous list to
find new events (prepare) and finished ones (recover). Both use ``requests``, as the documents
do, from a worker thread while the simulator serves in the loop.
"""

from __future__ import annotations

import asyncio
import json
from time import sleep
from typing import Any

import requests

from publisher.simulator import EventSource, EventSpec, EventState, EventType

from .conftest import HarnessFactory


def make_sample(metadata_url: str) -> Any:
    """The documents' sample with its URL pointed at the simulator (and timeouts added)."""
    header = {"Metadata": "true"}
    query_params = {"api-version": "2020-07-01"}
    logged: list[str] = []

    def get_scheduled_events() -> Any:
        resp = requests.get(metadata_url, headers=header, params=query_params, timeout=5)
        data = resp.json()
        return data

    def confirm_scheduled_event(event_id: str) -> int:
        payload = json.dumps({"StartRequests": [{"EventId": event_id}]})
        response = requests.post(
            metadata_url, headers=header, params=query_params, data=payload, timeout=5
        )
        return response.status_code

    def log(event: dict[str, Any]) -> None:
        logged.append(event["Description"])

    def advanced_sample(last_document_incarnation: Any) -> Any:
        found_document_incarnation = last_document_incarnation
        while last_document_incarnation == found_document_incarnation:
            sleep(0.01)  # the documents poll every second; the test is in a hurry
            payload = get_scheduled_events()
            found_document_incarnation = payload["DocumentIncarnation"]
        for event in payload["Events"]:
            if event["EventStatus"] == "Started":
                log(event)
            elif event["EventSource"] == "User":  # noqa: SIM114 (kept as the documents write it)
                assert confirm_scheduled_event(event["EventId"]) == 200
            elif (
                event["EventType"] == "Freeze"
                and int(event["DurationInSeconds"]) >= 0
                and int(event["DurationInSeconds"]) < 9
            ):
                assert confirm_scheduled_event(event["EventId"]) == 200
            else:
                log(event)
        return found_document_incarnation

    return advanced_sample, get_scheduled_events, logged


async def test_the_documents_python_sample_approves_what_it_should(
    make_harness: HarnessFactory,
) -> None:
    async with make_harness(vms=["WestNO_0", "WestNO_1"]) as h:
        sim = h.sim
        freeze = sim.add_event(EventSpec(event_type=EventType.FREEZE, duration_in_seconds=5))
        user = sim.add_event(
            EventSpec(
                event_type=EventType.REBOOT,
                event_source=EventSource.USER,
                resources=("WestNO_0",),
            )
        )
        long_freeze = sim.add_event(
            EventSpec(event_type=EventType.FREEZE, duration_in_seconds=30, description="long")
        )
        redeploy = sim.add_event(
            EventSpec(event_type=EventType.REDEPLOY, resources=("WestNO_0",), description="move")
        )
        advanced_sample, _, logged = make_sample(
            h.server.vm_url("WestNO_0") + "/metadata/scheduledevents"
        )

        incarnation = await asyncio.to_thread(advanced_sample, "-1")

        assert incarnation == 5
        assert sim.get_event(freeze.event_id).state is EventState.STARTED
        assert sim.get_event(user.event_id).state is EventState.STARTED
        assert sim.get_event(long_freeze.event_id).state is EventState.SCHEDULED
        assert sim.get_event(redeploy.event_id).state is EventState.SCHEDULED
        assert logged == ["long", "move"]
        assert [a.vm for a in sim.get_event(freeze.event_id).approvals] == ["WestNO_0"]
        # The approval by WestNO_0 let the Freeze proceed for WestNO_1 too.
        statuses = {
            e["EventId"]: e["EventStatus"] for e in (await h.document("WestNO_1"))["Events"]
        }
        assert statuses[freeze.event_id] == "Started"


async def test_the_documents_prepare_and_recover_loop(make_harness: HarnessFactory) -> None:
    """New events are prepared for once, finished ones recovered from once, in order."""
    async with make_harness(vms=["vm0"], speed=100) as h:
        _, get_scheduled_events, _ = make_sample(h.server.base_url + "/metadata/scheduledevents")
        prepared: list[str] = []
        recovered: list[str] = []

        def poll_until_quiet() -> None:
            previous: list[str] = []
            for _ in range(2000):
                current = [e["EventId"] for e in get_scheduled_events()["Events"]]
                prepared.extend(e for e in current if e not in previous)
                recovered.extend(e for e in previous if e not in current)
                previous = current
                if len(recovered) == 2:
                    return
                sleep(0.005)

        poller = asyncio.create_task(asyncio.to_thread(poll_until_quiet))
        first = h.sim.add_event(EventSpec(event_type=EventType.PREEMPT, run_seconds=10))
        await asyncio.sleep(0.05)
        second = h.sim.add_event(
            EventSpec(event_type=EventType.FREEZE, not_before_seconds=10, run_seconds=10)
        )
        await asyncio.wait_for(poller, timeout=10)
        assert prepared == [first.event_id, second.event_id]
        assert sorted(recovered) == sorted(prepared)
