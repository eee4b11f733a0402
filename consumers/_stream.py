"""The fleet stream: every lifecycle message of the fleet, authenticated, typed, filtered and
deduplicated, with bad input dead-lettered and failing handlers retried a bounded number of
times.

Two ways to read it::

    async with FleetStream(transport, "audit") as stream:      # iteration
        async for message in stream:
            print(message.kind, message.vm.name)  # acked when the next one is asked for

    stream = FleetStream(transport, "approver", exclusive=True)  # handlers
    @stream.on(MessageType.STARTED, event_type="Reboot")
    async def started(message: TransitionMessage) -> None: ...
    await stream.run()

Both go through one path: receive (:meth:`_receive`, which opens the subscription again after a
broker failure), admit (:meth:`_admit`: decode, authenticate, dedupe), then settle. Every
delivery is settled exactly once, with one of: handled (acked, in batches where the broker
allows), retried (a handler failed; dead-lettered ``handler-failed`` after ``max_attempts``), or
dead-lettered with a :class:`DeadLetterReason` (bad input, a forged origin, an id conflict, or a
handler's :class:`Rejected`). A broker failure while settling never ends the stream: it opens
the subscription again and the broker delivers what was not settled once more (the dedupe
window drops what was handled).

A failure that says a dependency cannot be reached just now (:func:`dependency_unavailable`: a
database restarting or failing over, a lost link) is not the message's: it is not counted
against ``max_attempts``, nor given back to the broker (whose count of deliveries would grow
to its delivery limit, RabbitMQ's ``delivery_limit``, and dead-letter a good message). A handler
that fails so is called again on the same delivery, in place, after a pause that grows to
``outage_cap``, for as long as the dependency stays down; a commit (``before_ack``, below) that
fails so has its batch handled again and committed in place the same way. One line is logged
when the waiting starts, one when it ends.

A handler whose work must be durable before its message is acked can do that work for a whole
batch at once: ``before_ack`` is awaited before the handled messages waiting for their ack are
acked (and remembered as handled), so one commit serves up to ``ack_batch`` messages instead of
one each (the approver with a database: :mod:`consumers._approver`). It may instead return an
awaitable for the part that makes the batch durable (a write under way): with ``pipeline`` the
stream then handles the next batch meanwhile, and acks this one once that awaitable is done.
What a batch changed is fixed when ``before_ack`` returns. When a commit fails, nothing more is
acked on that subscription (an ack *through* a later delivery would ack the failed batch too):
what later commits stored is remembered, the subscription is opened again, and the broker
delivers the failed batch once more. It is group commit: a batch
is flushed when it is full, when the stream has nothing more to read (``ack_interval`` after the
last message handled), or when its first message has waited ``ack_max_delay`` behind a backlog;
so under a burst each commit serves a full batch, and a lone message is committed at once. When
it fails, they are neither acked nor remembered: the subscription is opened again and the broker
delivers them once more. A commit that fails because a dependency is unavailable costs no
delivery instead: the deliveries not acked since are kept, and once the pause is over they are
handled again, in order, as if the broker delivered them once more (the dedupe window drops what
a later commit stored, ``recall`` is asked about each), and committed then. A stop lets a commit
under way finish and ack its batch, for at most
``stop_grace`` seconds (a database that stopped answering does not hold the stop for ever).

A consumer group scales out by running more processes on the same group name: the broker shares
the group's queue between them (``exclusive=True``: one active consumer at a time, in order).
The dedupe window is the process's own; a redelivery it does not know may have been handled by
another process of the group (the active one whose link died after its commit): ``recall``
asks the group's durable state about such a message before any handler gets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar, cast, runtime_checkable

from schemas import (
    LifecycleMessage,
    MessageType,
    NewerMessage,
    PublishNotConfirmed,
    RelayError,
    SchemaError,
    TransportError,
    UnknownMessageType,
    VersionMismatch,
    decode,
    decode_newer,
)
from schemas._backoff import Backoff
from schemas.messages import content_digest, loads
from schemas.origin import OriginVerifier
from schemas.transport import Delivery, Subscription, Transport

from ._dedupe import DedupeWindow
from ._filters import MessageFilter
from ._origin import Origin, Unauthenticated, authenticate

__all__ = [
    "DeadLetterReason",
    "FleetStream",
    "Rejected",
    "StreamStats",
    "classify_bad_input",
    "dependency_unavailable",
]

log = logging.getLogger(__name__)

Handler = Callable[[Any], Awaitable[object]]
#: (vm casefolded, message id): what the dedupe window remembers a message by.
_Key = tuple[str, str]
#: A message handled, until the dedupe window remembers it: (its digest, its party there).
_Handled = tuple[str, str | None]
#: The origins whose broker user the dedupe window's fairness goes by (:meth:`FleetStream._party`,
#: asked for every message: a set made once, not enum members read from their class each time).
_BROKER_USER_ORIGINS = frozenset({Origin.VM_USER, Origin.SCALE_SET_USER})
H = TypeVar("H", bound=Handler)

#: Longest pause before the subscription is opened again after a broker failure.
_REOPEN_CAP = 5.0
#: Longest pause between two tries of something whose dependency is unavailable (the default
#: of ``outage_cap``): a PostgreSQL restart or failover takes 10-60 s.
OUTAGE_CAP = 30.0
#: Unknown message types warned about one by one; past them, one warning says the rest are not.
_WARNED_TYPES = 20


class DeadLetterReason(StrEnum):
    """The ``dead_letter_reason`` of what a stream sets aside."""

    NOT_JSON = "not-json"
    NOT_CLOUDEVENT = "not-cloudevent"
    VERSION_MISMATCH = "version-mismatch"
    UNKNOWN_TYPE = "unknown-type"
    INVALID = "invalid"
    #: The sender may not speak for the VM the message describes (see :mod:`consumers._origin`).
    ORIGIN_MISMATCH = "origin-mismatch"
    #: Another message was handled under this id: one of them is not what it claims.
    ID_CONFLICT = "id-conflict"
    HANDLER_FAILED = "handler-failed"


class Rejected(RelayError):
    """Raised by a handler for a message that must never be handled: it is dead-lettered at
    once with ``reason`` (no retry)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def dependency_unavailable(error: BaseException) -> bool:
    """Whether ``error`` says a dependency cannot be reached just now, rather than that this
    message cannot be handled: a :class:`ConnectionError`, of which :class:`~schemas.TransportError`
    is one (what :mod:`consumers._db` raises when the database is unreachable, refuses
    connections, times out or is restarting; what a transport raises for a lost link), except
    :class:`~schemas.PublishNotConfirmed` (the broker refused one message). A database's refusal
    of a statement (:class:`~consumers._db.DatabaseError`: a constraint, a write conflict,
    another process's takeover) and every other error are the handler's own."""
    return isinstance(error, ConnectionError) and not isinstance(error, PublishNotConfirmed)


def classify_bad_input(raw: bytes, error: SchemaError) -> DeadLetterReason:
    """Why ``raw`` could not be decoded. Runs only on the failure path, so it may parse again."""
    if isinstance(error, VersionMismatch):
        return DeadLetterReason.VERSION_MISMATCH
    if isinstance(error, UnknownMessageType):
        return DeadLetterReason.UNKNOWN_TYPE
    try:
        data = loads(raw)
    except SchemaError:
        return DeadLetterReason.NOT_JSON
    if not isinstance(data, dict) or data.get("specversion") is None or "type" not in data:
        return DeadLetterReason.NOT_CLOUDEVENT
    return DeadLetterReason.INVALID


@runtime_checkable
class _AcksThrough(Protocol):
    """A delivery that can ack itself and every earlier one in one go (RabbitMQ's
    ``multiple`` ack); the stream then acks handled messages in batches."""

    async def ack_through(self) -> None: ...


_ACKS_THROUGH: dict[type, bool] = {}


def _acks_through(delivery: Delivery) -> bool:
    """``isinstance(delivery, _AcksThrough)``, remembered per class (a Protocol check is slow)."""
    kind = type(delivery)
    known = _ACKS_THROUGH.get(kind)
    if known is None:
        known = _ACKS_THROUGH[kind] = isinstance(delivery, _AcksThrough)
    return known


@dataclass(slots=True)
class StreamStats:
    """What the stream did with what it received (for logs, metrics and tests)."""

    received: int = 0
    handled: int = 0
    duplicates: int = 0
    filtered: int = 0
    skipped_unknown: int = 0
    retried: int = 0
    dead_lettered: int = 0
    #: Dead-lettered because the sender may not speak for the VM (counted in dead_lettered too).
    forged: int = 0
    #: Dead-lettered because another message was handled under the same id (idem).
    conflicts: int = 0
    #: Times the subscription was opened again after a broker failure.
    reconnects: int = 0
    #: Redeliveries the window did not know that ``recall`` found handled (by another process
    #: of the group, say): counted in duplicates (or conflicts) too.
    recalled: int = 0
    #: Pauses before trying again in place what failed because a dependency was unavailable
    #: (a handler on its message, a commit on its batch): one per try.
    waited: int = 0


@dataclass(slots=True)
class _Step:
    """Handled deliveries on their way to their ack: what they were (for the dedupe window),
    and ``before_ack``'s work for them, under way (None: nothing to wait for)."""

    deliveries: list[Delivery]
    handled: dict[_Key, _Handled]
    commit: asyncio.Future[None] | None


@dataclass(slots=True)
class _Outage:
    """A dependency found unavailable by a handler or a commit: since when, and the pauses
    between the tries in place (growing to ``outage_cap``)."""

    since: float
    backoff: Backoff
    tries: int = 0


@dataclass(frozen=True, slots=True)
class _Route:
    filter: MessageFilter
    handler: Handler
    all: bool


Admitted = LifecycleMessage | NewerMessage


class FleetStream:
    """The lifecycle messages of consumer group ``group``.

    ``origin``: who may speak for a VM (:class:`~consumers._origin.Origin`; ``signed`` needs a
    ``verifier`` with the trusted attestation CA); None checks nothing (a library user's
    choice; the services always pass one). ``newer``: a handler for
    well-formed messages of a type this version does not know in a major version it reads (a
    newer minor added it) — the audit records them; without one they are acked and skipped with
    a warning for each of the first 20 types (minor versions only add, so an agent upgraded
    first must not fill every older consumer's dead-letter queue; a sender inventing types
    must not fill the log). A type name no version writes is dead-lettered ``unknown-type``.
    ``max_attempts``: how many times a handler may fail on one message before it is
    dead-lettered (``handler-failed``); a failure that says a dependency is unavailable does not
    count. A handler says "my dependency is down, not this message is bad" by raising a
    :class:`ConnectionError`: :class:`~schemas.TransportError`, say (``raise
    TransportError("orders API unreachable") from exc``), what :mod:`consumers._db` raises for
    a database it cannot reach (see :func:`dependency_unavailable`). The stream then keeps the
    delivery (not requeued: the broker's count of deliveries does not grow) and calls the
    handlers again on it after a pause that grows from ``retry_delay`` to ``outage_cap``
    seconds, for as long as that failure repeats; ``before_ack`` may raise it too (its batch is
    then handled again and committed in place). ``dedupe``: the window of ids
    already handled. ``transient``: read a copy of the stream that exists only while this stream
    is open (see :meth:`~schemas.transport.Transport.subscribe`). ``before_ack``: awaited
    before handled messages are acked (see the module docstring). ``stop_grace``: how long a
    stop waits for that commit. ``recall``: for a redelivered message the window does not know,
    what was handled under its id where more than this process remembers (the group's durable
    state): the digest of that message (:func:`~schemas.messages.content_digest`; ``""``: its
    content is not known), or None when nothing was. A process that takes over a group's queue
    is given again what the one before handled and committed but could not ack: with it, that
    reaches no handler twice. ``pipeline``: the next batch is handled while ``before_ack``
    commits the last one (see the module docstring).
    """

    def __init__(
        self,
        transport: Transport,
        group: str,
        *,
        filter: MessageFilter | None = None,
        prefetch: int = 256,
        exclusive: bool = False,
        max_attempts: int = 5,
        dedupe: DedupeWindow | None = None,
        retry_delay: float = 0.05,
        ack_batch: int = 128,
        ack_interval: float = 0.02,
        ack_max_delay: float = 0.25,
        transient: bool = False,
        origin: Origin | None = None,
        verifier: OriginVerifier | None = None,
        newer: Handler | None = None,
        before_ack: Callable[[], Awaitable[Awaitable[None] | None]] | None = None,
        stop_grace: float = 10.0,
        recall: Callable[[Admitted], Awaitable[str | None]] | None = None,
        pipeline: bool = False,
        outage_cap: float = OUTAGE_CAP,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.transport = transport
        self.group = group
        self.filter = filter or MessageFilter()
        self._all = self.filter.matches_all
        self.prefetch = prefetch
        self.exclusive = exclusive
        self.transient = transient
        self.max_attempts = max_attempts
        self.dedupe = dedupe if dedupe is not None else DedupeWindow()
        self.retry_delay = retry_delay
        self.origin = origin
        self.verifier = verifier
        self.newer = newer
        self.before_ack = before_ack
        self.stop_grace = stop_grace
        self.recall = recall
        self.pipeline = pipeline
        #: Longest pause between two tries in place while a dependency is unavailable.
        self.outage_cap = outage_cap
        # Where the transport can ack many deliveries in one frame (or before_ack commits),
        # handled messages are acked in batches of up to ack_batch: ack_interval seconds after
        # the stream ran out of messages to read, or ack_max_delay after the batch's first.
        self.ack_batch = max(1, min(ack_batch, prefetch // 2 or 1))
        self.ack_interval = ack_interval
        self.ack_max_delay = max(ack_max_delay, ack_interval)
        #: When the oldest delivery waiting for its batch was handled (monotonic).
        self._batch_began: float | None = None
        self.stats = StreamStats()
        self._unacked: list[Delivery] = []
        #: Handled, not yet remembered in the dedupe window (before_ack comes first).
        self._unremembered: dict[_Key, _Handled] = {}
        #: With ``pipeline``: the batch whose before_ack is under way.
        self._inflight: _Step | None = None
        #: A before_ack failed since the subscription was opened (or since the deliveries kept
        #: were given to the handlers again): nothing more is acked on it (an ack through a
        #: later delivery would ack the failed batch's too).
        self._commit_failed = False
        #: A before_ack failed because a dependency is unavailable: the deliveries not acked
        #: since are kept (``_held``, in the order received) to be handled again in place
        #: (``_redeliver``) after ``_replay_pause``, instead of given back to the broker.
        self._replay_due = False
        self._replay_pause = 0.0
        self._held: list[Delivery] = []
        self._redeliver: deque[Delivery] = deque()
        #: The delivery last handed out again from ``_redeliver`` (``recall`` is asked about it).
        self._replayed: Delivery | None = None
        #: Commits failing because a dependency is unavailable, since the last one that worked.
        self._commit_outage: _Outage | None = None
        #: The pause in place under way, which :meth:`stop` ends.
        self._pausing: asyncio.Future[None] | None = None
        self._closing = False
        #: One flush at a time: an ack through a later delivery must not overtake a batch
        #: still waiting for before_ack.
        self._flushing = asyncio.Lock()
        #: The flusher's flush, which a stop lets finish (within ``stop_grace``).
        self._background_flush: asyncio.Future[None] | None = None
        #: Set when something waits for the flusher (a handled message to commit or ack, a
        #: batch whose commit is under way): an idle stream's flusher sleeps until then.
        self._flush_due = asyncio.Event()
        self._routes: list[_Route] = []
        self._subscription: Subscription | None = None
        self._iterator: AsyncIterator[Delivery] | None = None
        self._broken = False
        self._reopen = Backoff(0.1, _REOPEN_CAP)
        self._current: tuple[Delivery, Admitted] | None = None
        self._stopping = False
        self._waiting = False
        #: The run loop's wait was interrupted by this stream (see :meth:`_wake`).
        self._woken = False
        #: Waiting for the subscription's next delivery.
        self._receiving = False
        self._run_task: asyncio.Task[Any] | None = None
        self._warned_types: set[str] = set()
        #: The delivery whose message the handlers are given now (its ``sender``, say).
        self.current_delivery: Delivery | None = None

    # ------------------------------------------------------------------------------ handlers

    def on(
        self,
        *kinds: MessageType | str,
        event_type: str | list[str] | None = None,
        vm: str | list[str] | None = None,
        resource_group: str | list[str] | None = None,
        scale_set: str | list[str] | None = None,
    ) -> Callable[[H], H]:
        """Register an async handler for the messages that match (no kinds: every kind)."""
        route_filter = MessageFilter.of(
            kinds=kinds or None,
            event_type=event_type,
            vm=vm,
            resource_group=resource_group,
            scale_set=scale_set,
        )

        def register(handler: H) -> H:
            self._routes.append(_Route(route_filter, handler, route_filter.matches_all))
            return handler

        return register

    def add_handler(self, handler: Handler, filter: MessageFilter | None = None) -> None:
        chosen = filter or MessageFilter()
        self._routes.append(_Route(chosen, handler, chosen.matches_all))

    # ---------------------------------------------------------------------------- lifecycle

    async def open(self) -> None:
        """Subscribe (declaring the group's queue with the right exclusivity); networked
        transports start consuming now, so a missing entity fails here."""
        if self._subscription is not None:
            return
        subscription = self.transport.subscribe(
            self.group, prefetch=self.prefetch, exclusive=self.exclusive, transient=self.transient
        )
        start = getattr(subscription, "start", None)
        if start is not None:
            try:
                await start()
            except BaseException:
                await subscription.close()
                raise
        self._subscription = subscription
        self._iterator = aiter(subscription)
        self._broken = False
        self._commit_failed = False
        self._closing = False

    async def close(self, *, handled: bool = True) -> None:
        """Stop. The message the iteration returned last is acked when ``handled``, otherwise
        it goes back to the queue; unsettled deliveries return to the broker."""
        current, self._current = self._current, None
        self._closing = True  # what a commit fails now goes back to the broker
        try:
            async with asyncio.timeout(self.stop_grace):
                if current is not None:
                    if handled:
                        await self._handled(*current)
                    else:
                        await self._settle(current[0].retry(), current[0])
                await self._flush()
        except TimeoutError:
            log.warning(
                "group %s: the commit before the last acks took more than %g s: stopping "
                "without it; the broker delivers its messages again",
                self.group,
                self.stop_grace,
            )
            if self._background_flush is not None:
                self._background_flush.cancel()
        await self._drop_subscription()

    async def _drop_subscription(self) -> None:
        subscription, self._subscription = self._subscription, None
        self._iterator = None
        # Their channel is going: the broker delivers them again, and what was handled is
        # remembered (once committed), so a redelivery is dropped.
        async with self._flushing:
            previous, self._inflight = self._inflight, None
            if previous is not None:
                await self._complete(previous, ack=False)
            handled, self._unremembered = self._unremembered, {}
            await self._complete(_Step([], handled, await self._begin(handled)), ack=False)
            self._unacked.clear()
            # Kept to be handled again: the broker delivers them again instead.
            self._held.clear()
            self._redeliver.clear()
            self._replay_due = False
            self._replayed = None
        if subscription is not None:
            try:
                await subscription.close()
            except TransportError as exc:
                log.debug("group %s: closing the subscription failed: %s", self.group, exc)

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close(handled=exc_type is None)

    @property
    def subscribed(self) -> bool:
        """Whether the broker subscription is up (False while it is being opened again)."""
        return self._subscription is not None and not self._broken

    @property
    def settled(self) -> bool:
        """Whether it waits for its next delivery with every one handled so far committed and
        acked (or dropped, to come back)."""
        return (
            self._waiting
            and not self._broken
            and not self._to_commit
            and not self._held
            and not self._redeliver
            and not self._replay_due
        )

    @property
    def _to_commit(self) -> bool:
        """Whether handled deliveries wait for their commit or their ack (a batch filling, or
        one whose commit is under way)."""
        return bool(self._unacked or self._unremembered or self._inflight is not None)

    def stop(self) -> None:
        """Ask :meth:`run` to return after the message in hand (at once when idle)."""
        self._stopping = True
        pausing = self._pausing
        if pausing is not None and not pausing.done():
            pausing.set_result(None)  # a pause in place: the message stays with the broker
        if self._waiting:
            self._wake()

    def _wake(self) -> None:
        """Interrupt :meth:`run`'s wait (to stop, or, waiting for a delivery, to open the
        subscription again after a commit in the background failed: the broker sends nothing
        more while the prefetch window is full of what it must deliver again)."""
        if self._run_task is not None and not self._run_task.done():
            self._woken = True
            self._run_task.cancel()

    # ----------------------------------------------------------------------------- receiving

    async def _receive(self) -> Delivery:
        """The next delivery; after a broker failure (here or while settling) the subscription
        is opened again, with a capped, jittered pause, for as long as it takes. After a commit
        that failed because a dependency is unavailable, the deliveries kept are handed out
        again first (:meth:`_replay`)."""
        while True:
            if self._broken or self._iterator is None:
                if self._subscription is None and self._iterator is None and not self._broken:
                    raise RuntimeError(
                        "open the stream first: `async with FleetStream(...) as stream`"
                    )
                await self._reconnect()
                continue
            if self._replay_due:
                await self._replay()
                continue
            if self._redeliver:
                delivery = self._replayed = self._redeliver.popleft()
                return delivery
            try:
                self._receiving = True
                delivery = await anext(self._iterator)
            except TransportError as exc:
                log.warning(
                    "group %s: the subscription failed (%s); opening it again", self.group, exc
                )
                self._broken = True
                continue
            finally:
                self._receiving = False
            self._reopen.reset()
            return delivery

    async def _replay(self) -> None:
        """A commit failed because a dependency is unavailable: keep every delivery not acked
        since (what is handled but not committed is committed first, as when the subscription
        closes, so a later commit that works makes those duplicates), pause, then hand them
        out again in the order received, before anything new. The broker keeps them meanwhile
        as delivered once: its count does not grow, as it would were the subscription opened
        again (RabbitMQ's quorum queues count every return, and dead-letter at the limit)."""
        async with self._flushing:
            previous, self._inflight = self._inflight, None
            if previous is not None:
                await self._complete(previous)
            handled, self._unremembered = self._unremembered, {}
            batch, self._unacked = self._unacked, []
            self._batch_began = None
            await self._complete(_Step(batch, handled, await self._begin(handled)))
        if self._broken:
            return  # a failure of another kind: the broker delivers them all again
        self._replay_due = False
        if self._commit_outage is not None:  # still failing (not back since): pause first
            await self._pause(self._replay_pause)
        if self._broken or self._stopping:
            return
        # Every delivery not acked on this subscription is handed out again, in order, before
        # anything new: acks through a later one are safe again.
        self._redeliver = deque([*self._held, *self._redeliver])
        self._held.clear()
        self._commit_failed = False

    async def _reconnect(self) -> None:
        await self._drop_subscription()
        self._broken = True
        delay = self._reopen.next()
        await asyncio.sleep(delay)
        try:
            await self.open()
        except TransportError as exc:
            log.warning(
                "group %s: opening the subscription again failed (%s); next try in up to %.1f s",
                self.group,
                exc,
                _REOPEN_CAP,
            )
            return
        self.stats.reconnects += 1
        log.info("group %s: subscribed again; unsettled messages come back", self.group)

    # ---------------------------------------------------------------------------- iteration

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> LifecycleMessage:
        if self._iterator is None and not self._broken:
            raise RuntimeError("open the stream first: `async with FleetStream(...) as stream`")
        current, self._current = self._current, None
        if current is not None:
            await self._handled(*current)
        while True:
            try:
                delivery = await self._receive()
            except StopAsyncIteration:
                raise
            admitted = await self._admit(delivery)
            if admitted is None:
                continue
            if isinstance(admitted, NewerMessage):
                await self._handled(delivery, admitted)
                continue
            if not self._all and not self.filter.matches(admitted):
                self.stats.filtered += 1
                await self._settle(delivery.ack(), delivery)
                continue
            self._current = (delivery, admitted)
            self.current_delivery = delivery
            return admitted

    # ------------------------------------------------------------------------------ running

    async def run(self) -> None:
        """Dispatch every message to the matching handlers until :meth:`stop` or cancellation."""
        if not self._routes:
            raise RuntimeError("no handlers: register some with @stream.on(...) first")
        self._run_task = asyncio.current_task()
        self._stopping = False
        await self.open()
        flusher = asyncio.create_task(self._flush_regularly())
        try:
            while not self._stopping:
                self._waiting = True
                try:
                    delivery = await self._receive()
                except StopAsyncIteration:
                    break
                except asyncio.CancelledError:
                    task, woken, self._woken = self._run_task, self._woken, False
                    if woken and task is not None and task.uncancel() == 0:
                        if self._stopping:
                            break
                        continue  # the subscription is opened again
                    raise
                finally:
                    self._waiting = False
                await self.process(delivery, batch=True)
        finally:
            self._run_task = None
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
            await self.close(handled=False)

    async def process(self, delivery: Delivery, *, batch: bool = False) -> None:
        """Admit, filter, dispatch and settle one delivery (``batch``: the ack may wait for the
        batch, see ``ack_batch``)."""
        admitted = await self._admit(delivery)
        if admitted is None:
            return
        if isinstance(admitted, NewerMessage):
            handlers: list[Handler] = [self.newer] if self.newer is not None else []
        elif not self._all and not self.filter.matches(admitted):
            self.stats.filtered += 1
            await self._settle(delivery.ack(), delivery)
            return
        else:
            handlers = [r.handler for r in self._routes if r.all or r.filter.matches(admitted)]
        self.current_delivery = delivery
        outage: _Outage | None = None
        while True:
            try:
                for handler in handlers:
                    await handler(admitted)
            except Rejected as rejected:
                if outage is not None:
                    self._recovered(outage, _what(admitted))
                await self._dead_letter(delivery, rejected.reason, rejected.detail)
                return
            except Exception as exc:
                if not dependency_unavailable(exc):  # the handler's: retried, then dead-lettered
                    if outage is not None:
                        self._recovered(outage, _what(admitted))
                    await self._failed(delivery, admitted, exc)
                    return
                # Not the message's: tried again in place, the delivery kept.
                outage, pause = self._outage(
                    outage,
                    _what(admitted),
                    exc,
                    "the message is kept (not requeued) and its handlers called again in place",
                )
                await self._pause(pause)
                if self._stopping:
                    log.info(
                        "group %s: stopping while %s waits for its dependency: left with the "
                        "broker, which delivers it again",
                        self.group,
                        _what(admitted),
                    )
                    return
                continue
            break
        if outage is not None:
            self._recovered(outage, _what(admitted))
        await self._handled(delivery, admitted, batch=batch)

    def _outage(
        self, outage: _Outage | None, what: str, error: BaseException, kept: str
    ) -> tuple[_Outage, float]:
        """The outage ``what`` met (new when None) and the pause before its next try: logged
        when the outage begins, not at each try."""
        if outage is None:
            cap = max(self.retry_delay, self.outage_cap)
            outage = _Outage(time.monotonic(), Backoff(self.retry_delay, cap))
        pause = outage.backoff.next()
        outage.tries += 1
        self.stats.waited += 1
        if outage.tries == 1:
            log.warning(
                "group %s: %s failed because a dependency is unavailable (%s: %s): %s; next "
                "try in %.2g s, then less and less often (at most every %g s) for as long as "
                "it fails so, said again only when it works",
                self.group,
                what,
                type(error).__name__,
                str(error)[:300],
                kept,
                pause,
                outage.backoff.cap,
            )
        else:
            log.debug(
                "group %s: %s still failing (%s); next try in %.1f s",
                self.group,
                what,
                error,
                pause,
            )
        return outage, pause

    def _recovered(self, outage: _Outage, what: str) -> None:
        log.info(
            "group %s: %s works again after %.1f s waiting for its dependency (%d tries in place)",
            self.group,
            what,
            time.monotonic() - outage.since,
            outage.tries + 1,
        )

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds``, or until :meth:`stop`."""
        if self._stopping:
            return
        loop = asyncio.get_running_loop()
        pausing = self._pausing = loop.create_future()
        timer = loop.call_later(seconds, _resolve, pausing)
        try:
            await pausing
        finally:
            timer.cancel()
            self._pausing = None

    # ------------------------------------------------------------------------------ admitting

    async def _admit(self, delivery: Delivery) -> Admitted | None:
        """The message to handle, or None when it was settled here (bad, forged, duplicate,
        skipped)."""
        self.stats.received += 1
        body = delivery.body
        message: Admitted
        try:
            message = decode(body)
        except UnknownMessageType as exc:
            try:
                message = decode_newer(body)
            except SchemaError:
                await self._bad_input(delivery, body, exc)
                return None
            if self.newer is None:
                await self._skip_newer(delivery, exc)
                return None
        except SchemaError as exc:
            await self._bad_input(delivery, body, exc)
            return None
        except Exception as exc:  # the decoder promises SchemaError only
            # A decoder defect met by a hostile body: it costs that message, not the stream
            # (which would stop, and meet it again on every restart until the broker gave up).
            log.exception(
                "group %s: message %s could not be decoded (%s: %s, a defect of the decoder): "
                "dead-lettered (invalid)",
                self.group,
                delivery.message_id or "(no id)",
                type(exc).__name__,
                str(exc)[:300],
            )
            detail = f"the decoder failed: {type(exc).__name__}: {str(exc)[:900]}"
            await self._dead_letter(delivery, DeadLetterReason.INVALID.value, detail)
            return None
        if self.origin is not None:
            try:
                authenticate(message, delivery, self.origin, self.verifier)
            except Unauthenticated as exc:
                self.stats.forged += 1
                log.warning(
                    "group %s: message %s about VM %s from broker user %r dead-lettered "
                    "(origin-mismatch): %s",
                    self.group,
                    message.id,
                    vm_of(message),
                    delivery.sender,
                    exc,
                )
                await self._dead_letter(
                    delivery, DeadLetterReason.ORIGIN_MISMATCH.value, str(exc)[:1000]
                )
                return None
        key = message_key(message)
        seen = self.dedupe.get(key)
        if seen is None:
            pending = self._unremembered.get(key)
            if pending is None and self._inflight is not None:
                pending = self._inflight.handled.get(key)
            if pending is not None:
                seen = pending[0]
            if seen and self.before_ack is not None and seen != content_digest(message):
                # Other content under this id was handled in the batch not yet committed, and
                # the commit may yet refuse it (the audit finds there what contradicts its
                # ledger): commit that batch first, and judge this one on what was kept.
                await self._flush()
                if self._broken:
                    return None  # the batch was not acked: this one comes back with it
                if self._replay_due:  # kept to be handled again: this one too, after it
                    self._held.append(delivery)
                    return None
                seen = self.dedupe.get(key)
        replayed = delivery is self._replayed
        if seen is None and self.recall is not None and (delivery.delivery_count > 0 or replayed):
            seen = await self._recall(message)
            if seen is not None:
                self.stats.recalled += 1
                self.dedupe.add(key, seen, self._party(delivery))
        if seen is None:
            return message
        if seen and seen != content_digest(message):
            self.stats.conflicts += 1
            log.error(
                "group %s: message %s from VM %s says something else than the message handled "
                "under the same id: dead-lettered (id-conflict); one of them is not what it "
                "claims",
                self.group,
                message.id,
                vm_of(message),
            )
            await self._dead_letter(
                delivery,
                DeadLetterReason.ID_CONFLICT.value,
                f"id {message.id} was handled already with other content",
            )
            return None
        self.stats.duplicates += 1
        log.debug("group %s: message %s handled already: acked", self.group, message.id)
        await self._settle(delivery.ack(), delivery)
        return None

    def _party(self, delivery: Delivery) -> str | None:
        """Whose room a message takes in the dedupe window when it is full (see
        :class:`DedupeWindow`): who sent it, as far as the stream can tell, so that a sender
        flooding new ids evicts its own, however many VMs it names. With a broker-user origin
        (``vm-user``, ``scale-set-user``): the broker user that published, which
        :func:`authenticate` found may speak for the VM (one may speak for a whole scale set,
        ``<scale set>_<n>`` for any n). Otherwise None: the VM the message names. Signed: one
        attested VM cannot change it (the verifier binds each vmId to one name). Without an
        origin check (``any``, or none) the operator trusts the senders, who often share one
        broker user: a party per sender would make every VM one party, which a broken agent
        flooding new ids under its own name empties; a sender that invents VM names is what
        the check is for."""
        return delivery.sender if self.origin in _BROKER_USER_ORIGINS else None

    async def _recall(self, message: Admitted) -> str | None:
        """``recall``; when it fails, the message is handled (its handlers judge it again)."""
        assert self.recall is not None
        try:
            return await self.recall(message)
        except Exception as exc:
            log.warning(
                "group %s: could not find out whether redelivered message %s was handled "
                "already (%s): handling it",
                self.group,
                message.id,
                exc,
            )
            return None

    async def _bad_input(self, delivery: Delivery, body: bytes, exc: SchemaError) -> None:
        reason = classify_bad_input(body, exc)
        log.warning(
            "group %s: message %s dead-lettered (%s): %s",
            self.group,
            delivery.message_id or "(no id)",
            reason.value,
            str(exc)[:300],
        )
        await self._dead_letter(delivery, reason.value, str(exc)[:1000])

    async def _skip_newer(self, delivery: Delivery, exc: UnknownMessageType) -> None:
        self.stats.skipped_unknown += 1
        what, warned = str(exc), self._warned_types
        if what not in warned and len(warned) <= _WARNED_TYPES:
            warned.add(what)  # one past the limit: it stands for "the rest were announced"
            if len(warned) <= _WARNED_TYPES:
                log.warning(
                    "group %s: skipping a message type this version does not know (%s); a "
                    "newer agent sends it. Upgrade the consumers to handle it.",
                    self.group,
                    exc,
                )
            else:  # a newer minor adds a type or two, not dozens: someone invents them
                log.warning(
                    "group %s: more than %d message types this version does not know: the "
                    "others are skipped without a warning each (counted in the stream's "
                    "skipped_unknown)",
                    self.group,
                    _WARNED_TYPES,
                )
        await self._settle(delivery.ack(), delivery)

    # ------------------------------------------------------------------------------ settling

    async def _settle(self, operation: Awaitable[None], delivery: Delivery) -> bool:
        """Run one settlement; a broker failure marks the subscription for reopening (the
        broker delivers the message again) instead of ending the stream."""
        try:
            await operation
        except TransportError as exc:
            log.warning(
                "group %s: settling message %s failed (%s); the subscription is opened again "
                "and the broker delivers it again",
                self.group,
                delivery.message_id,
                exc,
            )
            self._broken = True
            return False
        return True

    async def _dead_letter(self, delivery: Delivery, reason: str, description: str) -> None:
        self.stats.dead_lettered += 1
        await self._settle(delivery.dead_letter(reason, description), delivery)

    async def _handled(self, delivery: Delivery, message: Admitted, *, batch: bool = False) -> None:
        self._unremembered[message_key(message)] = (
            content_digest(message),
            self._party(delivery),
        )
        self.stats.handled += 1
        if not self._unacked:
            self._batch_began = time.monotonic()
            self._flush_due.set()
        self._unacked.append(delivery)
        later = self.before_ack is not None or _acks_through(delivery)
        if batch and self.ack_batch > 1 and later:
            # Overdue is checked here too: a backlog may keep this loop from yielding to the
            # flusher.
            if len(self._unacked) >= self.ack_batch or self._overdue():
                await self._flush(wait=False)
            return
        await self._flush()

    async def _begin(self, handled: dict[_Key, _Handled]) -> asyncio.Future[None] | None:
        """``before_ack`` for what was handled: what is left to wait for (its failure too)."""
        if not handled or self.before_ack is None:
            return None
        try:
            durable = await self.before_ack()
        except Exception as exc:
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            return failed
        return None if durable is None else asyncio.ensure_future(durable)

    async def _complete(self, step: _Step, *, ack: bool = True) -> None:
        """Wait for ``step``'s commit, then remember its messages and ack them. When the
        commit failed, nothing is remembered and nothing more is acked on the subscription:
        because a dependency is unavailable, they are kept and handled again in place
        (:meth:`_keep`), with every delivery after them; otherwise the subscription is opened
        again (the broker delivers them again). What is committed after that is remembered
        but not acked."""
        if step.commit is not None:
            try:
                await step.commit
            except Exception as exc:
                self._commit_failed = True
                if ack and step.deliveries and not (self._broken or self._closing):
                    if self._replay_due:
                        # After one that failed because a dependency is unavailable (and, in a
                        # pipeline, for that: the approver's next commit expects what it did
                        # not write): handled again with it.
                        self._held += step.deliveries
                        return
                    if dependency_unavailable(exc):
                        self._keep(step, exc)
                        return
                # Its messages come back: the broker delivers them again.
                log.error(
                    "group %s: committing %d handled message(s) failed (%s): not acked; the "
                    "subscription is opened again and the broker delivers them again",
                    self.group,
                    len(step.handled),
                    exc,
                    # Ours say what happened (a database's refusal, a takeover): no traceback.
                    exc_info=None if isinstance(exc, RelayError) else exc,
                )
                self._broken = True
                return
        if step.handled and self._commit_outage is not None:
            self._recovered(self._commit_outage, "committing handled messages")
            self._commit_outage = None
        for key, (digest, party) in step.handled.items():
            self.dedupe.add(key, digest, party)
        batch = step.deliveries
        if ack and batch and self._commit_failed and not (self._broken or self._closing):
            self._held += batch  # stored: acked as duplicates when handed out again
            return
        if not ack or not batch or self._commit_failed or self._broken:
            return
        last = batch[-1]
        if _acks_through(last):
            await self._settle(cast(_AcksThrough, last).ack_through(), last)
            return
        for delivery in batch:
            if not await self._settle(delivery.ack(), delivery):
                return

    def _keep(self, step: _Step, error: BaseException) -> None:
        """``step``'s commit failed because a dependency is unavailable: its deliveries, and
        every one not acked after them, are handled again in place (:meth:`_replay`)."""
        self._held += step.deliveries
        self._replay_due = True
        self._commit_outage, self._replay_pause = self._outage(
            self._commit_outage,
            f"committing {len(step.handled)} handled message(s)",
            error,
            "they are kept (not acked, not given back to the broker), to be handled again and "
            "committed in place",
        )

    async def _flush(self, *, wait: bool = True) -> None:
        """Ack every handled delivery waiting for its batch (in one frame where the transport
        acks through), after ``before_ack``. With ``pipeline`` and not ``wait``, this batch's
        ``before_ack`` is started and the previous batch's completed: this batch is acked at
        the next flush."""
        async with self._flushing:
            batch, self._unacked = self._unacked, []
            self._batch_began = None
            handled, self._unremembered = self._unremembered, {}
            step = _Step(batch, handled, await self._begin(handled))
            previous, self._inflight = self._inflight, None
            if previous is not None:
                await self._complete(previous)
            if self.pipeline and not wait:
                self._inflight = step
                self._flush_due.set()
                return
            await self._complete(step)

    async def _flush_regularly(self) -> None:
        """Flush once the stream waits for its next delivery (nothing left to read: what it
        handled is committed now), or once a batch's first message waited ``ack_max_delay``
        while a backlog kept the stream reading; a full batch flushes as it fills. With nothing
        to commit or ack it sleeps until there is (an idle consumer sets no timer)."""
        while True:
            if not self._to_commit:
                self._flush_due.clear()
                await self._flush_due.wait()
            await asyncio.sleep(self.ack_interval)
            idle = self._waiting
            if idle or self._overdue():
                flush = asyncio.ensure_future(self._flush(wait=idle))
            elif self._inflight is not None and _done(self._inflight):
                flush = asyncio.ensure_future(self._ack_inflight())  # a backlog: read on
            else:
                continue
            # Shielded: a stop, which cancels this task, lets a commit under way finish and
            # ack its batch (close() waits for it) instead of cutting it off half done.
            self._background_flush = flush
            await asyncio.shield(flush)
            if (self._broken or self._replay_due) and self._receiving and self._waiting:
                self._wake()

    async def _ack_inflight(self) -> None:
        """Ack the batch whose commit is done (its room in the prefetch window is free then)."""
        async with self._flushing:
            previous, self._inflight = self._inflight, None
            if previous is not None:
                await self._complete(previous)

    def _overdue(self) -> bool:
        """Whether the first message of the batch waiting for its ack waited ``ack_max_delay``."""
        began = self._batch_began
        return began is not None and time.monotonic() - began >= self.ack_max_delay

    async def _failed(self, delivery: Delivery, message: Admitted, error: BaseException) -> None:
        attempt = delivery.delivery_count + 1
        what = f"{type(error).__name__}: {error}"
        kind = message.type.rsplit(".", 1)[-1]
        if attempt >= self.max_attempts:
            log.error(
                "group %s: message %s (%s) failed %d times, dead-lettered: %s",
                self.group,
                message.id,
                kind,
                attempt,
                what,
                exc_info=error,
            )
            await self._dead_letter(
                delivery,
                DeadLetterReason.HANDLER_FAILED.value,
                f"failed {attempt} times; last error {what}"[:1000],
            )
            return
        self.stats.retried += 1
        log.warning(
            "group %s: message %s (%s) failed (attempt %d of %d), retrying: %s",
            self.group,
            message.id,
            kind,
            attempt,
            self.max_attempts,
            what,
        )
        # Back off a little (capped, jittered) so a failing dependency gets a breath.
        backoff = Backoff(self.retry_delay, max(self.retry_delay, 1.0))
        backoff.attempt = attempt - 1
        await asyncio.sleep(backoff.next())
        await self._settle(delivery.retry(), delivery)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _what(message: Admitted) -> str:
    return f"message {message.id} ({message.type.rsplit('.', 1)[-1]})"


def _done(step: _Step) -> bool:
    return step.commit is None or step.commit.done()


def vm_of(message: Admitted) -> str:
    """The VM a message is from, as it names itself."""
    return message.vm_name if isinstance(message, NewerMessage) else message.vm.name


def message_key(message: Admitted) -> _Key:
    """What a message is known by: its VM (casefolded) and its id. Ids are the senders' own, so
    another VM's message under the same id is another message."""
    return (vm_of(message).casefold(), message.id)
