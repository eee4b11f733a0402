"""Transitions are one pure function of (previous document, new document)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import (
    ReplyAddress,
    ScheduledEventsDocument,
    TransitionKind,
    TransitionMessage,
    VmIdentity,
    diff,
    revisions_after,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "imds"


def _event(event_id: str, status: str = "Scheduled", **fields: Any) -> dict[str, Any]:
    event = {
        "EventId": event_id,
        "EventStatus": status,
        "EventType": "Reboot",
        "ResourceType": "VirtualMachine",
        "Resources": ["web-1"],
        "NotBefore": "" if status == "Started" else "Mon, 11 Apr 2022 22:26:58 GMT",
        "Description": "",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    }
    event.update(fields)
    return event


def _doc(incarnation: int, *events: dict[str, Any]) -> ScheduledEventsDocument:
    return ScheduledEventsDocument.from_imds(
        {"DocumentIncarnation": incarnation, "Events": list(events)}
    )


def _kinds(previous: ScheduledEventsDocument | None, current: ScheduledEventsDocument) -> list[str]:
    return [f"{t.kind.value}:{t.event.event_id}" for t in diff(previous, current)]


def test_the_documents_live_migration_gives_scheduled_started_completed() -> None:
    documents = [
        ScheduledEventsDocument.from_imds(raw)
        for raw in json.loads((FIXTURES / "westno-live-migration.json").read_text())
    ]
    seen: list[tuple[str, str | None, int]] = []
    previous = None
    for document in documents:
        for transition in diff(previous, document):
            seen.append((transition.kind.value, transition.previous_status, transition.incarnation))
        previous = document
    assert seen == [
        ("scheduled", None, 2),
        ("started", "Scheduled", 3),
        ("completed", "Started", 4),
    ]


def test_a_new_started_event_is_started_hardware_failure_skips_scheduled() -> None:
    assert _kinds(_doc(1), _doc(2, _event("hw", "Started"))) == ["started:hw"]


def test_an_event_gone_while_scheduled_is_canceled() -> None:
    assert _kinds(_doc(2, _event("r")), _doc(3)) == ["canceled:r"]


def test_an_event_gone_after_started_is_completed_and_carries_the_last_version() -> None:
    transitions = diff(_doc(2, _event("r", "Started")), _doc(3))
    assert [t.kind for t in transitions] == [TransitionKind.COMPLETED]
    assert transitions[0].event.is_started


def test_each_compared_field_change_is_an_update() -> None:
    before = _doc(2, _event("r"))
    for changed in (
        {"NotBefore": "Mon, 11 Apr 2022 22:41:58 GMT"},
        {"Resources": ["web-1", "web-2"]},
        {"Description": "now with words"},
        {"DurationInSeconds": 10},
        {"EventType": "Redeploy"},
    ):
        assert _kinds(before, _doc(3, _event("r", **changed))) == ["updated:r"], changed


def test_the_same_events_under_a_new_incarnation_give_nothing() -> None:
    assert _kinds(_doc(2, _event("r")), _doc(3, _event("r"))) == []
    assert _kinds(_doc(2, _event("r")), _doc(2, _event("r"))) == []


def test_the_first_document_reports_every_event_it_holds() -> None:
    assert _kinds(None, _doc(5, _event("a"), _event("b", "Started"))) == [
        "scheduled:a",
        "started:b",
    ]


# ------------------------------------------------------------------------------ properties

_IDS = ["A", "B", "C", "D"]
_event_state = st.one_of(
    st.none(),
    st.builds(
        lambda status, minutes, duration: {
            "status": status,
            "minutes": minutes,
            "duration": duration,
        },
        st.sampled_from(["Scheduled", "Started"]),
        st.integers(0, 2),
        st.sampled_from([-1, 5]),
    ),
)
_documents = st.lists(
    st.fixed_dictionaries({i: _event_state for i in _IDS}), min_size=1, max_size=12
)


def _build(states: list[dict[str, Any]]) -> list[ScheduledEventsDocument]:
    documents = []
    for incarnation, state in enumerate(states, start=1):
        events = [
            _event(
                event_id,
                value["status"],
                NotBefore=""
                if value["status"] == "Started"
                else f"Mon, 11 Apr 2022 22:2{value['minutes']}:00 GMT",
                DurationInSeconds=value["duration"],
            )
            for event_id, value in state.items()
            if value is not None
        ]
        documents.append(_doc(incarnation, *events))
    return documents


@settings(max_examples=300, deadline=None)
@given(_documents)
def test_every_event_that_appears_gets_exactly_one_terminal_transition_when_it_disappears(
    states: list[dict[str, Any]],
) -> None:
    documents = _build(states)
    previous = None
    alive: set[str] = set()
    for document in documents:
        transitions = diff(previous, document)
        terminal = {t.event.event_id for t in transitions if t.kind.is_terminal}
        present = {e.event_id for e in document.events}
        assert terminal == alive - present
        for transition in transitions:
            if transition.kind.is_terminal:
                assert transition.previous_status == transition.event.event_status
        alive = present
        previous = document


@settings(max_examples=300, deadline=None)
@given(_documents)
def test_no_transition_without_a_change_and_replay_emits_nothing(
    states: list[dict[str, Any]],
) -> None:
    previous = None
    for document in _build(states):
        transitions = diff(previous, document)
        if previous is not None and [e.to_imds() for e in previous.events] == [
            e.to_imds() for e in document.events
        ]:
            assert transitions == []
        assert diff(document, document) == []
        # a transition exists exactly for each event whose state differs from before
        before: dict[str, object] = (
            {} if previous is None else {e.event_id: e.to_imds() for e in previous.events}
        )
        after = {e.event_id: e.to_imds() for e in document.events}
        changed = {i for i in before.keys() | after.keys() if before.get(i) != after.get(i)}
        assert {t.event.event_id for t in transitions} == changed
        previous = document


def _ids(documents: list[ScheduledEventsDocument], vm: str = "web-1") -> list[tuple[str, str]]:
    """(id, what happened) of every transition message an agent on ``vm`` would publish."""
    identity = VmIdentity(name=vm)
    reply = ReplyAddress(channel="approvals", key=vm)
    previous: ScheduledEventsDocument | None = None
    revisions: dict[str, int] = {}
    out = []
    for document in documents:
        transitions = diff(previous, document, revisions)
        for t in transitions:
            message = TransitionMessage.build(
                t, vm=identity, reply_to=reply, observed_at=datetime.now(UTC)
            )
            out.append((message.id, f"{t.event.event_id}/{t.kind.value}/{t.revision}"))
        revisions = revisions_after(revisions, transitions, document)
        previous = document
    return out


@settings(max_examples=300, deadline=None)
@given(_documents)
def test_two_messages_share_an_id_exactly_when_they_are_the_same_transition(
    states: list[dict[str, Any]],
) -> None:
    """Over random document sequences: every transition an agent reports has an id of its own
    (updates back to earlier content included); computing them again from the same documents
    (a replay after a crash) gives the same ids; another VM never shares one."""
    documents = _build(states)
    first = _ids(documents)
    assert len({i for i, _ in first}) == len(first)
    assert len({what for _, what in first}) == len(first)
    assert _ids(documents) == first
    assert not {i for i, _ in first} & {i for i, _ in _ids(documents, "web-2")}


def test_an_event_that_comes_back_continues_its_revisions() -> None:
    a = _event("A", "Scheduled", NotBefore="Mon, 11 Apr 2022 22:20:00 GMT")
    docs = [_doc(1, a), _doc(2), _doc(3, a), _doc(4)]
    kinds = [what for _, what in _ids(docs)]
    assert kinds == ["A/scheduled/0", "A/canceled/1", "A/scheduled/2", "A/canceled/3"]
