"""Approvals in: verify each one, POST ``StartRequests``, report the outcome, then ack.

An approval is applied only when all of these hold, checked in this order, each failure with its
own reason in ``approval.rejected``: the agent is not observe-only (a trusted key, or
``--accept-unsigned-approvals``); the signature is good and from a trusted key; it has not
expired; it names this VM; the event is in the document IMDS returns now, lists this VM, and is
still Scheduled. ``--dry-run`` verifies and reports (``approval.applied`` with ``dry_run``) but
never POSTs. The delivery is acked only after the outcome is in the durable outbox; an approval
seen again (redelivered after a crash) is acked without being applied twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from schemas import (
    Approval,
    ApprovalOutcomeData,
    ApprovalOutcomeMessage,
    ApprovalRejected,
    ImdsError,
    RejectReason,
    ReplyAddress,
    ScheduledEvent,
    SchemaError,
    VmIdentity,
    verify,
)
from schemas.transport import Delivery

from ._backoff import Backoff
from ._imds import ImdsClient, with_retries
from ._observability import Metrics
from ._settings import AgentSettings
from ._state import StateStore

__all__ = ["ApprovalHandler"]

log = logging.getLogger(__name__)

#: How many times an approval is taken back when IMDS cannot be asked, before it is refused.
_MAX_REDELIVERIES = 5


class ApprovalHandler:
    """Handles one delivery at a time (``handle``); ``on_applied`` is called after a POST."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        identity: VmIdentity,
        reply_to: ReplyAddress,
        imds: ImdsClient,
        store: StateStore,
        metrics: Metrics,
        trusted: Mapping[str, Ed25519PublicKey],
        committed: Callable[[], None],
        on_applied: Callable[[], None],
    ) -> None:
        self._settings = settings
        self._identity = identity
        self._reply_to = reply_to
        self._imds = imds
        self._store = store
        self._metrics = metrics
        self._trusted = trusted
        self._committed = committed
        self._on_applied = on_applied
        if settings.observe_only:
            log.warning(
                "observe-only: no --trust-key given, every approval will be refused "
                "(or pass --accept-unsigned-approvals)"
            )

    async def handle(self, delivery: Delivery) -> None:
        try:
            approval = Approval.from_bytes(delivery.body)
        except SchemaError as exc:
            await self._malformed(delivery, exc)
            return
        try:
            self._verify(approval)
        except ApprovalRejected as rejected:
            await self._report(approval, None, rejected, remember=False)
            await delivery.ack()
            return
        # Only a verified approval may count as seen: a forged copy must not shadow the real one.
        if await self._store.approval_outcome(approval.approval_id) is not None:
            log.info("approval %s was handled already: acked again", approval.approval_id)
            await delivery.ack()
            return
        try:
            event = await self._check_event(approval)
        except ApprovalRejected as rejected:
            await self._report(approval, None, rejected)
            await delivery.ack()
            return
        except ImdsError as exc:
            if delivery.delivery_count < _MAX_REDELIVERIES:
                log.warning(
                    "approval %s: IMDS cannot be asked (%s); it goes back to the queue",
                    approval.approval_id,
                    exc,
                )
                await asyncio.sleep(Backoff(0.5, 5.0).next())
                await delivery.retry()
                return
            await self._report(
                approval, None, ApprovalRejected(RejectReason.IMDS_REFUSED, f"IMDS failed: {exc}")
            )
            await delivery.ack()
            return
        if self._settings.dry_run:
            log.info(
                "dry run: approval %s for %s verified, not POSTed",
                approval.approval_id,
                event.event_id,
            )
            await self._report(approval, event, None)
            await delivery.ack()
            return
        try:
            await with_retries(
                lambda: self._imds.start_events([approval.event_id]),
                what=f"POST StartRequests {approval.event_id}",
                backoff=Backoff(0.2, 2.0),
                attempts=3,
                on_error=lambda e: self._metrics.imds_errors.labels(e.kind).inc(),
            )
        except ImdsError as exc:
            await self._report(
                approval, event, ApprovalRejected(RejectReason.IMDS_REFUSED, str(exc))
            )
            await delivery.ack()
            return
        self._on_applied()
        await self._report(approval, event, None)
        await delivery.ack()

    def _verify(self, approval: Approval) -> None:
        settings = self._settings
        vm = self._identity.name
        if settings.observe_only:
            raise ApprovalRejected(
                RejectReason.OBSERVE_ONLY,
                "this agent trusts no key (no --trust-key) and refuses unsigned approvals",
            )
        now = datetime.now(UTC)
        if approval.signature or not settings.accept_unsigned_approvals:
            verify(approval, self._trusted, vm_name=vm, now=now)
        else:
            if approval.expires_at <= now:
                raise ApprovalRejected(RejectReason.EXPIRED, f"expired at {approval.expires_at}")
            if approval.vm.casefold() != vm.casefold():
                raise ApprovalRejected(
                    RejectReason.NOT_FOR_THIS_VM, f"the approval is for {approval.vm!r}, not {vm!r}"
                )

    async def _check_event(self, approval: Approval) -> ScheduledEvent:
        vm = self._identity.name
        document = await with_retries(
            self._imds.scheduled_events,
            what="GET Scheduled Events for an approval",
            backoff=Backoff(0.2, 2.0),
            attempts=3,
            on_error=lambda e: self._metrics.imds_errors.labels(e.kind).inc(),
        )
        event = document.event(approval.event_id)
        if event is None:
            raise ApprovalRejected(
                RejectReason.EVENT_NOT_FOUND,
                f"event {approval.event_id} is not in the document (incarnation "
                f"{document.document_incarnation})",
            )
        if not event.affects(vm):
            raise ApprovalRejected(
                RejectReason.NOT_FOR_THIS_VM, f"event {event.event_id} does not list {vm!r}"
            )
        if not event.is_scheduled:
            raise ApprovalRejected(
                RejectReason.EVENT_NOT_SCHEDULED,
                f"event {event.event_id} is {event.event_status}, no longer Scheduled",
            )
        return event

    async def _report(
        self,
        approval: Approval,
        event: ScheduledEvent | None,
        rejected: ApprovalRejected | None,
        *,
        remember: bool = True,
    ) -> None:
        if rejected is None:
            self._metrics.approvals_applied.inc()
            log.info(
                "approval %s applied: event %s (decided by %s)%s",
                approval.approval_id,
                approval.event_id,
                approval.decided_by,
                " [dry run]" if self._settings.dry_run else "",
            )
        else:
            self._metrics.approvals_rejected.labels(rejected.reason.value).inc()
            log.warning(
                "approval %s for event %s rejected: %s",
                approval.approval_id,
                approval.event_id,
                rejected,
            )
        data = ApprovalOutcomeData(
            vm=self._identity,
            event_id=approval.event_id,
            approval_id=approval.approval_id,
            decided_by=approval.decided_by,
            applied=rejected is None,
            reason=None if rejected is None else rejected.reason.value,
            detail=(
                ("dry run: verified, not POSTed" if self._settings.dry_run else "")
                if rejected is None
                else rejected.detail
            ),
            dry_run=self._settings.dry_run,
            event=event,
            reply_to=self._reply_to,
        )
        message = ApprovalOutcomeMessage.build(data, observed_at=datetime.now(UTC))
        await self._store.commit([message], approval_id=approval.approval_id if remember else None)
        self._committed()

    async def _malformed(self, delivery: Delivery, exc: SchemaError) -> None:
        log.warning("approval message %s is malformed: %s", delivery.message_id, exc)
        self._metrics.approvals_rejected.labels(RejectReason.MALFORMED.value).inc()
        event_id = delivery.properties.get("event_id")
        data = ApprovalOutcomeData(
            vm=self._identity,
            event_id=str(event_id) if event_id else "unknown",
            approval_id=delivery.message_id or "unknown",
            decided_by="unknown",
            applied=False,
            reason=RejectReason.MALFORMED.value,
            detail=str(exc)[:500],
            dry_run=self._settings.dry_run,
            reply_to=self._reply_to,
        )
        message = ApprovalOutcomeMessage.build(data, observed_at=datetime.now(UTC))
        await self._store.commit([message])
        self._committed()
        await delivery.ack()
