"""The IMDS models: every API version parses, absent fields mean what the documents say, unknown
values survive, and the wire shape comes back exactly."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from schemas import (
    API_VERSIONS,
    ScheduledEvent,
    ScheduledEventsDocument,
    SchemaError,
    event_version,
)
from schemas.imds import format_not_before, parse_not_before

FIXTURES = Path(__file__).parent.parent / "fixtures" / "imds"


@pytest.mark.parametrize("version", API_VERSIONS)
def test_every_api_version_parses_and_serialises_back_exactly(version: str) -> None:
    raw = json.loads((FIXTURES / f"{version}.json").read_text())
    document = ScheduledEventsDocument.from_imds(raw)
    assert document.document_incarnation == 3
    assert document.to_imds() == raw


def test_fields_a_version_did_not_have_take_their_documented_meaning() -> None:
    raw = json.loads((FIXTURES / "2017-11-01.json").read_text())
    event = ScheduledEventsDocument.from_imds(raw).events[0]
    assert event.duration_in_seconds == -1
    assert event.description is None
    assert event.event_source is None
    assert "DurationInSeconds" not in event.to_imds()


def test_not_before_is_rfc1123_to_an_aware_datetime_and_empty_to_none() -> None:
    assert parse_not_before("Mon, 11 Apr 2022 22:26:58 GMT") == datetime(
        2022, 4, 11, 22, 26, 58, tzinfo=UTC
    )
    assert parse_not_before("") is None
    assert format_not_before(datetime(2022, 4, 11, 22, 26, 58, tzinfo=UTC)) == (
        "Mon, 11 Apr 2022 22:26:58 GMT"
    )
    assert format_not_before(None) == ""


def test_a_not_before_with_no_utc_equivalent_is_kept_as_text_not_an_error() -> None:
    """A date at the calendar's edge in another zone parses, but has no UTC equivalent: it is
    kept as sent and not a date, like any other NotBefore that is not one, and the event still
    has a version (an OverflowError there let a report's content be judged under the version of
    the content before it)."""
    text = "Fri, 31 Dec 9999 23:00:00 -0500"
    event = ScheduledEvent.from_imds(
        {"EventId": "E", "EventStatus": "Scheduled", "EventType": "Reboot", "NotBefore": text}
    )
    assert event.not_before is None
    assert not event.not_before_valid
    assert event.not_before_text == text
    assert event_version(event) != event_version(event.model_copy(update={"not_before_text": ""}))


def test_a_started_event_serialises_an_empty_not_before() -> None:
    sequence = json.loads((FIXTURES / "westno-live-migration.json").read_text())
    started = ScheduledEventsDocument.from_imds(sequence[2])
    assert started.events[0].not_before is None
    assert started.to_imds() == sequence[2]


def test_unknown_future_values_and_fields_are_kept() -> None:
    raw = {
        "DocumentIncarnation": 9,
        "Events": [
            {
                "EventId": "X-1",
                "EventStatus": "Paused",
                "EventType": "Hibernate",
                "ResourceType": "VirtualMachine",
                "Resources": ["web-1"],
                "NotBefore": "",
                "EventSource": "Customer",
                "DurationInSeconds": 30,
                "Impact": {"Network": True},
            }
        ],
        "Etag": "abc",
    }
    document = ScheduledEventsDocument.from_imds(raw)
    event = document.events[0]
    assert (event.event_status, event.event_type, event.event_source) == (
        "Paused",
        "Hibernate",
        "Customer",
    )
    assert document.to_imds() == raw


@pytest.mark.parametrize(
    "raw",
    [
        {},
        {"DocumentIncarnation": "many", "Events": []},
        {"DocumentIncarnation": 1, "Events": {"EventStatus": "Scheduled"}},
        [],
    ],
    ids=["empty", "bad-incarnation", "events-not-a-list", "not-an-object"],
)
def test_what_is_not_a_document_is_a_schema_error(raw: object) -> None:
    """(An invalid event in a valid document costs that event only: test_imds_unreadable.py.)"""
    with pytest.raises(SchemaError):
        ScheduledEventsDocument.from_imds(raw)


def test_garbage_bytes_are_a_schema_error_and_also_a_value_error() -> None:
    with pytest.raises(ValueError, match="not JSON"):
        ScheduledEventsDocument.from_json(b"<html>gateway timeout</html>")


def test_resources_match_case_insensitively() -> None:
    event = ScheduledEvent.from_imds(
        {
            "EventId": "e",
            "EventStatus": "Scheduled",
            "EventType": "Freeze",
            "Resources": ["WestNO_0"],
        }
    )
    assert event.affects("westno_0")
    assert not event.affects("WestNO_1")


def test_one_malformed_not_before_keeps_every_event_and_the_raw_value() -> None:
    """One bad field must not blind the agent to the other events: the event keeps what IMDS
    sent, says it is not a date, and goes back on the wire unchanged."""
    good = {
        "EventId": "good",
        "EventStatus": "Scheduled",
        "EventType": "Freeze",
        "Resources": ["web-1"],
        "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT",
    }
    raw = {
        "DocumentIncarnation": 1,
        "Events": [good, {**good, "EventId": "bad", "NotBefore": "soon"}],
    }
    document = ScheduledEventsDocument.from_imds(raw)
    ok, bad = document.events
    assert ok.not_before_valid
    assert ok.not_before is not None
    assert not bad.not_before_valid
    assert bad.not_before is None
    assert bad.not_before_text == "soon"
    assert document.to_imds()["Events"][1]["NotBefore"] == "soon"
