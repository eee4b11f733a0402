"""The IMDS request rules: header, X-Forwarded-For, api-version, fields per version, routing."""

from __future__ import annotations

import json

import pytest

from publisher.simulator import (
    INSTANCE_VERSIONS,
    SCHEDULED_EVENTS_VERSIONS,
    EventSpec,
    EventStatus,
    EventType,
)

from .conftest import HEADERS, Harness

SE = "/metadata/scheduledevents?api-version=2020-07-01"
INSTANCE = "/metadata/instance?api-version=2021-02-01"


async def test_an_empty_document(harness: Harness) -> None:
    assert await harness.document() == {"DocumentIncarnation": 1, "Events": []}


@pytest.mark.parametrize("path", [SE, INSTANCE, "/vm/vm1" + SE, "/vm/vm1" + INSTANCE])
@pytest.mark.parametrize("headers", [{}, {"Metadata": "false"}, {"Metadata": ""}])
async def test_without_metadata_true_is_400_with_a_json_error(
    harness: Harness, path: str, headers: dict[str, str]
) -> None:
    response = await harness.client.get(path, headers=headers)
    assert response.status_code == 400
    assert "metadata header" in response.json()["error"].lower()


async def test_a_post_without_the_header_is_400_and_approves_nothing(harness: Harness) -> None:
    event = harness.sim.add_event(EventSpec(event_type=EventType.REBOOT))
    body = {"StartRequests": [{"EventId": event.event_id}]}
    response = await harness.client.post(SE, json=body)
    assert response.status_code == 400
    assert harness.sim.get_event(event.event_id).status is EventStatus.SCHEDULED


async def test_the_header_value_is_case_insensitive(harness: Harness) -> None:
    response = await harness.client.get(SE, headers={"Metadata": "True"})
    assert response.status_code == 200


@pytest.mark.parametrize("path", [SE, INSTANCE])
async def test_x_forwarded_for_is_400(harness: Harness, path: str) -> None:
    headers = {**HEADERS, "X-Forwarded-For": "10.0.0.9"}
    response = await harness.client.get(path, headers=headers)
    assert response.status_code == 400
    assert "X-Forwarded-For" in response.json()["error"]


@pytest.mark.parametrize(
    ("endpoint", "query", "versions"),
    [
        ("scheduledevents", "", SCHEDULED_EVENTS_VERSIONS),
        ("scheduledevents", "?api-version=", SCHEDULED_EVENTS_VERSIONS),
        ("scheduledevents", "?api-version={latest}", SCHEDULED_EVENTS_VERSIONS),
        ("scheduledevents", "?api-version=2021-02-01", SCHEDULED_EVENTS_VERSIONS),
        ("instance", "", INSTANCE_VERSIONS),
        ("instance", "?api-version=2020-07-02", INSTANCE_VERSIONS),
    ],
)
async def test_a_missing_or_unknown_api_version_is_400_listing_the_valid_ones(
    harness: Harness, endpoint: str, query: str, versions: tuple[str, ...]
) -> None:
    response = await harness.client.get(f"/metadata/{endpoint}{query}", headers=HEADERS)
    assert response.status_code == 400
    body = response.json()
    assert "api-version" in body["error"]
    assert sorted(body["valid-versions"]) == sorted(versions)
    assert body["newest-versions"][0] == max(versions)


@pytest.mark.parametrize("version", SCHEDULED_EVENTS_VERSIONS)
async def test_every_scheduled_events_version_answers(harness: Harness, version: str) -> None:
    assert (await harness.document(version=version))["Events"] == []


BASE_FIELDS = {"EventId", "EventStatus", "EventType", "ResourceType", "Resources", "NotBefore"}


@pytest.mark.parametrize(
    ("version", "extra"),
    [
        ("2017-03-01", set()),
        ("2017-08-01", set()),
        ("2017-11-01", set()),
        ("2019-01-01", set()),
        ("2019-04-01", {"Description"}),
        ("2019-08-01", {"Description", "EventSource"}),
        ("2020-07-01", {"Description", "EventSource", "DurationInSeconds"}),
    ],
)
async def test_each_version_shows_only_the_fields_it_had(
    harness: Harness, version: str, extra: set[str]
) -> None:
    harness.sim.add_event(EventSpec(event_type=EventType.FREEZE, duration_in_seconds=5))
    (event,) = (await harness.document(version=version))["Events"]
    assert set(event) == BASE_FIELDS | extra


@pytest.mark.parametrize(
    ("event_type", "first_version"),
    [(EventType.PREEMPT, "2017-11-01"), (EventType.TERMINATE, "2019-01-01")],
)
async def test_newer_event_types_are_visible_only_from_their_version(
    harness: Harness, event_type: EventType, first_version: str
) -> None:
    harness.sim.add_event(EventSpec(event_type=event_type))
    for version in SCHEDULED_EVENTS_VERSIONS:
        events = (await harness.document(version=version))["Events"]
        assert len(events) == (1 if version >= first_version else 0), version


async def test_the_preview_version_prefixes_resource_names_with_an_underscore(
    harness: Harness,
) -> None:
    harness.sim.add_event(EventSpec(event_type=EventType.REBOOT, resources=("vm0", "vm1")))
    old = (await harness.document(version="2017-03-01"))["Events"][0]
    new = (await harness.document(version="2017-08-01"))["Events"][0]
    assert old["Resources"] == ["_vm0", "_vm1"]
    assert new["Resources"] == ["vm0", "vm1"]


async def test_the_document_has_the_documented_shape(harness: Harness) -> None:
    event = harness.sim.add_event(
        EventSpec(event_type=EventType.FREEZE, resources=("vm0", "vm1"), duration_in_seconds=5)
    )
    document = await harness.document()
    assert document["DocumentIncarnation"] == 2
    (shown,) = document["Events"]
    assert shown == {
        "EventId": event.event_id,
        "EventStatus": "Scheduled",
        "EventType": "Freeze",
        "ResourceType": "VirtualMachine",
        "Resources": ["vm0", "vm1"],
        "NotBefore": event.not_before,
        "Description": (
            "Virtual machine is being paused because of a memory-preserving Live Migration"
            " operation."
        ),
        "EventSource": "Platform",
        "DurationInSeconds": 5,
    }
    assert shown["EventId"] == shown["EventId"].upper()
    assert len(shown["EventId"]) == 36


async def test_the_first_vm_answers_with_and_without_a_prefix(harness: Harness) -> None:
    harness.sim.add_event(EventSpec(event_type=EventType.REBOOT, resources=("vm0",)))
    assert await harness.document(None) == await harness.document("vm0")
    assert (await harness.document("vm1"))["Events"] == []
    assert harness.server.vm_url("vm1") == f"{harness.server.base_url}/vm/vm1"


async def test_an_unknown_vm_is_404(harness: Harness) -> None:
    response = await harness.client.get("/vm/nope" + SE, headers=HEADERS)
    assert response.status_code == 404
    assert "nope" in response.json()["error"]


@pytest.mark.parametrize(
    ("method", "path"), [("PUT", SE), ("DELETE", SE), ("POST", INSTANCE), ("PATCH", INSTANCE)]
)
async def test_other_methods_are_405(harness: Harness, method: str, path: str) -> None:
    response = await harness.client.request(method, path, headers=HEADERS)
    assert response.status_code == 405
    assert "error" in response.json()


async def test_an_unknown_path_is_a_json_404(harness: Harness) -> None:
    response = await harness.client.get("/metadata/nothing", headers=HEADERS)
    assert response.status_code == 404
    assert "error" in response.json()


async def test_the_served_bytes_follow_every_change_and_version(harness: Harness) -> None:
    """The body is cached per VM and incarnation: it must never lag the document."""
    sim = harness.sim

    def compact(document: object) -> bytes:
        return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()

    for step in range(4):
        if step == 1:
            event = sim.add_event(EventSpec(event_type=EventType.PREEMPT, resources=("vm0",)))
        elif step == 2:
            sim.update_event(event.event_id, description="changed")
        elif step == 3:
            sim.start_event(event.event_id)
        for version in ("2017-08-01", "2020-07-01", "2017-08-01"):
            response = await harness.client.get(harness.se_path("vm0", version), headers=HEADERS)
            assert response.content == compact(sim.scheduled_events_document("vm0", version))
            assert response.content == sim.scheduled_events_body("vm0", version)
