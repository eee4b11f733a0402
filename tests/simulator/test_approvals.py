"""POST /metadata/scheduledevents: StartRequests, what is accepted and what is not."""

from __future__ import annotations

import pytest

from publisher.simulator import EventSpec, EventState, EventStatus, EventType

from .conftest import HEADERS, Harness


async def test_a_known_event_answers_200_even_when_already_approved(harness: Harness) -> None:
    event = harness.sim.add_event(EventSpec(event_type=EventType.FREEZE, resources=("vm0", "vm1")))
    first = await harness.approve("vm0", event.event_id)
    assert (first.status_code, first.content) == (200, b"")
    assert (await harness.approve("vm0", event.event_id)).status_code == 200
    assert (await harness.approve("vm1", event.event_id)).status_code == 200
    approvals = harness.sim.get_event(event.event_id).approvals
    assert [a.vm for a in approvals] == ["vm0"]  # approving a Started event records nothing


async def test_an_event_id_is_matched_whatever_its_case(harness: Harness) -> None:
    event = harness.sim.add_event(EventSpec(event_type=EventType.FREEZE))
    assert (await harness.approve("vm0", event.event_id.lower())).status_code == 200
    assert harness.sim.get_event(event.event_id).status is EventStatus.STARTED


async def test_several_events_in_one_post(harness: Harness) -> None:
    ids = [harness.sim.add_event(EventSpec(event_type=EventType.REBOOT)).event_id for _ in "ab"]
    assert (await harness.approve(None, *ids)).status_code == 200
    assert {harness.sim.get_event(i).state for i in ids} == {EventState.STARTED}


async def test_an_approval_after_the_event_ended_is_still_200(harness: Harness) -> None:
    event = harness.sim.add_event(EventSpec(event_type=EventType.REBOOT))
    harness.sim.cancel_event(event.event_id)
    assert (await harness.approve("vm0", event.event_id)).status_code == 200


async def test_an_empty_start_requests_list_is_fine(harness: Harness) -> None:
    response = await harness.client.post(
        harness.se_path("vm0"), headers=HEADERS, json={"StartRequests": []}
    )
    assert response.status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"[]",
        b'{"StartRequests": {"EventId": "x"}}',
        b'{"startrequests": []}',
        b'{"StartRequests": ["C7061BAC-AFDC-4513-B24B-AA5F13A16123"]}',
        b'{"StartRequests": [{"Id": "C7061BAC-AFDC-4513-B24B-AA5F13A16123"}]}',
        b'{"StartRequests": [{"EventId": 7}]}',
        b"\xff\xfe",
    ],
)
async def test_a_malformed_body_is_400(harness: Harness, body: bytes) -> None:
    response = await harness.client.post(harness.se_path("vm0"), headers=HEADERS, content=body)
    assert response.status_code == 400
    assert "StartRequests" in response.json()["error"]


async def test_an_unknown_event_is_400_and_nothing_is_approved(harness: Harness) -> None:
    event = harness.sim.add_event(EventSpec(event_type=EventType.REBOOT))
    response = await harness.approve("vm0", event.event_id, "F020BA2E-3BC0-4C40-A10B-86575A9EABD5")
    assert response.status_code == 400
    assert "F020BA2E" in response.json()["error"]
    assert harness.sim.get_event(event.event_id).state is EventState.SCHEDULED


async def test_a_vm_cannot_approve_an_event_that_does_not_list_it(harness: Harness) -> None:
    event = harness.sim.add_event(EventSpec(event_type=EventType.REBOOT, resources=("vm1",)))
    assert (await harness.approve("vm0", event.event_id)).status_code == 400
    assert harness.sim.get_event(event.event_id).state is EventState.SCHEDULED


async def test_approvals_are_recorded_with_vm_and_time(harness: Harness, clock) -> None:
    event = harness.sim.add_event(
        EventSpec(
            event_type=EventType.TERMINATE,
            resources=("vm0", "vm1"),
            require_all_approvals=True,
        )
    )
    await harness.approve("vm1", event.event_id)
    clock.advance(2)
    await harness.approve("vm0", event.event_id)
    info = harness.sim.get_event(event.event_id)
    assert [(a.vm, a.time) for a in info.approvals] == [
        ("vm1", clock.time() - 2),
        ("vm0", clock.time()),
    ]
    assert info.started_at == clock.time()
