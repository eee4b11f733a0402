"""The watcher: polls IMDS, turns each new document into transitions, commits them with the
document in one transaction, and tells the outbox and the hooks.

It trusts IMDS only as far as IMDS deserves:

- an error, a timeout, garbage, a body too large: a failed poll, never an empty document;
- a document OLDER than the last one trusted (a lower ``DocumentIncarnation``, as a lagging IMDS
  replica serves, or a reset to incarnation 0 with no events) is held back, not diffed: it is
  accepted only once it has persisted for ``stale_polls`` polls over ``stale_seconds`` (a real
  reset), and the log says so either way. So a stale answer for a second never completes an
  event still running, starts one again, or publishes its real end under an id used already;
- an event with a NotBefore that is not a date is kept (with a warning), so one bad field never
  blinds the agent to the other events;
- an event IMDS lists but that cannot be read (a field missing or invalid) costs that event only
  (:func:`schemas.transitions.diff`): the answer's other events are published, the unreadable
  one is held at its last readable state (never reported gone, never announced again), while an
  unreadable item without a readable EventId is listed no event is taken for gone, and the
  operator is warned once per such event while IMDS lists it. The document trusted and stored
  (:func:`~schemas.transitions.kept_after`) holds what was last read; approvals are checked
  against the answer itself, where the event is unreadable, so one is never started on what
  cannot be read.

Approvals ask for a document from a poll begun at a given time or later
(:meth:`Watcher.document_since`): the last trusted one if it is that recent, the poll under way
if it began then, or else the next poll, made at once; that poll serves both, so an approval
costs at most one GET (plus its POST), and the transitions that GET shows are published like any
other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime

from schemas import (
    ImdsError,
    ImdsThrottled,
    ReplyAddress,
    ScheduledEvent,
    ScheduledEventsDocument,
    Transition,
    TransitionKind,
    TransitionMessage,
    VmIdentity,
    diff,
    revisions_after,
)
from schemas._backoff import Backoff
from schemas.imds import UnreadableEvent
from schemas.transitions import kept_after

from ._hooks import HookRunner
from ._imds import ImdsClient
from ._observability import Metrics
from ._outbox import OutboxPublisher
from ._poller import Cadence
from ._settings import AgentSettings
from ._state import StateStore

__all__ = ["Watcher"]

log = logging.getLogger(__name__)

#: The longest pause between polls while IMDS keeps failing.
IMDS_BACKOFF_CAP = 8.0


#: How much of a malformed IMDS value a log line quotes (the document may hold 256 KB of it).
_QUOTED = 80
#: Unreadable events named one by one in the log for one answer; the rest in one line.
_UNREADABLE_NAMED = 10


class Watcher:
    """One VM's view of IMDS; :meth:`run` until cancelled."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        identity: VmIdentity,
        reply_to: ReplyAddress,
        imds: ImdsClient,
        store: StateStore,
        metrics: Metrics,
        outbox: OutboxPublisher,
        hooks: HookRunner,
        cadence: Cadence,
        scope: str,
        stored_scope: str | None,
        previous: ScheduledEventsDocument | None,
        revisions: dict[str, int],
        on_depth: Callable[[int, int], None],
    ) -> None:
        self._settings = settings
        self._identity = identity
        self._reply_to = reply_to
        self._imds = imds
        self._store = store
        self._metrics = metrics
        self._outbox = outbox
        self._hooks = hooks
        self._cadence = cadence
        self._scope = scope
        self._stored_scope = stored_scope
        self._on_depth = on_depth
        #: The last document trusted (committed): what transitions are computed from. It holds
        #: the events held at their last readable state (see kept_after).
        self.document = previous
        #: The answer that gave ``document``, as IMDS sent it (unreadable events unreadable):
        #: what approvals are checked against. None until a poll of this run is trusted.
        self._fresh: ScheduledEventsDocument | None = None
        self._revisions = revisions
        self._held_since: float | None = None
        self._held_polls = 0
        self._waiters: list[asyncio.Future[ScheduledEventsDocument]] = []
        #: The poll under way (when it began, monotonic) and who waits for its document.
        self._polling: list[asyncio.Future[ScheduledEventsDocument]] = []
        self._polling_began: float | None = None
        #: When the poll that gave ``document`` began (a stored document: never).
        self._document_began = float("-inf")
        #: Events listed now whose NotBefore is not a date, warned about already.
        self._warned_not_before: set[str] = set()
        #: Unreadable events listed now, warned about (and counted) already.
        self._warned_unreadable: set[tuple[str | None, str, int]] = set()
        #: Monotonic time of the last good poll; set when IMDS fails, cleared when it answers.
        self.last_poll: float | None = None
        self.failing_since: float | None = None
        self.last_error: str | None = None
        self.polled = asyncio.Event()
        #: Set while an event of this VM is Scheduled (an approval could come for it).
        self.approvable = asyncio.Event()

    # ---------------------------------------------------------------------------- fresh

    async def document_since(self, since: float) -> ScheduledEventsDocument:
        """The trusted document of a poll begun at ``since`` (monotonic) or later: the last one
        if its poll began then, else that of the poll under way if it did, else that of the
        next poll, made at once (``since`` now: a document fetched after this call).
        :class:`ImdsError` when that poll failed or IMDS answered an older document."""
        if self._fresh is not None and self._document_began >= since:
            return self._fresh
        future: asyncio.Future[ScheduledEventsDocument] = asyncio.get_running_loop().create_future()
        if self._polling_began is not None and self._polling_began >= since:
            self._polling.append(future)
        else:
            self._waiters.append(future)
            self._cadence.wake()
        return await future

    def _answer(
        self, waiters: list[asyncio.Future[ScheduledEventsDocument]], result: object
    ) -> None:
        for future in waiters:
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                assert isinstance(result, ScheduledEventsDocument)
                future.set_result(result)

    # ------------------------------------------------------------------------------- loop

    async def run(self) -> None:
        settings = self._settings
        backoff = Backoff(settings.poll_interval, max(IMDS_BACKOFF_CAP, settings.poll_interval))
        if self._stored_scope is not None and self._stored_scope != self._scope:
            # The scope changed since the last run (--all-events on or off): say so now, so a
            # later run knows which events this one announced.
            await self._store.set_scope(self._scope)
            self._stored_scope = self._scope
        while True:
            began = time.monotonic()
            waiters, self._waiters = self._waiters, []
            try:
                document = await self._poll(began, waiters)
            except ImdsError as exc:
                self._failed(exc)
                self._answer(waiters, exc)
                delay = backoff.next() * (4 if isinstance(exc, ImdsThrottled) else 1)
                log.warning(
                    "IMDS poll failed (%s); next try in %.2f s", exc, min(delay, IMDS_BACKOFF_CAP)
                )
                await self._cadence.sleep(min(delay, IMDS_BACKOFF_CAP))
                continue
            backoff.reset()
            self._answered()
            trusted = await self._take(document)
            if trusted:
                self._document_began = began
                self._answer(waiters, document)
            else:
                self._answer(
                    waiters,
                    ImdsError("IMDS answered an older document: held back", kind="stale"),
                )
            self.polled.set()
            watched = self._watched(self.document)
            self._set_approvable(watched)
            await self._cadence.wait_next(began, watched)

    async def _poll(
        self, began: float, waiters: list[asyncio.Future[ScheduledEventsDocument]]
    ) -> ScheduledEventsDocument:
        """One GET; while it is under way, who asks for a document from ``began`` on joins
        ``waiters`` (and once it is over, waits for the next poll)."""
        self._polling, self._polling_began = waiters, began
        try:
            return await self._imds.scheduled_events()
        finally:
            self._polling_began = None

    def _failed(self, exc: ImdsError) -> None:
        self._metrics.imds_errors.labels(exc.kind).inc()
        if self.failing_since is None:
            self.failing_since = time.monotonic()
        self.last_error = str(exc)

    def _answered(self) -> None:
        self._metrics.polls.inc()
        self._metrics.last_poll.set(time.time())
        self.last_poll = time.monotonic()
        self.failing_since = None
        self.last_error = None

    def _watched(self, document: ScheduledEventsDocument | None) -> tuple[ScheduledEvent, ...]:
        if document is None:
            return ()
        if self._settings.all_events:
            return document.events
        vm = self._identity.name
        return tuple(e for e in document.events if e.affects(vm))

    def _set_approvable(self, watched: tuple[ScheduledEvent, ...]) -> None:
        vm = self._identity.name
        if any(e.is_scheduled and e.affects(vm) for e in watched):
            self.approvable.set()
        else:
            self.approvable.clear()

    # ---------------------------------------------------------------------- a document

    async def _take(self, document: ScheduledEventsDocument) -> bool:
        """Diff and commit ``document`` unless it is older than the one trusted; whether it is
        trusted now."""
        previous = self.document
        if document is self._fresh:
            return True  # the same answer again (the same bytes): nothing new
        if previous is not None and document.document_incarnation < previous.document_incarnation:
            if not self._hold(document, previous):
                return False
        elif self._held_since is not None:
            log.info(
                "IMDS answers incarnation %d again after %d older answer(s): they were not "
                "acted on",
                document.document_incarnation,
                self._held_polls,
            )
            self._held_since, self._held_polls = None, 0
        self._warn_bad_not_before(document)
        self._warn_unreadable(document)
        await self._commit(previous, document)
        self._fresh = document
        return True

    def _hold(self, document: ScheduledEventsDocument, previous: ScheduledEventsDocument) -> bool:
        """An older document: held back until it persists; True once it is accepted."""
        settings = self._settings
        now = time.monotonic()
        self._metrics.stale_documents.inc()
        if self._held_since is None:
            self._held_since = now
            log.warning(
                "IMDS answered incarnation %d, older than the %d trusted (%d events now, %d "
                "trusted): held back; accepted only if it persists %d polls over %.0f s (a "
                "reset of IMDS)",
                document.document_incarnation,
                previous.document_incarnation,
                len(document.events),
                len(previous.events),
                settings.stale_polls,
                settings.stale_seconds,
            )
        self._held_polls += 1
        persisted = now - self._held_since
        if self._held_polls < settings.stale_polls or persisted < settings.stale_seconds:
            return False
        log.warning(
            "IMDS kept answering incarnation %d (older than %d) for %d polls over %.1f s: "
            "taken as a reset of IMDS; its events are diffed against the last trusted document",
            document.document_incarnation,
            previous.document_incarnation,
            self._held_polls,
            persisted,
        )
        self._held_since, self._held_polls = None, 0
        return True

    def _warn_bad_not_before(self, document: ScheduledEventsDocument) -> None:
        """Once per event while IMDS lists it: what is remembered is bounded by one document,
        however many such events a broken IMDS invents over time."""
        warned = self._warned_not_before
        if warned:
            warned.intersection_update(e.event_id for e in document.events)
        for event in document.events:
            if not event.not_before_valid and event.event_id not in warned:
                warned.add(event.event_id)
                text = event.not_before_text
                log.warning(
                    "event %s has a NotBefore that is not a date (%r%s): kept as sent; its other "
                    "fields and the other events are published as usual",
                    event.event_id,
                    text[:_QUOTED],
                    f"... {len(text)} characters" if len(text) > _QUOTED else "",
                )

    def _warn_unreadable(self, document: ScheduledEventsDocument) -> None:
        """Once per unreadable event while IMDS lists it (counted then too): what is remembered
        is bounded by one document, as for a bad NotBefore. An item without a readable EventId
        is known by its reason and its place among the items with that reason."""
        unreadable = document.unreadable
        self._metrics.unreadable_listed.set(len(unreadable))
        warned = self._warned_unreadable
        if not unreadable:
            warned.clear()
            return
        keys = _unreadable_keys(unreadable)
        warned.intersection_update(keys)
        new = [u for key, u in zip(keys, unreadable, strict=True) if key not in warned]
        warned.update(keys)
        if not new:
            return
        self._metrics.unreadable_events.inc(len(new))
        for item in new[:_UNREADABLE_NAMED]:
            if item.event_id is None:
                log.warning(
                    "IMDS lists an event whose EventId cannot be read (%s): its other events "
                    "are published; while IMDS lists it no event is taken for ended (it could be "
                    "any of them), and those gone meanwhile are reported once it is gone",
                    item.reason,
                )
            else:
                log.warning(
                    "IMDS lists event %s, which cannot be read (%s): its other events are "
                    "published; it is held at its last readable state (announced once it reads, "
                    "if it never did), never reported gone while listed, and an approval of it "
                    "is refused",
                    _quoted(item.event_id),
                    item.reason,
                )
        if len(new) > _UNREADABLE_NAMED:
            log.warning(
                "IMDS lists %d more events that cannot be read (incarnation %d), not named one "
                "by one: each is held as the ones above",
                len(new) - _UNREADABLE_NAMED,
                document.document_incarnation,
            )

    async def _ran_between_polls(self, transitions: list[Transition]) -> list[Transition]:
        """An event gone while still Scheduled is reported ``canceled``, unless this agent
        started it (its StartRequests POST succeeded, or went out and was never answered, or
        may be out and not answered yet: IMDS may have taken it): then it ran, start to end,
        between two polls (a Freeze of seconds, a slow poll interval), and is reported
        ``completed``."""
        gone = [t.event.event_id for t in transitions if t.kind is TransitionKind.CANCELED]
        if not gone:
            return transitions
        started_here = await self._store.applied_among(gone)
        return [
            replace(t, kind=TransitionKind.COMPLETED)
            if t.kind is TransitionKind.CANCELED and t.event.event_id in started_here
            else t
            for t in transitions
        ]

    async def _commit(
        self, previous: ScheduledEventsDocument | None, document: ScheduledEventsDocument
    ) -> None:
        settings = self._settings
        vm = self._identity.name
        transitions = await self._ran_between_polls(diff(previous, document, self._revisions))
        # The answer with the events it lists unreadable, or may list, held as last read.
        document = kept_after(previous, document)
        revisions = revisions_after(self._revisions, transitions, document)
        chosen = [
            t
            for t in transitions
            if settings.all_events or t.event.affects(vm) or _listed_before(previous, t, vm)
        ]
        if not chosen and self._stored_scope == self._scope:
            # Only other VMs' events changed (a placement group's neighbours, not published
            # without --all-events): nothing to publish, so nothing to make durable (on a VM,
            # a synchronous write to disk). After a restart the agent diffs from the last
            # document it stored, and their changes are left out just the same. Their
            # revisions are kept in memory: an id is only ever given to what is published, and
            # every publication stores them.
            self._revisions = revisions
            self.document = document
            return
        now = datetime.now(UTC)
        messages = [
            TransitionMessage.build(t, vm=self._identity, reply_to=self._reply_to, observed_at=now)
            for t in chosen
        ]
        hooks = [
            (index, str(hook))
            for index, transition in enumerate(chosen)
            for hook in settings.hooks
            if transition.kind in hook.on
        ]
        result = await self._store.commit(
            messages,
            document=document,
            revisions=revisions,
            scope=self._scope if self._stored_scope != self._scope else None,
            hooks=hooks,
        )
        self._stored_scope = self._scope
        self._revisions = revisions
        self.document = document
        self._on_depth(result.depth, result.dropped)
        for transition, row in zip(chosen, result.rows, strict=True):
            self._metrics.transitions.labels(transition.kind.value).inc()
            log.info(
                "%s %s %s (incarnation %d, revision %d) -> outbox seq %d",
                transition.kind.value,
                transition.event.event_type,
                transition.event.event_id,
                transition.incarnation,
                transition.revision,
                row.sequence,
            )
        if messages:
            self._outbox.notify()
        if hooks:
            self._hooks.notify()
        if any(t.kind is TransitionKind.STARTED for t in chosen):
            # A running event ends soon (a Freeze in seconds): poll fast to report its end,
            # which frees capacity for the next approval, and only until it is gone. A new
            # Scheduled event alone changes nothing soon (its NotBefore coming near makes
            # polling fast by itself), and a neighbour's event is not this agent's to report:
            # neither costs the VM's shared IMDS budget anything more.
            self._cadence.boost()


def _unreadable_keys(unreadable: tuple[UnreadableEvent, ...]) -> list[tuple[str | None, str, int]]:
    """What tells each unreadable item of an answer from the others, and from one answer to the
    next: its EventId, its reason, and how many items before it have both the same."""
    counts: dict[tuple[str | None, str], int] = {}
    keys = []
    for item in unreadable:
        n = counts.get((item.event_id, item.reason), 0)
        counts[(item.event_id, item.reason)] = n + 1
        keys.append((item.event_id, item.reason, n))
    return keys


def _quoted(text: str) -> str:
    """IMDS's text in a log line: quoted (no line of its own) and cut to :data:`_QUOTED`."""
    if len(text) <= _QUOTED:
        return repr(text)
    return f"{text[:_QUOTED]!r}... ({len(text)} characters)"


def _listed_before(
    previous: ScheduledEventsDocument | None, transition: Transition, vm: str
) -> bool:
    """Whether the event listed ``vm`` in the document before: an event that stops listing the
    VM is announced once more (the central services count a VM as in an event until it says
    it is out), and then no longer."""
    if previous is None:
        return False
    event_id = transition.event.event_id
    return any(e.event_id == event_id and e.affects(vm) for e in previous.events)
