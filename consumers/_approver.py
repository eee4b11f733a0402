"""The central approval service: reads the fleet stream as consumer group ``approver``, keeps a
fleet view, asks the policies about every event still Scheduled, and sends one signed approval
when they say so. Every decision is recorded with its reason (log, memory, and the audit
ledger when one is given).

It runs as one active consumer of its group (single-active-consumer on RabbitMQ): more
processes on the same group are hot standbys that take over, in order, when it dies. A message
is acked only after its decision was made and its approval confirmed by the broker, so a crash
loses no decision: the message comes back to the next active process.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from schemas import (
    ApprovalOutcomeMessage,
    LifecycleMessage,
    MessageType,
    RejectReason,
)
from schemas.transport import Transport

from ._approvals import ApprovalSender, NoApprovalTarget
from ._audit import Ledger
from ._fleet import EventPhase, EventState, FleetView
from ._policies import Action, PolicySet, Verdict
from ._stream import FleetStream

__all__ = ["ApproverService", "Decision"]

log = logging.getLogger(__name__)

#: Rejections that say "not on this VM": another VM of the event may still apply it.
_TRY_ANOTHER = frozenset(
    {
        RejectReason.OBSERVE_ONLY.value,
        RejectReason.NOT_FOR_THIS_VM.value,
        RejectReason.IMDS_REFUSED.value,
        RejectReason.EVENT_NOT_FOUND.value,
    }
)


@dataclass(frozen=True, slots=True)
class Decision:
    """What the approver decided about one event, and why."""

    event_id: str
    event_type: str
    action: Action
    reason: str
    policy: str
    at: datetime
    target: str | None = None


def _now() -> datetime:
    return datetime.now(UTC)


class ApproverService:
    """``await service.run()`` until ``service.stop()``; see the module docstring."""

    def __init__(
        self,
        transport: Transport,
        signing_key: Ed25519PrivateKey,
        policies: PolicySet | None = None,
        *,
        group: str = "approver",
        decided_by: str = "approver",
        ledger: Ledger | None = None,
        fleet: FleetView | None = None,
        exclusive: bool = True,
        on_decision: Callable[[Decision], None] | None = None,
        clock: Callable[[], datetime] = _now,
    ) -> None:
        self.policies = policies or PolicySet.default()
        self.fleet = fleet or FleetView(clock=clock)
        self.sender = ApprovalSender(
            transport, signing_key, fleet=self.fleet, decided_by=decided_by
        )
        self.decided_by = decided_by
        self.ledger = ledger
        self.clock = clock
        self.on_decision = on_decision
        self.decisions: deque[Decision] = deque(maxlen=10_000)
        self.stream = FleetStream(transport, group, exclusive=exclusive)
        self.stream.add_handler(self.handle)
        self._last: dict[str, tuple[Action, str]] = {}
        self._tried: dict[str, set[str]] = {}

    async def run(self) -> None:
        log.info("approver %s: reading group %s", self.decided_by, self.stream.group)
        await self.stream.run()

    def stop(self) -> None:
        self.stream.stop()

    async def handle(self, message: LifecycleMessage) -> None:
        state = self.fleet.apply(message)
        if isinstance(message, ApprovalOutcomeMessage) and state is not None:
            await self._outcome(message, state)
        if state is not None:
            await self.evaluate(state)
        if message.kind in (MessageType.STARTED, MessageType.COMPLETED, MessageType.CANCELED):
            # Capacity came back or went: events held by a guard may go now.
            for other in self.fleet.events(open_only=True):
                if other is not state:
                    await self.evaluate(other)
        self.fleet.prune()

    async def evaluate(self, state: EventState) -> None:
        """Decide about one event (only while it is Scheduled and not approved yet)."""
        if state.phase is not EventPhase.SCHEDULED or state.approved_or_sent:
            return
        verdict = self.policies.decide(state, self.fleet, self.clock())
        if verdict.action is not Action.APPROVE:
            await self._record(state, verdict)
            return
        tried = self._tried.setdefault(state.event_id, set())
        try:
            approval = await self.sender.approve(
                state.event_id, reason=verdict.reason, exclude=frozenset(tried)
            )
        except NoApprovalTarget as exc:
            await self._record(state, Verdict(Action.WAIT, str(exc), verdict.policy))
            return
        tried.add(approval.vm.casefold())
        state.approval_sent_at = self.clock()
        await self._record(state, verdict, target=approval.vm)

    async def _outcome(self, message: ApprovalOutcomeMessage, state: EventState) -> None:
        data = message.data
        if data.applied or data.decided_by != self.decided_by:
            return
        if data.reason in _TRY_ANOTHER and state.phase is EventPhase.SCHEDULED:
            log.warning(
                "approval of %s rejected by %s (%s): trying another VM",
                data.event_id,
                message.vm.name,
                data.reason,
            )
            self._tried.setdefault(state.event_id, set()).add(message.vm.name.casefold())
            state.approval_sent_at = None
            self._last.pop(state.event_id, None)

    async def _record(self, state: EventState, verdict: Verdict, target: str | None = None) -> None:
        key = (verdict.action, verdict.reason)
        if self._last.get(state.event_id) == key:
            return  # the same decision again: recorded once
        self._last[state.event_id] = key
        decision = Decision(
            event_id=state.event_id,
            event_type=state.event_type,
            action=verdict.action,
            reason=verdict.reason,
            policy=verdict.policy,
            at=self.clock(),
            target=target,
        )
        self.decisions.append(decision)
        log.info(
            "decision on %s (%s): %s by %s: %s%s",
            decision.event_id,
            decision.event_type,
            decision.action.value,
            decision.policy,
            decision.reason,
            f" -> {target}" if target else "",
        )
        if self.ledger is not None:
            await self.ledger.append_decision(
                state.event_id,
                verdict,
                decided_by=self.decided_by,
                target=target,
                event_type=state.event_type,
                at=decision.at,
            )
        if self.on_decision is not None:
            self.on_decision(decision)
