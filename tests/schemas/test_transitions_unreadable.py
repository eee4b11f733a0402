"""The rule for an event IMDS lists but describes in a way that cannot be read: it is never
taken for gone. With its EventId readable and known before, it is held at its last readable
state (no transition, and the document the next answer is diffed against keeps that state); an
unreadable item without a readable EventId could be any event, so while one is listed no event
is taken for gone. New readable events and changes to readable ones are reported as usual."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import ScheduledEventsDocument, TransitionKind, diff, revisions_after
from schemas.transitions import kept_after


def _event(event_id: str, status: str = "Scheduled", **fields: Any) -> dict[str, Any]:
    event = {
        "EventId": event_id,
        "EventStatus": status,
        "EventType": "Reboot",
        "ResourceType": "VirtualMachine",
        "Resources": ["web-1"],
        "NotBefore": "" if status == "Started" else "Mon, 11 Apr 2022 22:26:58 GMT",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    }
    event.update(fields)
    return event


def _unreadable(event_id: str) -> dict[str, Any]:
    """``event_id`` listed without an EventType: not a valid event."""
    return {k: v for k, v in _event(event_id).items() if k != "EventType"}


#: An item whose EventId cannot be read: it could be any event.
NAMELESS: dict[str, Any] = {"EventStatus": "Scheduled", "EventType": "Freeze"}


def _doc(incarnation: int, *events: dict[str, Any]) -> ScheduledEventsDocument:
    return ScheduledEventsDocument.from_imds(
        {"DocumentIncarnation": incarnation, "Events": list(events)}
    )


class Agent:
    """What the agent does with each answer: diff against what it trusts, then trust
    :func:`kept_after`, with the revisions carried (``publisher/_watch.py``)."""

    def __init__(self) -> None:
        self.trusted: ScheduledEventsDocument | None = None
        self.revisions: dict[str, int] = {}

    def take(self, document: ScheduledEventsDocument) -> list[str]:
        transitions = diff(self.trusted, document, self.revisions)
        kept = kept_after(self.trusted, document)
        self.revisions = revisions_after(self.revisions, transitions, kept)
        self.trusted = kept
        return [f"{t.kind.value}:{t.event.event_id}/{t.revision}" for t in transitions]


def test_an_event_unreadable_for_a_while_is_held_and_never_reported_gone_or_new_again() -> None:
    agent = Agent()
    assert agent.take(_doc(1, _event("A"))) == ["scheduled:A/0"]
    # A turns unreadable for a few answers: nothing. Before, each was no document at all.
    assert agent.take(_doc(2, _unreadable("A"))) == []
    assert agent.take(_doc(3, _unreadable("A"), _event("B"))) == ["scheduled:B/0"]
    assert agent.take(_doc(4, _unreadable("A"), _event("B"))) == []
    # Held at its last readable state: the trusted document still shows it so.
    assert agent.trusted is not None
    held = agent.trusted.event("A")
    assert held is not None
    assert held.event_type == "Reboot"
    # Readable again as it was: no second scheduled; as it then changed: one started.
    assert agent.take(_doc(5, _event("A"), _event("B"))) == []
    assert agent.take(_doc(6, _event("A", "Started"), _event("B"))) == ["started:A/1"]
    assert agent.take(_doc(7, _event("B"))) == ["completed:A/2"]


def test_a_change_seen_after_an_unreadable_spell_is_reported_against_the_last_readable_state() -> (
    None
):
    agent = Agent()
    agent.take(_doc(1, _event("A")))
    agent.take(_doc(2, _unreadable("A")))
    assert agent.take(_doc(3, _event("A", "Started"))) == ["started:A/1"]


def test_an_event_that_is_unreadable_from_its_first_answer_is_not_announced_until_readable() -> (
    None
):
    agent = Agent()
    assert agent.take(_doc(1, _unreadable("A"))) == []
    assert agent.take(_doc(2, _event("A"))) == ["scheduled:A/0"]


def test_a_nameless_unreadable_item_holds_back_every_disappearance_until_it_is_gone() -> None:
    agent = Agent()
    assert agent.take(_doc(1, _event("A"), _event("B", "Started"))) == [
        "scheduled:A/0",
        "started:B/0",
    ]
    # A and B are gone from the readable events, but the nameless item could be either.
    assert agent.take(_doc(2, NAMELESS)) == []
    # New readable events and changes are reported all the same.
    assert agent.take(_doc(3, NAMELESS, _event("C"), _event("B", "Started", Resources=["x"]))) == [
        "scheduled:C/0",
        "updated:B/1",
    ]
    assert agent.take(_doc(4, NAMELESS, _event("C"))) == []
    # The nameless item is gone: what went while it was listed is reported, once.
    assert sorted(agent.take(_doc(5, _event("C")))) == ["canceled:A/1", "completed:B/2"]
    assert agent.take(_doc(6, _event("C"))) == []


def test_an_unreadable_event_with_its_id_holds_only_itself() -> None:
    agent = Agent()
    agent.take(_doc(1, _event("A"), _event("B")))
    assert agent.take(_doc(2, _unreadable("A"))) == ["canceled:B/1"]


def test_diff_alone_never_reports_an_unreadable_event_gone() -> None:
    """Whoever calls diff (not only the agent) gets the rule."""
    previous = _doc(1, _event("A"), _event("B"))
    assert diff(previous, _doc(2, _unreadable("A"), _event("B"))) == []
    assert diff(previous, _doc(2, NAMELESS)) == []
    assert [t.kind for t in diff(previous, _doc(2, _event("B")))] == [TransitionKind.CANCELED]


# ------------------------------------------------------------------------------ properties

_IDS = ["A", "B", "C"]
#: Each event in one answer: absent, readable (Scheduled or Started), or unreadable.
_state = st.sampled_from([None, "Scheduled", "Started", "unreadable"])
_answers = st.lists(
    st.tuples(st.fixed_dictionaries({i: _state for i in _IDS}), st.booleans()),
    min_size=1,
    max_size=14,
)


@settings(max_examples=400, deadline=None)
@given(_answers)
def test_no_valid_event_still_listed_is_reported_gone_and_each_end_is_reported_once(
    answers: list[tuple[dict[str, str | None], bool]],
) -> None:
    """Over any sequence of answers mixing valid, unreadable and nameless items: nothing raises;
    an event still listed (readable or not) is never reported gone, nor anything while a
    nameless item is listed; an event is announced only when it is not already open; and once
    IMDS answers a clean empty list, every open event has been reported ended exactly once."""
    agent = Agent()
    open_events: set[str] = set()
    for incarnation, (states, nameless) in enumerate(answers, start=1):
        items = [
            _unreadable(event_id) if state == "unreadable" else _event(event_id, state)
            for event_id, state in states.items()
            if state is not None
        ]
        if nameless:
            items.insert(incarnation % (len(items) + 1), NAMELESS)
        document = _doc(incarnation, *items)
        transitions = diff(agent.trusted, document, agent.revisions)
        listed = {event_id for event_id, state in states.items() if state is not None}
        for t in transitions:
            event_id = t.event.event_id
            if t.kind.is_terminal:
                assert event_id not in listed
                assert not nameless
                assert event_id in open_events
                open_events.discard(event_id)
            elif t.previous_status is None:
                assert event_id not in open_events
                assert states[event_id] not in (None, "unreadable")
                open_events.add(event_id)
            else:
                assert event_id in open_events
        agent.take(document)
    ended = [t for t in diff(agent.trusted, _doc(len(answers) + 1)) if t.kind.is_terminal]
    assert sorted(t.event.event_id for t in ended) == sorted(open_events)
