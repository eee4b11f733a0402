"""Real lifecycle messages for the consumer tests, built with the contract's own builders."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from schemas import (
    AgentData,
    AgentMessage,
    ApprovalOutcomeData,
    ApprovalOutcomeMessage,
    HookResultData,
    HookResultMessage,
    MessageType,
    ReplyAddress,
    ScheduledEvent,
    Transition,
    TransitionKind,
    TransitionMessage,
    VmIdentity,
)

T0 = datetime(2025, 1, 6, 12, 0, tzinfo=UTC)
APPROVALS = "scheduled-events.vm-approvals"


def vm(
    name: str,
    *,
    scale_set: str | None = None,
    zone: str | None = None,
    fd: int | None = None,
    rg: str = "rg-web",
) -> VmIdentity:
    return VmIdentity(
        name=name,
        resource_group=rg,
        scale_set=scale_set,
        zone=zone,
        fault_domain=fd,
        subscription_id="sub-1",
    )


def event(
    event_id: str = "EVT-1",
    *,
    event_type: str = "Reboot",
    status: str = "Scheduled",
    resources: tuple[str, ...] = ("web-1",),
    source: str = "Platform",
    duration: int = -1,
    not_before: datetime | None = None,
) -> ScheduledEvent:
    nb = not_before if status == "Scheduled" else None
    if status == "Scheduled" and nb is None:
        nb = T0 + timedelta(minutes=15)
    return ScheduledEvent.from_imds(
        {
            "EventId": event_id,
            "EventStatus": status,
            "EventType": event_type,
            "ResourceType": "VirtualMachine",
            "Resources": list(resources),
            "NotBefore": "" if nb is None else nb.strftime("%a, %d %b %Y %H:%M:%S GMT"),
            "Description": "test",
            "EventSource": source,
            "DurationInSeconds": duration,
        }
    )


def transition(
    kind: str,
    ev: ScheduledEvent,
    identity: VmIdentity,
    *,
    at: datetime = T0,
    sequence: int = 0,
    approvals: str = APPROVALS,
) -> TransitionMessage:
    previous = {
        "scheduled": None,
        "started": "Scheduled",
        "updated": ev.event_status,
        "completed": "Started",
        "canceled": "Scheduled",
    }[kind]
    return TransitionMessage.build(
        Transition(TransitionKind(kind), ev, previous, 1),
        vm=identity,
        reply_to=ReplyAddress(channel=approvals, key=identity.name),
        observed_at=at,
        sequence=sequence,
    )


def heartbeat(
    identity: VmIdentity,
    *,
    at: datetime = T0,
    kind: MessageType = MessageType.AGENT_HEARTBEAT,
    approvals: str = APPROVALS,
    heartbeat_interval: float | None = None,
) -> AgentMessage:
    return AgentMessage.build(
        kind,
        AgentData(
            vm=identity,
            agent_version="0.1.0",
            reply_to=ReplyAddress(channel=approvals, key=identity.name),
            reason="SIGTERM" if kind is MessageType.AGENT_OFFLINE else None,
            heartbeat_interval=heartbeat_interval,
        ),
        observed_at=at,
        instance="run-1",
    )


def hook(
    identity: VmIdentity, ev: ScheduledEvent, *, exit_code: int = 0, at: datetime = T0
) -> HookResultMessage:
    return HookResultMessage.build(
        HookResultData(
            vm=identity,
            event=ev,
            transition="scheduled",
            hook="drain.sh",
            exit_code=exit_code,
            timed_out=False,
            duration_seconds=0.5,
            reply_to=ReplyAddress(channel=APPROVALS, key=identity.name),
        ),
        observed_at=at,
    )


def outcome(
    identity: VmIdentity,
    ev: ScheduledEvent,
    *,
    applied: bool = True,
    at: datetime = T0,
    approval_id: str = "A-1",
    reason: str = "bad-signature",
) -> ApprovalOutcomeMessage:
    return ApprovalOutcomeMessage.build(
        ApprovalOutcomeData(
            vm=identity,
            event_id=ev.event_id,
            approval_id=approval_id,
            decided_by="approver",
            applied=applied,
            reason=None if applied else reason,
            event=ev,
            reply_to=ReplyAddress(channel=APPROVALS, key=identity.name),
        ),
        observed_at=at,
    )
