"""Approvals in: verify each one, POST ``StartRequests``, report the outcome, then ack.

An approval is applied only when all of these hold, checked in this order, each failure with its
own reason in ``approval.rejected``: the agent is not observe-only (a trusted key, or
``--accept-unsigned-approvals``); the signature is good and from a trusted key; it has not
expired (nor outlived ``approval_max_lifetime`` since it was issued, whatever it says); it names
this VM; the event is in a document from a poll begun after the approval was decided, and at
most ``DOCUMENT_MAX_AGE`` (a second) before the check, lists this VM, is still Scheduled, and is
still the version the approval was decided on (``event-changed`` otherwise: an event that changed
after it was judged is judged again, never started on the old judgement). A POST IMDS refuses
is retried only after every check again, on a poll begun after it failed. ``--dry-run``
verifies and reports (``approval.applied`` with ``dry_run``) but never POSTs.

The outcome is never misreported: the intent to apply an approval is durable before the POST,
so an agent killed between its POST and the outcome reports it as applied when the approval
comes back (or at its next start), not as ``event-not-scheduled``. But while its event still
waits at the version approved (the POST may never have gone out), it is POSTed again only on
every check a fresh approval passes, and refused with the reason otherwise. An approval of an
event this state store saw applied already, or issued before the store existed (a wiped state
dir), is POSTed again (harmless for IMDS) and reported as a ``repeat``. The delivery is acked
only after the outcome is in the durable outbox; an approval seen again after that is acked
unapplied. Attempts are counted in the state store (the broker's own redelivery flag cannot
count), and an approval IMDS cannot be asked about after ``MAX_ATTEMPTS`` is refused
(``imds-refused``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from schemas import (
    MAX_KEY_LENGTH,
    Approval,
    ApprovalOutcomeData,
    ApprovalOutcomeMessage,
    ApprovalRejected,
    ImdsError,
    RejectReason,
    ReplyAddress,
    ScheduledEvent,
    ScheduledEventsDocument,
    SchemaError,
    TransportError,
    VmIdentity,
    check_lifetime,
    event_version,
    verify,
)
from schemas._backoff import Backoff
from schemas.transport import Delivery

from ._imds import RETRYABLE_KINDS, ImdsClient
from ._observability import Metrics
from ._settings import AgentSettings
from ._state import Intent, StateStore

__all__ = ["ApprovalHandler"]

log = logging.getLogger(__name__)

#: Deliveries of one approval while IMDS cannot be asked, before it is refused.
MAX_ATTEMPTS = 5

#: POSTs of one approval IMDS refuses with a retryable error before it is reported
#: ``imds-refused``; before each retry the event is looked at again, on a new poll.
POST_ATTEMPTS = 3

#: How long before its check the poll an approval is checked against may have begun (seconds).
#: An approval decided before the agent's last poll began and arriving within a second of it is
#: POSTed on that poll's document at once. Asking IMDS again would not make the POST's document
#: much younger: the VM's request budget (two in any second) holds that POST, the third request
#: within a second of the last poll, until the poll leaves the window; so it went out on a
#: document up to a second old anyway, up to a second later, for one more request out of a
#: budget every client on the VM shares.
DOCUMENT_MAX_AGE = 1.0


class ApprovalHandler:
    """Handles one delivery at a time (``handle``); ``on_applied(event_id)`` is called after a POST.
    ``document(since)`` gives the trusted document of a poll begun at ``since`` (monotonic) or
    later (see the watcher)."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        identity: VmIdentity,
        reply_to: ReplyAddress,
        imds: ImdsClient,
        document: Callable[[float], Awaitable[ScheduledEventsDocument]],
        store: StateStore,
        metrics: Metrics,
        trusted: Mapping[str, Any],
        epoch: str,
        store_created: float,
        committed: Callable[[], None],
        on_applied: Callable[[str], None],
    ) -> None:
        self._settings = settings
        self._identity = identity
        self._reply_to = reply_to
        self._imds = imds
        self._document = document
        self._store = store
        self._metrics = metrics
        self._trusted = trusted
        self._epoch = epoch
        self._store_created = datetime.fromtimestamp(store_created, UTC)
        self._committed = committed
        self._on_applied = on_applied
        if settings.observe_only:
            log.warning(
                "observe-only: no --trust-key given, every approval will be refused "
                "(or pass --accept-unsigned-approvals)"
            )

    # ------------------------------------------------------------------------------ handling

    async def handle(self, delivery: Delivery) -> None:
        """Handle one delivery and settle it. An exception this handling did not expect is a
        defect: it is logged with its traceback, the approval is reported refused
        (``malformed``) and acked, and the agent goes on. Left to end the agent, one hostile
        approval ended it and, never acked, every start after it. (A lost link is no defect:
        the consumer reopens it, and the approval comes back.)"""
        try:
            await self._handle(delivery)
        except TransportError:
            raise
        except Exception as exc:
            await self._failed(delivery, exc)

    async def _handle(self, delivery: Delivery) -> None:
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
        record = await self._store.approval_record(approval.approval_id, approval.event_id)
        if record.outcome is not None:
            log.info("approval %s was handled already: acked again", approval.approval_id)
            await delivery.ack()
            return
        if record.intent is not None:
            # POSTed (or about to be) before the agent stopped: it counts as applied.
            await self._reconcile(record.intent, approval)
            await delivery.ack()
            return
        attempt = record.attempt
        try:
            event = await self._check_event(approval)
        except ApprovalRejected as rejected:
            await self._report(approval, None, rejected)
            await delivery.ack()
            return
        except ImdsError as exc:
            if attempt < MAX_ATTEMPTS:
                log.warning(
                    "approval %s: IMDS cannot be asked (%s); it goes back to the queue (attempt "
                    "%d of %d)",
                    approval.approval_id,
                    exc,
                    attempt,
                    MAX_ATTEMPTS,
                )
                backoff = Backoff(0.5, 5.0)
                backoff.attempt = attempt - 1
                await asyncio.sleep(backoff.next())
                await delivery.retry()
                return
            await self._report(
                approval,
                None,
                ApprovalRejected(
                    RejectReason.IMDS_REFUSED,
                    f"IMDS could not be asked about the event in {attempt} attempts: {exc}",
                ),
            )
            await delivery.ack()
            return
        await self._apply(approval, event, record.applied_by)
        await delivery.ack()

    async def _apply(
        self, approval: Approval, event: ScheduledEvent, applied_by: str | None
    ) -> None:
        repeat = self._repeat(approval, applied_by)
        if self._settings.dry_run:
            log.info(
                "dry run: approval %s for %s verified, not POSTed",
                approval.approval_id,
                event.event_id,
            )
            await self._report(approval, event, None, repeat=repeat)
            return
        await self._store.record_intent(
            approval.approval_id, event.event_id, event_version(event), approval.to_bytes()
        )
        backoff = Backoff(0.2, 2.0)
        unanswered: list[ImdsError] = []
        attempt = 1
        while True:
            try:
                await self._imds.start_events([approval.event_id])
                break
            except ImdsError as exc:
                failed_at = time.monotonic()
                self._metrics.imds_errors.labels(exc.kind).inc()
                if exc.unanswered:
                    unanswered.append(exc)
                if exc.kind not in RETRYABLE_KINDS or attempt >= POST_ATTEMPTS:
                    refused = ApprovalRejected(RejectReason.IMDS_REFUSED, str(exc))
                    await self._not_posted(approval, event, refused, unanswered)
                    return
                delay = backoff.next()
                log.warning(
                    "approval %s: POST StartRequests %s failed (%s); in %.2f s the event is "
                    "looked at again on a new poll, and POSTed again only if it may still be "
                    "(attempt %d of %d)",
                    approval.approval_id,
                    approval.event_id,
                    exc,
                    delay,
                    attempt,
                    POST_ATTEMPTS,
                )
                await asyncio.sleep(delay)
                try:
                    event = await self._check_again(approval, failed_at)
                except ApprovalRejected as rejected:
                    retry = ApprovalRejected(
                        rejected.reason,
                        f"{rejected.detail} (seen before retrying a POST that failed: {exc})",
                    )
                    await self._not_posted(approval, None, retry, unanswered)
                    return
                except ImdsError as looked:
                    refused = ApprovalRejected(
                        RejectReason.IMDS_REFUSED,
                        f"{exc}; then IMDS could not be asked about the event before a retry "
                        f"({looked})",
                    )
                    await self._not_posted(approval, event, refused, unanswered)
                    return
                attempt += 1
        self._on_applied(approval.event_id)
        await self._report(approval, event, None, repeat=repeat)

    async def _not_posted(
        self,
        approval: Approval,
        event: ScheduledEvent | None,
        rejected: ApprovalRejected,
        unanswered: list[ImdsError],
    ) -> None:
        """Report an approval whose POST failed, or was not retried, as ``rejected``. When an
        earlier POST went out unanswered, IMDS may have taken it: the event may start. It is
        not reported applied (the approver tries again, and a second POST is a no-op), but it
        counts as started here: polled fast, and, gone unseen, ``completed``."""
        if not unanswered:
            await self._report(approval, event, rejected)
            return
        self._on_applied(approval.event_id)
        await self._report(
            approval,
            event,
            ApprovalRejected(
                rejected.reason,
                f"{rejected.detail}; IMDS may have taken an earlier POST whose answer was lost "
                f"({unanswered[0]}), so the event may start",
            ),
            maybe_started=True,
        )

    def _repeat(self, approval: Approval, earlier: str | None) -> str | None:
        """Why this may not be the first time the event was approved here (``earlier``: the
        approval applied for it here before, if any), if it may not."""
        if earlier is not None:
            return (
                f"event {approval.event_id} was approved here already, or its POST went out "
                f"unanswered (approval {earlier})"
            )
        # No margin for clock skew: a false "may be a repeat" costs a word in a report, a
        # missed one hides that the state was lost.
        if approval.issued_at < self._store_created:
            return (
                f"the approval was issued at {approval.issued_at.isoformat()}, before this "
                f"agent's state was created ({self._store_created.isoformat()}): the state dir "
                "was wiped or the approval is replayed, so it may have been applied before"
            )
        return None

    async def _reconcile(self, intent: Intent, approval: Approval) -> None:
        """An approval whose POST may have gone out before the agent stopped. When the event
        moved on (started, gone, changed) or IMDS cannot say, no POST is made: it counts as
        applied, whatever the event did since (IMDS would take a second POST as a no-op). When
        it still waits at the version approved, the POST may never have gone out, and one made
        now is a new POST: see :meth:`_post_again`."""
        event: ScheduledEvent | None = None
        document: ScheduledEventsDocument | None = None
        try:
            document = await self._document(time.monotonic())
            event = document.event(intent.event_id)
        except ImdsError as exc:
            log.info("reconciling approval %s without IMDS (%s)", intent.approval_id, exc)
        if (
            document is not None
            and event is not None
            and event.is_scheduled
            and event_version(event) == intent.event_version
        ):
            await self._post_again(intent, approval, document)
            return
        if event is not None:
            status = event.event_status
        elif document is not None and intent.event_id in document.unreadable_ids:
            status = "listed by IMDS but unreadable"  # IMDS cannot say: no POST, as without it
        else:
            status = "gone"
        log.info(
            "approval %s: POSTed before the agent stopped; reported as applied (the event is "
            "%s now)",
            intent.approval_id,
            status,
        )
        await self._report(
            approval,
            event,
            None,
            detail=f"POST StartRequests was made before the agent restarted; the event is "
            f"{status} now",
        )

    async def _post_again(
        self, intent: Intent, approval: Approval, document: ScheduledEventsDocument
    ) -> None:
        """The event of a stored intent still waits at the version approved: its POST may
        never have gone out. A POST now is made only on every check a fresh approval passes,
        with this agent's settings now (it may have been restarted with ``--dry-run``, or
        without the approver's key), at this moment (the approval may have expired), on
        ``document`` (a poll begun after the restart). Otherwise no POST: the approval is
        reported refused with the reason (or as a dry run), and its event counts as maybe
        started here (the POST may have gone out before the restart)."""
        earlier = "its POST, about to be made when the agent stopped, may have gone out"
        try:
            self._verify(approval)
            event = self._check_in(document, approval)
        except ApprovalRejected as rejected:
            await self._report(
                approval,
                document.event(intent.event_id),
                ApprovalRejected(
                    rejected.reason, f"{rejected.detail}; {earlier}, none is made now"
                ),
                maybe_started=True,
            )
            return
        if self._settings.dry_run:
            log.info(
                "dry run: approval %s for %s, stored before the agent restarted, verified, not "
                "POSTed",
                intent.approval_id,
                intent.event_id,
            )
            await self._report(
                approval,
                event,
                None,
                detail=f"dry run: verified, not POSTed; {earlier}",
                maybe_started=True,
            )
            return
        try:
            await self._imds.start_events([intent.event_id])
        except ImdsError as exc:
            log.info("POST again for %s failed (%s): reported anyway", intent.event_id, exc)
        log.info(
            "approval %s: POSTed again after the agent restarted (the event still waited); "
            "reported as applied",
            intent.approval_id,
        )
        await self._report(
            approval,
            event,
            None,
            detail="POST StartRequests was made before the agent restarted (or was about to "
            "be), and again after it, the event still Scheduled",
        )

    async def reconcile_all(self) -> None:
        """At start: every intent without an outcome (a crash between the POST and the outcome)
        is reported now, even if its approval never comes back (it may have expired)."""
        for intent in await self._store.intents():
            if await self._store.approval_outcome(intent.approval_id) is not None:
                continue
            try:
                approval = Approval.from_bytes(intent.body)
            except SchemaError as exc:
                log.error("stored approval %s unreadable (%s)", intent.approval_id, exc)
                continue
            try:
                await self._reconcile(intent, approval)
            except TransportError:
                raise  # no defect: the link is retried, and this intent with it at next start
            except Exception:
                # A defect met by one stored intent: it must not end the agent at every start.
                log.exception(
                    "reconciling the stored approval %s failed (a defect): it is left for the "
                    "next start; the other intents are reconciled",
                    intent.approval_id,
                )

    # ----------------------------------------------------------------------------- checking

    def _verify(self, approval: Approval) -> None:
        settings = self._settings
        vm = self._identity.name
        if settings.observe_only:
            raise ApprovalRejected(
                RejectReason.OBSERVE_ONLY,
                "this agent trusts no key (no --trust-key) and refuses unsigned approvals",
            )
        now = datetime.now(UTC)
        lifetime = _max_lifetime(settings.approval_max_lifetime)
        if self._trusted or not settings.accept_unsigned_approvals:
            verify(approval, self._trusted, vm_name=vm, now=now, max_lifetime=lifetime)
        else:
            check_lifetime(approval, now, lifetime)
            if approval.vm.casefold() != vm.casefold():
                raise ApprovalRejected(
                    RejectReason.NOT_FOR_THIS_VM, f"the approval is for {approval.vm!r}, not {vm!r}"
                )

    async def _check_event(self, approval: Approval) -> ScheduledEvent:
        # A poll begun after the decision (by this VM's clock), and within DOCUMENT_MAX_AGE.
        decided_ago = (datetime.now(UTC) - approval.issued_at).total_seconds()
        document = await self._document(
            time.monotonic() - min(DOCUMENT_MAX_AGE, max(0.0, decided_ago))
        )
        return self._check_in(document, approval)

    async def _check_again(self, approval: Approval, failed_at: float) -> ScheduledEvent:
        """Before a POST is retried: every check again, the event's on a poll begun after the
        failed POST (``failed_at``, monotonic) and within ``DOCUMENT_MAX_AGE``. Azure may have
        changed the event, or started it, since the last look: a retry on that look would
        start a version the approver never judged."""
        self._verify(approval)
        document = await self._document(max(failed_at, time.monotonic() - DOCUMENT_MAX_AGE))
        return self._check_in(document, approval)

    def _check_in(self, document: ScheduledEventsDocument, approval: Approval) -> ScheduledEvent:
        """The event ``approval`` starts, if ``document`` shows it may be started: listing
        this VM, Scheduled, at the version approved; else :class:`ApprovalRejected`.

        ``document`` is IMDS's answer itself: an event it lists but that cannot be read is not
        in its events (the watcher holds it at its last readable state, which is not what IMDS
        says now). It is refused as ``imds-refused`` (IMDS could not say what the event is; the
        approver tries again later, and it may read by then), never started on a version read
        before."""
        vm = self._identity.name
        unreadable = [u for u in document.unreadable if u.event_id == approval.event_id]
        if unreadable:
            raise ApprovalRejected(
                RejectReason.IMDS_REFUSED,
                f"event {approval.event_id} is listed by IMDS (incarnation "
                f"{document.document_incarnation}) but cannot be read ({unreadable[0].reason}): "
                "what it is now is unknown, so it is not started; approve it again once IMDS "
                "describes it readably",
            )
        event = document.event(approval.event_id)
        if event is None and document.unidentified:
            raise ApprovalRejected(
                RejectReason.IMDS_REFUSED,
                f"event {approval.event_id} is not among the events IMDS lists readably "
                f"(incarnation {document.document_incarnation}), and IMDS also lists an event "
                "whose EventId cannot be read, which may be this one: it cannot be read, so it "
                "is not started; approve it again once IMDS describes it readably",
            )
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
        live = event_version(event)
        if approval.event_version is None:
            raise ApprovalRejected(
                RejectReason.UNBOUND,
                "the approval names no event version (an approver older than schema 1.1 sent "
                f"it); the live event is version {live}: decide again with a current approver",
            )
        if approval.event_version != live:
            raise ApprovalRejected(
                RejectReason.EVENT_CHANGED,
                f"the approval was decided on version {approval.event_version} of event "
                f"{event.event_id}; the live event is version {live} ({_describe(event)}): "
                "it changed after it was judged, and must be judged again",
            )
        return event

    # ----------------------------------------------------------------------------- reporting

    async def _report(
        self,
        approval: Approval,
        event: ScheduledEvent | None,
        rejected: ApprovalRejected | None,
        *,
        remember: bool = True,
        repeat: str | None = None,
        detail: str | None = None,
        maybe_started: bool = False,
    ) -> None:
        """Report the outcome and remember it; ``maybe_started``: the POST may have started the
        event although it is not reported applied (its answer was lost)."""
        if rejected is None:
            self._metrics.approvals_applied.inc()
            log.info(
                "approval %s applied: event %s (decided by %s)%s%s",
                approval.approval_id,
                approval.event_id,
                approval.decided_by,
                " [dry run]" if self._settings.dry_run else "",
                f" [repeat: {repeat}]" if repeat else "",
            )
            text = detail or ("dry run: verified, not POSTed" if self._settings.dry_run else "")
            if repeat:
                text = f"{text}; repeat: {repeat}" if text else f"repeat: {repeat}"
        else:
            self._metrics.approvals_rejected.labels(rejected.reason.value).inc()
            log.warning(
                "approval %s for event %s rejected: %s",
                approval.approval_id,
                approval.event_id,
                rejected,
            )
            text = rejected.detail
        data = ApprovalOutcomeData(
            vm=self._identity,
            event_id=approval.event_id,
            approval_id=approval.approval_id,
            decided_by=approval.decided_by,
            applied=rejected is None,
            reason=None if rejected is None else rejected.reason.value,
            detail=text,
            dry_run=self._settings.dry_run,
            event=event,
            reply_to=self._reply_to,
            event_version=approval.event_version,
            repeat=bool(repeat),
            epoch=self._epoch,
        )
        message = ApprovalOutcomeMessage.build(data, observed_at=datetime.now(UTC))
        applied = rejected is None and not self._settings.dry_run
        await self._store.commit(
            [message],
            outcome_of=approval.approval_id if remember else None,
            applied_event=approval.event_id if applied or maybe_started else None,
        )
        self._committed()

    async def _malformed(self, delivery: Delivery, exc: SchemaError) -> None:
        log.warning("approval message %s is malformed: %s", delivery.message_id, exc)
        await self._refused(delivery, None, str(exc))
        await delivery.ack()

    async def _failed(self, delivery: Delivery, exc: Exception) -> None:
        """The handling of ``delivery`` raised ``exc``, which it did not expect (a defect):
        report the approval refused, as ``malformed`` (this agent cannot handle it; trying it
        again would fail again), and ack it."""
        log.error(
            "approval message %s: the agent failed on it (a defect: %s: %s); it is reported "
            "refused (malformed) and acked, and the agent goes on",
            delivery.message_id,
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
        try:
            approval: Approval | None = Approval.from_bytes(delivery.body)
        except SchemaError:
            approval = None
        try:
            await self._refused(
                delivery,
                approval,
                f"this agent failed on the approval ({type(exc).__name__}: {exc}), a defect "
                "in the agent: refused",
            )
        except TransportError:
            raise
        except Exception:
            log.exception(
                "approval message %s: its refusal could not be reported either; acked unreported",
                delivery.message_id,
            )
        await delivery.ack()

    async def _refused(self, delivery: Delivery, approval: Approval | None, detail: str) -> None:
        """Report ``delivery`` refused as ``malformed``, with what can be read of it (the
        delivery's own id and properties when it is no approval), each id cut to the longest
        the contract takes, so that the report itself cannot fail on what the sender wrote."""
        self._metrics.approvals_rejected.labels(RejectReason.MALFORMED.value).inc()
        if approval is not None:
            event_id, approval_id = approval.event_id, approval.approval_id
            decided_by, version = approval.decided_by, approval.event_version
        else:
            event_id = str(delivery.properties.get("event_id") or "unknown")
            approval_id, decided_by, version = delivery.message_id or "unknown", "unknown", None
        data = ApprovalOutcomeData(
            vm=self._identity,
            event_id=event_id[:MAX_KEY_LENGTH],
            approval_id=approval_id[:MAX_KEY_LENGTH],
            decided_by=decided_by,
            applied=False,
            reason=RejectReason.MALFORMED.value,
            detail=detail[:500],
            dry_run=self._settings.dry_run,
            reply_to=self._reply_to,
            event_version=version,
            epoch=self._epoch,
        )
        message = ApprovalOutcomeMessage.build(data, observed_at=datetime.now(UTC))
        await self._store.commit([message])
        self._committed()


def _max_lifetime(seconds: float) -> timedelta | None:
    """``approval_max_lifetime`` as a cap on an approval's life: None (no cap) when it is
    longer than a timedelta holds (about 2.7 million years, far past year 9999: it caps
    nothing), rather than OverflowError at every approval. (The settings bound it to a day.)"""
    try:
        return timedelta(seconds=seconds)
    except OverflowError:
        return None


def _describe(event: ScheduledEvent) -> str:
    duration = f", {event.duration_in_seconds} s" if event.duration_in_seconds >= 0 else ""
    not_before = f", NotBefore {event.not_before_text}" if event.not_before_text else ""
    return f"{event.event_type}{duration}{not_before}, Resources {', '.join(event.resources)}"
