"""One readable line per happening, for ``tail``, ``audit history`` and the demo's timeline.

Most of a line is what a VM sent (its name, Resources, NotBefore as sent, a hook's name, a
rejection's detail) or what the ledger holds: every field is printed through :func:`printable`,
so a control character reaches the operator's terminal as text (``\\n``, ``\\x1b``), never as
a forged line or an escape sequence.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from schemas import LifecycleMessage

from ._audit import LedgerEntry

__all__ = ["describe", "entry_line", "message_line", "printable"]


def _escaped(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(value: object) -> str:
    """``value`` as text safe to print on a terminal: each character that is not printable
    (C0 and C1 controls, DEL, line and paragraph separators, bidi overrides and other format
    characters) as its Python escape (``\\n``, ``\\x1b``, ``\\u202e``). Printable text,
    accents and other scripts included, is kept as it is."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _ESCAPES.get(c) or _escaped(c) for c in text)


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _clock(moment: datetime) -> str:
    # isoformat pads the year to four digits (strftime's %Y does not on glibc: "1-01-01").
    return moment.astimezone(UTC).replace(tzinfo=None).isoformat(" ", "seconds")


def _fields(value: object) -> dict[str, Any]:
    """``value`` when it is a JSON object, else none: the ledger is read back as stored, and a
    row of an unexpected shape prints what it has instead of stopping the history."""
    return value if isinstance(value, dict) else {}


def _event_text(event: dict[str, Any]) -> str:
    parts = []
    status = event.get("EventStatus")
    if status:
        parts.append(str(status))
    not_before = event.get("NotBefore")
    if not_before:
        parts.append(f"NotBefore {not_before}")
    duration = event.get("DurationInSeconds")
    if isinstance(duration, int) and duration >= 0:
        parts.append(f"{duration}s")
    source = event.get("EventSource")
    if source:
        parts.append(f"by {source}")
    resources = event.get("Resources") or []
    if resources:
        names = resources if isinstance(resources, list) else [resources]
        parts.append(f"Resources {', '.join(str(name) for name in names)}")
    return ", ".join(parts)


def describe(kind: str, data: dict[str, Any]) -> str:
    """What a message (its CloudEvent ``data``) or a decision says, in words."""
    data = _fields(data)
    if kind.startswith("decision."):
        target = f" -> {data['target']}" if data.get("target") else ""
        return f"{data.get('reason', '')} [{data.get('policy', '')}]{target}"
    if kind in ("scheduled", "started", "updated", "completed", "canceled"):
        event = _fields(data.get("event"))
        previous = data.get("previous_status")
        moved = f"{previous} -> " if previous and kind != "updated" else ""
        if kind in ("completed", "canceled"):
            return f"{moved}gone; last seen: {_event_text(event)}"
        return f"{moved}{_event_text(event)}"
    if kind == "approval.applied":
        dry = " (dry run)" if data.get("dry_run") else ""
        return f"approval by {data.get('decided_by')} applied{dry}"
    if kind == "approval.rejected":
        return (
            f"approval by {data.get('decided_by')} rejected: {data.get('reason')} "
            f"{data.get('detail', '')}"
        ).rstrip()
    if kind == "hook.completed":
        result = "timed out" if data.get("timed_out") else f"exit {data.get('exit_code')}"
        return f"hook {data.get('hook')} on {data.get('transition')}: {result}"
    if kind == "agent.online":
        return f"agent {data.get('agent_version', '')} online"
    if kind == "agent.heartbeat":
        return f"heartbeat, outbox {data.get('outbox_depth', 0)}"
    if kind == "agent.offline":
        return f"agent offline ({data.get('reason') or 'no reason given'})"
    return ""


def _line(
    moment: datetime, who: str, kind: str, event_type: str | None, event_id: str | None, text: str
) -> str:
    who, kind, text = printable(who), printable(kind), printable(text)
    about = (
        f"{printable(event_type or ''):<9} {printable(event_id):<38}" if event_id else f"{'':<48}"
    )
    return f"{_clock(moment)}  {who:<14} {kind:<18} {about} {text}".rstrip()


def message_line(message: LifecycleMessage) -> str:
    data = json.loads(message.to_bytes())["data"]
    return _line(
        message.time,
        message.vm.name,
        message.kind.value,
        message.event_type,
        message.subject,
        describe(message.kind.value, data),
    )


def entry_line(entry: LedgerEntry) -> str:
    body = _fields(entry.body)
    data = _fields(body.get("data")) if entry.record == "message" else body
    return _line(
        entry.time,
        entry.vm,
        entry.kind,
        entry.event_type,
        entry.event_id,
        describe(entry.kind, data),
    )
