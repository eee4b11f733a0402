"""One readable line per happening, for ``tail``, ``audit history`` and the demo's timeline."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from schemas import LifecycleMessage

from ._audit import LedgerEntry

__all__ = ["describe", "entry_line", "message_line"]


def _clock(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _event_text(event: dict[str, Any]) -> str:
    parts = []
    status = event.get("EventStatus")
    if status:
        parts.append(status)
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
        parts.append(f"Resources {', '.join(resources)}")
    return ", ".join(parts)


def describe(kind: str, data: dict[str, Any]) -> str:
    """What a message (its CloudEvent ``data``) or a decision says, in words."""
    if kind.startswith("decision."):
        target = f" -> {data['target']}" if data.get("target") else ""
        return f"{data.get('reason', '')} [{data.get('policy', '')}]{target}"
    if kind in ("scheduled", "started", "updated", "completed", "canceled"):
        event = data.get("event", {})
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
    about = f"{event_type or '':<9} {event_id or '':<38}" if event_id else f"{'':<48}"
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
    data = entry.body.get("data", {}) if entry.record == "message" else entry.body
    return _line(
        entry.time,
        entry.vm,
        entry.kind,
        entry.event_type,
        entry.event_id,
        describe(entry.kind, data),
    )
