"""One invalid event costs that event, not the document: the document keeps every valid event
and records each unreadable one (its EventId when that can be read, and why), bounded whatever
IMDS wrote into it. Only the document's own structure decides whether the answer is a document
at all."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import MAX_KEY_LENGTH, ScheduledEventsDocument, SchemaError

GOOD: dict[str, Any] = {
    "EventId": "C7061BAC-AFDC-4513-B24B-AA5F13A16123",
    "EventStatus": "Scheduled",
    "EventType": "Reboot",
    "ResourceType": "VirtualMachine",
    "Resources": ["web-7"],
    "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT",
    "Description": "Virtual machine is going to be restarted as requested by authorized user.",
    "EventSource": "User",
    "DurationInSeconds": 15,
}
NEIGHBOUR = dict(GOOD, EventId="9D2AB3C1-0000-4000-8000-000000000001", Resources=["web-8"])


def _without(field: str) -> dict[str, Any]:
    return {k: v for k, v in NEIGHBOUR.items() if k != field}


@pytest.mark.parametrize(
    ("item", "event_id", "named"),
    [
        (_without("EventType"), NEIGHBOUR["EventId"], "EventType"),
        (_without("EventStatus"), NEIGHBOUR["EventId"], "EventStatus"),
        (_without("EventId"), None, "EventId"),
        (dict(NEIGHBOUR, EventId=""), None, "EventId"),
        (dict(NEIGHBOUR, EventId="E" * (MAX_KEY_LENGTH + 1)), None, "EventId"),
        (dict(NEIGHBOUR, EventId=7), None, "EventId"),
        (dict(NEIGHBOUR, Resources="web-8"), NEIGHBOUR["EventId"], "Resources"),
        (dict(NEIGHBOUR, Resources=["web-8", 9]), NEIGHBOUR["EventId"], "Resources"),
        (dict(NEIGHBOUR, DurationInSeconds="soon"), NEIGHBOUR["EventId"], "DurationInSeconds"),
        (dict(NEIGHBOUR, DurationInSeconds=1.5), NEIGHBOUR["EventId"], "DurationInSeconds"),
        (dict(NEIGHBOUR, Description=["a", "list"]), NEIGHBOUR["EventId"], "Description"),
        ("an event", None, "not an object"),
        ([NEIGHBOUR], None, "not an object"),
        (None, None, "not an object"),
    ],
    ids=[
        "no-event-type",
        "no-event-status",
        "no-event-id",
        "empty-event-id",
        "event-id-too-long",
        "event-id-not-a-string",
        "resources-not-a-list",
        "resources-not-strings",
        "duration-text",
        "duration-fraction",
        "description-not-text",
        "a-string",
        "a-list",
        "null",
    ],
)
def test_an_invalid_event_costs_that_event_not_the_document(
    item: object, event_id: str | None, named: str
) -> None:
    """Before, any of these made the whole answer a SchemaError: the agent took it for an IMDS
    error, and the VM's own Reboot beside it was never seen."""
    raw = {"DocumentIncarnation": 4, "Events": [item, GOOD]}
    document = ScheduledEventsDocument.from_imds(raw)
    assert [e.event_id for e in document.events] == [GOOD["EventId"]]
    (unreadable,) = document.unreadable
    assert unreadable.event_id == event_id
    assert named in unreadable.reason
    assert document.unreadable_ids == (frozenset() if event_id is None else {event_id})
    assert document.unidentified == (event_id is None)


def test_what_is_kept_of_an_unreadable_event_is_bounded() -> None:
    """An item of megabytes keeps a few hundred characters at most: its id and a short reason,
    never the item; what is kept holds no character that could start a log line."""
    huge = dict(
        NEIGHBOUR,
        Description={"x" * 1000: ["y" * 100_000, "z\nfake log line"]},
        DurationInSeconds="\n" * 10_000,
    )
    document = ScheduledEventsDocument.from_imds({"DocumentIncarnation": 1, "Events": [huge]})
    (unreadable,) = document.unreadable
    assert len(unreadable.reason) <= 200
    assert unreadable.reason.isprintable()
    assert len(repr(unreadable)) < 600
    assert document.events == ()


def test_the_structure_still_decides_whether_the_answer_is_a_document() -> None:
    for raw in (
        [GOOD],
        {"Events": [GOOD]},
        {"DocumentIncarnation": "many", "Events": [GOOD]},
        {"DocumentIncarnation": -1, "Events": [GOOD]},
        {"DocumentIncarnation": 1, "Events": {"0": GOOD}},
        {"DocumentIncarnation": 1, "Events": "none"},
        {"DocumentIncarnation": 1},
    ):
        with pytest.raises(SchemaError):
            ScheduledEventsDocument.from_imds(raw)


def test_a_document_of_valid_events_records_nothing_unreadable_and_round_trips() -> None:
    raw = {"DocumentIncarnation": 2, "Events": [GOOD, NEIGHBOUR]}
    document = ScheduledEventsDocument.from_imds(raw)
    assert document.unreadable == ()
    assert not document.unidentified
    assert document.to_imds() == raw
    # What is stored (to_imds) holds only the valid events, and reads back as they were.
    mixed = ScheduledEventsDocument.from_imds(
        {"DocumentIncarnation": 2, "Events": [GOOD, _without("EventType")]}
    )
    assert mixed.to_imds() == {"DocumentIncarnation": 2, "Events": [GOOD]}


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)
_field_values = {
    "EventId": st.one_of(st.text(max_size=3), st.just("E" * 201), _json),
    "EventStatus": st.one_of(st.sampled_from(["Scheduled", "Started"]), _json),
    "EventType": st.one_of(st.sampled_from(["Freeze", "Reboot"]), _json),
    "Resources": st.one_of(st.lists(st.text(max_size=5), max_size=2), _json),
    "DurationInSeconds": st.one_of(st.integers(-1, 30), _json),
    "Description": st.one_of(st.text(max_size=5), _json),
    "NotBefore": st.one_of(st.text(max_size=5), _json),
}
_items = st.one_of(
    st.fixed_dictionaries({}, optional=_field_values),
    st.fixed_dictionaries(
        {"EventId": st.text(min_size=1, max_size=5), "EventStatus": st.just("Scheduled")},
        optional={
            "EventType": st.just("Freeze"),
            **{k: v for k, v in _field_values.items() if k not in ("EventId", "EventStatus")},
        },
    ),
    _json,
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_items, max_size=6))
def test_any_mix_of_items_is_a_document_that_accounts_for_every_item(items: list[Any]) -> None:
    """Whatever IMDS lists, a document with an Events list never raises: each item is a valid
    event or an unreadable one, and the document reads back from what is stored."""
    raw = json.loads(json.dumps({"DocumentIncarnation": 3, "Events": items}))
    document = ScheduledEventsDocument.from_imds(raw)
    assert len(document.events) + len(document.unreadable) == len(items)
    for unreadable in document.unreadable:
        assert unreadable.event_id is None or 1 <= len(unreadable.event_id) <= MAX_KEY_LENGTH
        assert len(unreadable.reason) <= 200
    assert ScheduledEventsDocument.from_imds(document.to_imds()).events == document.events
