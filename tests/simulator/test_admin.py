"""The admin API: events, VMs, the request log."""

from __future__ import annotations

import re
from typing import Any

import pytest

from publisher.simulator import ManualClock

from .conftest import HEADERS, Harness

GUID = re.compile(r"^[0-9A-F]{8}(-[0-9A-F]{4}){3}-[0-9A-F]{12}$")


async def _create(harness: Harness, **body: Any) -> dict[str, Any]:
    response = await harness.client.post("/admin/events", json=body)
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


async def test_create_an_event_with_defaults(harness: Harness) -> None:
    created = await _create(harness, EventType="Reboot")
    assert GUID.match(created["EventId"])
    assert created["State"] == "Scheduled"
    assert created["Resources"] == ["vm0", "vm1", "vm2"]
    assert created["EventSource"] == "Platform"
    assert created["DurationInSeconds"] == -1
    assert created["RequireAllApprovals"] is False
    assert created["Approvals"] == []


async def test_create_with_every_field(harness: Harness, clock: ManualClock) -> None:
    created = await _create(
        harness,
        EventId="c7061bac-afdc-4513-b24b-aa5f13a16123",
        EventType="Freeze",
        Resources=["vm1"],
        NotBeforeSeconds=60,
        DurationInSeconds=5,
        EventSource="User",
        Description="d",
        RunSeconds=7,
        RequireAllApprovals=True,
    )
    assert created["EventId"] == "C7061BAC-AFDC-4513-B24B-AA5F13A16123"
    (shown,) = (await harness.document("vm1"))["Events"]
    assert shown["EventId"] == created["EventId"]
    assert (shown["EventSource"], shown["Description"], shown["DurationInSeconds"]) == (
        "User",
        "d",
        5,
    )
    clock.advance(60)
    assert (await harness.document("vm1"))["Events"][0]["EventStatus"] == "Started"
    clock.advance(7)
    assert (await harness.document("vm1"))["Events"] == []


async def test_an_event_born_started(harness: Harness) -> None:
    created = await _create(harness, EventType="Reboot", EventStatus="Started")
    assert (created["State"], created["NotBefore"]) == ("Started", "")


@pytest.mark.parametrize(
    ("body", "mentions"),
    [
        ({}, "EventType"),
        ({"EventType": "Explode"}, "EventType"),
        ({"EventType": "Freeze", "NotBefore": 3}, "NotBefore"),
        ({"EventType": "Freeze", "NotBeforeSeconds": -1}, "NotBeforeSeconds"),
        ({"EventType": "Freeze", "Resources": []}, "Resources"),
        ({"EventType": "Freeze", "Resources": ["ghost"]}, "ghost"),
        ({"EventType": "Freeze", "Resources": ["vm0", "vm0"]}, "twice"),
        ({"EventType": "Freeze", "EventStatus": "Completed"}, "EventStatus"),
        ({"EventType": "Freeze", "EventSource": "Robot"}, "EventSource"),
        ({"EventType": "Freeze", "EventId": "not-a-guid"}, "EventId"),
        ({"EventType": "Freeze", "EventStatus": "Started", "NotBeforeSeconds": 5}, "Started"),
    ],
)
async def test_a_bad_event_is_400_naming_the_field(
    harness: Harness, body: dict[str, Any], mentions: str
) -> None:
    response = await harness.client.post("/admin/events", json=body)
    assert response.status_code == 400
    assert mentions in response.json()["error"]


async def test_a_body_that_is_not_json_is_400(harness: Harness) -> None:
    response = await harness.client.post("/admin/events", content=b"{")
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]


async def test_an_event_id_cannot_be_reused(harness: Harness) -> None:
    await _create(harness, EventType="Freeze", EventId="C7061BAC-AFDC-4513-B24B-AA5F13A16123")
    response = await harness.client.post(
        "/admin/events",
        json={"EventType": "Freeze", "EventId": "C7061BAC-AFDC-4513-B24B-AA5F13A16123"},
    )
    assert response.status_code == 400
    assert "taken" in response.json()["error"]


async def test_get_follows_the_state_and_approvals(harness: Harness) -> None:
    created = await _create(harness, EventType="Freeze", Resources=["vm0", "vm1"])
    url = f"/admin/events/{created['EventId']}"
    await harness.approve("vm1", created["EventId"])
    shown = (await harness.client.get(url)).json()
    assert shown["State"] == "Started"
    assert shown["EventStatus"] == "Started"
    (approval,) = shown["Approvals"]
    assert approval["Vm"] == "vm1"
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$", approval["Time"])
    assert shown["StartedAt"] == approval["Time"]
    completed = await harness.client.post(f"{url}/complete")
    assert completed.json()["State"] == "Completed"
    assert (await harness.client.get(url)).json()["EventStatus"] is None


async def test_cancel_start_and_complete(harness: Harness) -> None:
    one = (await _create(harness, EventType="Redeploy"))["EventId"]
    two = (await _create(harness, EventType="Redeploy"))["EventId"]
    assert (await harness.client.delete(f"/admin/events/{one}")).json()["State"] == "Canceled"
    assert (await harness.client.post(f"/admin/events/{two}/start")).json()["State"] == "Started"
    # A Started event cannot be canceled, nor a Scheduled one completed, nor started twice.
    assert (await harness.client.delete(f"/admin/events/{two}")).status_code == 409
    assert (await harness.client.post(f"/admin/events/{two}/start")).status_code == 409
    three = (await _create(harness, EventType="Redeploy"))["EventId"]
    response = await harness.client.post(f"/admin/events/{three}/complete")
    assert response.status_code == 409
    assert "Scheduled" in response.json()["error"]


async def test_unknown_events_are_404(harness: Harness) -> None:
    missing = "F020BA2E-3BC0-4C40-A10B-86575A9EABD5"
    for response in (
        await harness.client.get(f"/admin/events/{missing}"),
        await harness.client.delete(f"/admin/events/{missing}"),
        await harness.client.post(f"/admin/events/{missing}/start"),
        await harness.client.post(f"/admin/events/{missing}/complete"),
    ):
        assert response.status_code == 404
        assert missing in response.json()["error"]


async def test_list_events_by_state(harness: Harness) -> None:
    one = (await _create(harness, EventType="Reboot"))["EventId"]
    await _create(harness, EventType="Reboot", EventStatus="Started")
    listed = (await harness.client.get("/admin/events", params={"state": "Scheduled"})).json()
    assert [e["EventId"] for e in listed["Events"]] == [one]
    assert len((await harness.client.get("/admin/events")).json()["Events"]) == 2
    assert (await harness.client.get("/admin/events?state=Nope")).status_code == 400


async def test_admin_approve_acts_as_that_vm(harness: Harness) -> None:
    event = (await _create(harness, EventType="Reboot", Resources=["vm2"]))["EventId"]
    assert (
        await harness.client.post(f"/admin/events/{event}/approve", json={"vm": "vm1"})
    ).status_code == 404
    response = await harness.client.post(f"/admin/events/{event}/approve", json={"vm": "vm2"})
    assert response.json()["State"] == "Started"


async def test_vms_can_be_added_at_runtime(harness: Harness) -> None:
    response = await harness.client.post("/admin/vms", json={"names": ["late_0", "late_1"]})
    assert response.status_code == 201
    assert response.json()["vms"][0] == {"name": "late_0", "path": "/vm/late_0"}
    assert (await harness.document("late_1")) == {"DocumentIncarnation": 1, "Events": []}
    assert (await harness.client.post("/admin/vms", json={"name": "late_0"})).status_code == 409
    assert (await harness.client.post("/admin/vms", json={"name": "bad/name"})).status_code == 400
    assert (await harness.client.post("/admin/vms", json={})).status_code == 400
    listed = (await harness.client.get("/admin/vms")).json()
    assert listed["default"] == "vm0"
    assert [v["name"] for v in listed["vms"]] == ["vm0", "vm1", "vm2", "late_0", "late_1"]
    shown = (await harness.client.get("/admin/vms/late_0")).json()
    assert shown["compute"]["vmScaleSetName"] == "late"
    assert (await harness.client.get("/admin/vms/ghost")).status_code == 404


async def test_vms_can_be_added_in_process(harness: Harness) -> None:
    identity = harness.sim.add_vm("extra")
    assert identity.name == "extra"
    assert (await harness.document("extra"))["Events"] == []


async def test_the_request_log(harness: Harness) -> None:
    await harness.document("vm1")
    await harness.client.get("/metadata/scheduledevents?api-version=2020-07-01")
    await harness.client.get("/vm/ghost/metadata/instance", headers=HEADERS)
    records = (await harness.client.get("/admin/requests")).json()["requests"]
    assert [(r["vm"], r["method"], r["status"]) for r in records] == [
        ("vm1", "GET", 200),
        ("vm0", "GET", 400),
        (None, "GET", 404),
    ]
    assert records[0]["path"] == "/vm/vm1/metadata/scheduledevents?api-version=2020-07-01"
    assert records[0]["time"].endswith("Z")
    only = (await harness.client.get("/admin/requests", params={"vm": "vm0"})).json()
    assert len(only["requests"]) == 1
    last = (await harness.client.get("/admin/requests", params={"limit": 1})).json()
    assert last["requests"][0]["vm"] is None
    assert (await harness.client.get("/admin/requests?limit=x")).status_code == 400


async def test_unknown_admin_paths_and_methods_are_json(harness: Harness) -> None:
    assert (await harness.client.get("/admin/nothing")).status_code == 404
    response = await harness.client.put("/admin/events")
    assert response.status_code == 405
    assert "error" in response.json()
