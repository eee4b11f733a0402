"""What the page shows, kept current: the fleet view, the latest decision per event, the holds,
and which rows changed since the last batch went out.

Rows are plain JSON-ready dicts, one per event and one per agent; the page joins them (an
event's VMs are shown with their agent's scale set, zone and liveness). A message changes the
row of its event and of its agent, nothing else: a batch carries only the rows that changed, and
the page updates only those.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from schemas import LifecycleMessage

from .._approver_state import Hold
from .._fleet import AgentState, EventPhase, EventState, FleetView, SentApproval

__all__ = ["CONSOLE_POLICY", "LatestDecision", "LiveFleet"]

#: The ``policy`` of what an operator did from the console (its decisions in the ledger).
CONSOLE_POLICY = "console"
#: Decisions about events the view does not know yet (the approver was faster than this
#: console's copy of the stream), kept until the event arrives; the oldest go first. Each is
#: kept once (by its ledger position: PostgreSQL's console reads the last ones again at every
#: poll), at most ``_EARLY_PER_EVENT`` an event (the latest: only the latest of each kind
#: shows).
_EARLY_DECISIONS = 5000
_EARLY_PER_EVENT = 16


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat()


@dataclass(frozen=True, slots=True)
class LatestDecision:
    """One row of ``ledger_decisions``, as the page shows it."""

    position: int
    at: datetime
    action: str
    reason: str
    policy: str
    decided_by: str
    event_version: str | None
    target: str | None
    approval_id: str | None

    @classmethod
    def from_row(cls, position: int, at: datetime, body: object) -> LatestDecision:
        data: dict[str, Any] = (
            body if isinstance(body, dict) else json.loads(str(body) if body else "{}")
        )
        return cls(
            position=position,
            at=at,
            action=str(data.get("action", "")),
            reason=str(data.get("reason", "")),
            policy=str(data.get("policy", "")),
            decided_by=str(data.get("decided_by", "")),
            event_version=data.get("event_version"),
            target=data.get("target"),
            approval_id=data.get("approval_id"),
        )

    @property
    def by_operator(self) -> bool:
        return self.policy == CONSOLE_POLICY

    def to_json(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "reason": self.reason,
            "policy": self.policy,
            "by": self.decided_by,
            "at": _iso(self.at),
            "version": self.event_version,
            "target": self.target,
        }


class LiveFleet:
    """The fleet view plus what the ledger and the holds add, with change tracking."""

    def __init__(self, fleet: FleetView | None = None) -> None:
        self.fleet = fleet or FleetView()
        #: The approver's latest decision per event, and the latest operator action.
        self.decisions: dict[str, LatestDecision] = {}
        self.actions: dict[str, LatestDecision] = {}
        #: The latest approval signed for each event (by the approver or an operator).
        self.approvals: dict[str, LatestDecision] = {}
        self.holds: dict[str, Hold] = {}
        self._early: OrderedDict[str, dict[int, LatestDecision]] = OrderedDict()
        self._changed_events: set[str] = set()
        self._changed_agents: set[str] = set()
        self._removed_events: set[str] = set()
        self._removed_agents: set[str] = set()

    # ------------------------------------------------------------------------------ changes

    def apply(self, message: LifecycleMessage) -> None:
        state = self.fleet.apply(message)
        # The view's record of where room was freed is the approver's; kept here, it grew with
        # every group and VM name messages gave, for the console's life.
        self.fleet.take_changes()
        if state is not None:
            self.changed_event(state.event_id)
            waiting = self._early.pop(state.event_id, {})
            for position in sorted(waiting):
                self.decided(state.event_id, waiting[position])
        self._changed_agents.add(message.vm.name.casefold())

    def changed_event(self, event_id: str) -> None:
        self._changed_events.add(event_id)
        self._removed_events.discard(event_id)

    def changed_all(self) -> None:
        """Every row again (after the fleet was loaded from the database)."""
        self._changed_events.update(s.event_id for s in self.fleet.events())
        self._changed_agents.update(a.name.casefold() for a in self.fleet.agents())

    def decided(self, event_id: str, decision: LatestDecision) -> bool:
        """Take a ledger decision into account; True when it changed what the page shows.
        One about an event the view does not know waits (bounded) for the event."""
        if self.fleet.event(event_id) is None:
            waiting = self._early.setdefault(event_id, {})
            waiting[decision.position] = decision
            if len(waiting) > _EARLY_PER_EVENT:
                del waiting[min(waiting)]
            self._early.move_to_end(event_id)
            while len(self._early) > _EARLY_DECISIONS:
                self._early.popitem(last=False)
            return False
        if decision.action == "approve" and decision.approval_id and decision.event_version:
            known = self.approvals.get(event_id)
            if known is None or known.position < decision.position:
                self.approvals[event_id] = decision
                state = self.fleet.event(event_id)
                if state is not None and (
                    state.sent is None or state.sent.approval_id != decision.approval_id
                ):
                    target = decision.target or ""
                    sent = SentApproval(
                        decision.approval_id, decision.event_version, target, decision.at
                    )
                    state.sent = sent
                    self.fleet.refresh(state)
        table = self.actions if decision.by_operator else self.decisions
        known = table.get(event_id)
        if known is not None and known.position >= decision.position:
            return False
        table[event_id] = decision
        self.changed_event(event_id)
        return True

    def set_holds(self, holds: dict[str, Hold]) -> None:
        for event_id in set(holds) ^ set(self.holds):
            self.changed_event(event_id)
        for event_id in set(holds) & set(self.holds):
            if holds[event_id] != self.holds[event_id]:
                self.changed_event(event_id)
        self.holds = holds

    def prune(self, now: datetime | None = None) -> None:
        before = {a.name.casefold() for a in self.fleet.agents()}
        for event_id in self.fleet.prune(now):
            self._changed_events.discard(event_id)
            self._removed_events.add(event_id)
            for table in (self.decisions, self.actions, self.approvals):
                table.pop(event_id, None)
        self.fleet.take_changes()  # the approver's record (see apply)
        after = {a.name.casefold() for a in self.fleet.agents()}
        self._removed_agents |= before - after
        self._changed_agents -= before - after

    def take_changes(self) -> dict[str, Any] | None:
        """The rows that changed since the last call (None when nothing did)."""
        if not (
            self._changed_events
            or self._changed_agents
            or self._removed_events
            or self._removed_agents
        ):
            return None
        events = [
            self.event_row(state)
            for event_id in sorted(self._changed_events)
            if (state := self.fleet.event(event_id)) is not None
        ]
        agents = [
            self.agent_row(agent)
            for key in sorted(self._changed_agents)
            if (agent := self.fleet.agent(key)) is not None
        ]
        batch = {
            "events": events,
            "agents": agents,
            "removed": sorted(self._removed_events),
            "removed_agents": sorted(self._removed_agents),
        }
        self._changed_events.clear()
        self._changed_agents.clear()
        self._removed_events.clear()
        self._removed_agents.clear()
        return batch

    # ---------------------------------------------------------------------------------- rows

    def snapshot(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Every event row and every agent row."""
        return (
            [self.event_row(state) for state in self.fleet.events()],
            [self.agent_row(agent) for agent in self.fleet.agents()],
        )

    def event_row(self, state: EventState) -> dict[str, Any]:
        event = state.event
        hold = self.holds.get(state.event_id)
        decision = self.decisions.get(state.event_id)
        action = self.actions.get(state.event_id)
        return {
            "id": state.event_id,
            "type": event.event_type,
            "status": event.event_status,
            "phase": state.phase.value,
            "open": not state.phase.is_over,
            "source": event.event_source,
            "description": event.description,
            "duration": event.duration_in_seconds,
            "not_before": _iso(event.not_before) if state.phase is EventPhase.SCHEDULED else None,
            "not_before_text": event.not_before_text,
            "resources": list(event.resources),
            "version": state.version,
            "first_seen": _iso(state.first_seen),
            "last_update": _iso(state.last_update),
            "vms": [self._vm_row(state, vm) for vm in _vms(state)],
            "silent": list(state.silent()),
            "decision": None if decision is None else decision.to_json(),
            "action": None if action is None else action.to_json(),
            "hold": None
            if hold is None
            else {"by": hold.held_by, "reason": hold.reason, "at": _iso(hold.at)},
            "approval": self._approval(state),
            "outcomes": [
                {
                    "vm": message.vm.name,
                    "applied": message.data.applied,
                    "reason": message.data.reason,
                    "detail": message.data.detail,
                    "by": message.data.decided_by,
                    "at": _iso(message.time),
                    "dry_run": message.data.dry_run,
                    "approval_id": message.data.approval_id,
                }
                for message in state.outcomes.values()
            ],
            "approved": state.approved,
        }

    def _approval(self, state: EventState) -> dict[str, Any] | None:
        sent = state.sent
        if sent is None:
            return None
        outcome = "sent"
        detail = ""
        for message in state.outcomes.values():
            if message.data.approval_id == sent.approval_id:
                outcome = "applied" if message.data.applied else "rejected"
                detail = message.data.reason or ""
        if outcome == "sent" and sent.event_version != state.version:
            outcome, detail = "void", "the event changed after it was signed"
        known = self.approvals.get(state.event_id)
        by = known.decided_by if known and known.approval_id == sent.approval_id else ""
        return {
            "id": sent.approval_id,
            "target": sent.target,
            "version": sent.event_version,
            "at": _iso(sent.at),
            "by": by,
            "outcome": outcome,
            "detail": detail,
        }

    @staticmethod
    def _vm_row(state: EventState, vm: str) -> dict[str, Any]:
        report = next(
            (r for name, r in state.reports.items() if name.casefold() == vm.casefold()), None
        )
        hooks = [
            {
                "name": result.data.hook,
                "transition": result.data.transition,
                "ok": result.data.succeeded,
                "outcome": result.data.outcome
                or ("timed out" if result.data.timed_out else f"exit {result.data.exit_code}"),
                "at": _iso(result.time),
            }
            for result in state.hooks.get(vm.casefold(), {}).values()
        ]
        return {
            "name": vm,
            "report": None if report is None else report.kind.value,
            "status": None if report is None else report.status,
            "at": None if report is None else _iso(report.at),
            "hooks": hooks,
        }

    def agent_row(self, agent: AgentState) -> dict[str, Any]:
        identity = agent.identity
        return {
            "key": agent.name.casefold(),
            "name": agent.name,
            "scale_set": identity.scale_set,
            "zone": identity.zone,
            "fault_domain": identity.fault_domain,
            "update_domain": identity.update_domain,
            "resource_group": identity.resource_group,
            "version": agent.agent_version,
            "online": agent.online,
            "offline_reason": agent.offline_reason,
            "last_seen": _iso(agent.last_seen),
            "last_heartbeat": _iso(agent.last_heartbeat),
            # Silent once not heard from for this long (the interval it declared, x2.5).
            "liveness": self.fleet.liveness_of(agent).total_seconds(),
        }


def _vms(state: EventState) -> Iterable[str]:
    """The event's Resources, then any VM that reported on it without being listed."""
    listed = {r.casefold() for r in state.resources}
    yield from state.resources
    yield from (name for name in state.reports if name.casefold() not in listed)
