"""The operator's terminal: `tail`, `audit history` and the approve command print fields a VM
chose (Resources, NotBefore as sent, hook name, rejection detail, decided_by, previous_status),
and the ledger's decisions. A control character among them must reach the screen as text: a
newline would forge whole lines (a fake "approval.applied" of another VM), an escape sequence
would erase lines, move the cursor or retitle the window."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from consumers._audit import LedgerEntry
from consumers._cli import _json_line, _print_outcome
from consumers._timeline import entry_line, message_line
from schemas import ApprovalOutcomeMessage, decode

from ._factory import T0, event, hook, outcome, transition, vm

FAKE = (
    "\n2025-01-06 12:00:01  web-2          approval.applied  Reboot    EVT-9  "
    "approval by approver applied"
)
#: C0 (newline, carriage return, escape, backspace), DEL, C1 (CSI, NEL), a bidi override and
#: a line separator: none is printable.
HOSTILE = ["\n", "\r", "\x1b[2K\x1b[1A", "\x08", "\x7f", "\x9b2K", "\x85", "\u202e", "\u2028"]


def _sent(message, change) -> str:
    """``message`` as a VM could send it, ``change`` applied to its JSON."""
    body = json.loads(message.to_bytes())
    change(body)
    return message_line(decode(json.dumps(body).encode()))


def _unprintable(text: str) -> list[str]:
    return [c for c in text if not c.isprintable()]


def test_a_hook_name_cannot_forge_a_line():
    line = _sent(hook(vm("web-1"), event()), lambda b: b["data"].update(hook="drain.sh" + FAKE))
    assert "\n" not in line, line
    assert "drain.sh\\n2025-01-06" in line  # shown, as text


@pytest.mark.parametrize("hostile", HOSTILE)
def test_no_field_a_vm_sends_reaches_the_terminal_as_a_control_character(hostile):
    ev = event(resources=("web-1",))
    lines = [
        message_line(transition("scheduled", event(resources=(f"web-1{hostile}",)), vm("web-1"))),
        _sent(hook(vm("web-1"), ev), lambda b: b["data"].update(hook=f"drain{hostile}.sh")),
        _sent(
            transition("started", ev, vm("web-1")),
            lambda b: b["data"].update(previous_status=f"Scheduled{hostile}"),
        ),
        _sent(
            outcome(vm("web-1"), ev, applied=False),
            lambda b: b["data"].update(detail=f"nope{hostile}", decided_by=f"me{hostile}"),
        ),
        _sent(
            transition("scheduled", ev, vm("web-1")),
            lambda b: b["data"]["event"].update(NotBefore=f"soon{hostile}"),
        ),
    ]
    for line in lines:
        assert _unprintable(line) == [], repr(line)


@pytest.mark.parametrize("hostile", HOSTILE)
def test_a_ledger_entry_reaches_the_terminal_as_text(hostile):
    """`audit history` prints the ledger: what it holds came from the VMs (messages) or from
    anyone with INSERT on it (decisions)."""
    decision = LedgerEntry(
        record="decision",
        time=T0,
        kind=f"decision.wait{hostile}",
        vm=f"approver{hostile}",
        event_id=f"EVT-1{hostile}",
        event_type=f"Reboot{hostile}",
        sequence=0,
        message_id="d-1",
        body={"reason": f"why{hostile}", "policy": f"p{hostile}", "target": f"web{hostile}"},
    )
    assert _unprintable(entry_line(decision)) == [], repr(entry_line(decision))


def test_printable_text_is_shown_as_it_is():
    line = message_line(transition("scheduled", event(resources=("wéb-1", "web-2")), vm("web-1")))
    assert "Resources wéb-1, web-2" in line


def test_an_outcome_the_approve_command_prints_reaches_the_terminal_as_text(capsys):
    """`approve` waits for the agent's answer and prints who rejected it and why."""
    ev = event(resources=("web-1",))
    body = json.loads(outcome(vm("web-1"), ev, applied=False, at=datetime.now(UTC)).to_bytes())
    body["data"]["detail"] = "bad" + FAKE + "\x1b]0;owned\x07"
    message = decode(json.dumps(body).encode())
    assert isinstance(message, ApprovalOutcomeMessage)
    assert _print_outcome(message) == 1
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1, printed
    assert _unprintable(printed.rstrip("\n")) == [], repr(printed)


@pytest.mark.parametrize("hostile", HOSTILE)
def test_tail_json_is_the_same_json_with_nothing_a_terminal_acts_on(hostile):
    """`tail --json` prints the message's JSON: JSON escapes C0 controls but leaves C1
    controls, DEL and bidi overrides in a string as they are."""
    message = transition("scheduled", event(resources=(f"wéb-1{hostile}",)), vm("web-1"))
    line = _json_line(message)
    assert _unprintable(line) == [], repr(line)
    assert line.isascii()
    assert json.loads(line) == json.loads(message.to_bytes())


@pytest.mark.parametrize(
    "body",
    [
        {"data": "not an object"},
        {"data": {"event": "not an object"}},
        {"data": {"event": {"Resources": [1, None, "web-1"], "EventStatus": ["x"]}}},
        {"data": {"event": {"Resources": "web-1"}}},
        {"data": None},
        {},
    ],
)
def test_a_ledger_message_of_an_unexpected_shape_still_prints_a_line(body):
    """The ledger is read back as stored (anyone with INSERT on it can add a row): a body
    whose parts are not what a message has prints what it has; before, `audit history`
    stopped at it with AttributeError or TypeError."""
    entry = LedgerEntry(
        record="message",
        time=T0,
        kind="scheduled",
        vm="web-1",
        event_id="EVT-1",
        event_type="Reboot",
        sequence=1,
        message_id="m-1",
        body=body,
    )
    assert entry_line(entry).startswith("2025-01-06 12:00:00  web-1")


def test_a_time_before_the_year_1000_keeps_the_columns():
    message = transition(
        "scheduled", event(), vm("web-1"), at=datetime(1, 2, 3, 4, 5, 6, tzinfo=UTC)
    )
    assert message_line(message).startswith("0001-02-03 04:05:06  web-1 ")
