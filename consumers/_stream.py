"""The fleet stream: every lifecycle message of the fleet, typed, filtered, deduplicated, with
bad input dead-lettered and failing handlers retried a bounded number of times.

Two ways to read it::

    async with FleetStream(transport, "audit") as stream:      # iteration
        async for message in stream:
            print(message.kind, message.vm.name)  # acked when the next one is asked for

    stream = FleetStream(transport, "approver", exclusive=True)  # handlers
    @stream.on(MessageType.STARTED, event_type="Reboot")
    async def started(message: TransitionMessage) -> None: ...
    await stream.run()

A consumer group scales out by running more processes on the same group name: the broker shares
the group's queue between them (``exclusive=True``: one active consumer at a time, in order).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar, runtime_checkable

from schemas import (
    AgentMessage,
    ApprovalOutcomeMessage,
    HookResultMessage,
    LifecycleMessage,
    MessageType,
    SchemaError,
    TransitionMessage,
    TransportError,
    UnknownMessageType,
    VersionMismatch,
    decode,
)
from schemas.channels import TYPE_PREFIX
from schemas.transport import Delivery, Subscription, Transport

from ._dedupe import DedupeWindow
from ._filters import MessageFilter

__all__ = [
    "DeadLetterReason",
    "FleetStream",
    "StreamStats",
    "classify_bad_input",
]

log = logging.getLogger(__name__)

Handler = Callable[[Any], Awaitable[object]]
H = TypeVar("H", bound=Handler)


class DeadLetterReason(StrEnum):
    """The ``dead_letter_reason`` of what a stream sets aside."""

    NOT_JSON = "not-json"
    NOT_CLOUDEVENT = "not-cloudevent"
    VERSION_MISMATCH = "version-mismatch"
    UNKNOWN_TYPE = "unknown-type"
    INVALID = "invalid"
    HANDLER_FAILED = "handler-failed"


_TYPE = re.compile(rb'"type"\s*:\s*"([^"]{1,200})"')
_ENVELOPE_OF: dict[bytes, type[Any]] = {
    kind.cloudevents_type.encode(): envelope
    for envelope in (TransitionMessage, ApprovalOutcomeMessage, AgentMessage, HookResultMessage)
    for kind in envelope.kinds
}


def fast_decode(raw: bytes) -> LifecycleMessage:
    """:func:`schemas.decode`, in one pass of pydantic's own JSON parser when the ``type`` can
    be read off the bytes. The envelope validates everything ``decode`` checks (specversion,
    schemaversion, type), so a success is the same message; on any doubt ``decode`` decides
    (and says what is wrong)."""
    match = _TYPE.search(raw)
    envelope = _ENVELOPE_OF.get(match.group(1)) if match is not None else None
    if envelope is not None:
        try:
            message: LifecycleMessage = envelope.model_validate_json(raw)
        except ValueError:
            pass
        else:
            return message
    return decode(raw)


def classify_bad_input(raw: bytes, error: SchemaError) -> DeadLetterReason:
    """Why ``raw`` could not be decoded. Runs only on the failure path, so it may parse again."""
    if isinstance(error, VersionMismatch):
        return DeadLetterReason.VERSION_MISMATCH
    if isinstance(error, UnknownMessageType):
        return DeadLetterReason.UNKNOWN_TYPE
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return DeadLetterReason.NOT_JSON
    if not isinstance(data, dict) or data.get("specversion") is None or "type" not in data:
        return DeadLetterReason.NOT_CLOUDEVENT
    return DeadLetterReason.INVALID


def _is_newer_minor_type(error: UnknownMessageType, raw: bytes) -> bool:
    """A type of ours we do not know, in a major version we read: a newer minor added it."""
    try:
        type_ = json.loads(raw).get("type", "")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False
    return isinstance(type_, str) and type_.startswith(TYPE_PREFIX + ".")


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


@dataclass(frozen=True, slots=True)
class _Route:
    filter: MessageFilter
    handler: Handler
    all: bool


class FleetStream:
    """The lifecycle messages of consumer group ``group``.

    ``max_attempts``: how many times a handler may fail on one message before it is
    dead-lettered (``handler-failed``). ``dedupe``: the window of ids already handled.
    ``transient``: read a copy of the stream that exists only while this stream is open (see
    :meth:`~schemas.transport.Transport.subscribe`), for a viewer that must leave nothing
    behind; a durable group keeps collecting messages after its last consumer stops.

    Bad input never stops the stream: a message that is not JSON, not a CloudEvent, of another
    major version or invalid is dead-lettered with its reason. A well-formed message of *our*
    type prefix with a type this code does not know, in a major version it reads, is acked and
    skipped with a warning: minor versions only add, so an agent upgraded first must not fill
    every older consumer's dead-letter queue. A foreign type is dead-lettered (``unknown-type``).
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
        transient: bool = False,
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
        # Where the transport can ack many deliveries in one frame, handled messages are acked
        # in batches of up to ack_batch, at the latest ack_interval seconds after handling.
        self.ack_batch = max(1, min(ack_batch, prefetch // 2 or 1))
        self.ack_interval = ack_interval
        self._unacked: list[Delivery] = []
        self.stats = StreamStats()
        self._routes: list[_Route] = []
        self._subscription: Subscription | None = None
        self._iterator: AsyncIterator[Delivery] | None = None
        self._current: tuple[Delivery, LifecycleMessage] | None = None
        self._stopping = False
        self._waiting = False
        self._run_task: asyncio.Task[Any] | None = None
        self._warned_types: set[str] = set()

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
        if self._subscription is None:
            # subscribe() declares the group's queue with the right exclusivity (declaring it
            # first with declare_group would fix it as shared on RabbitMQ).
            self._subscription = self.transport.subscribe(
                self.group,
                prefetch=self.prefetch,
                exclusive=self.exclusive,
                transient=self.transient,
            )
            self._iterator = aiter(self._subscription)
            start = getattr(self._subscription, "start", None)
            if start is not None:  # networked transports: consume now, fail early
                await start()

    async def close(self, *, handled: bool = True) -> None:
        """Stop. The message the iteration returned last is acked when ``handled``, otherwise
        it goes back to the queue; unsettled deliveries return to the broker."""
        current, self._current = self._current, None
        if current is not None:
            if handled:
                await self._done(*current)
            else:
                await self._failed(current[0], current[1], None)
        subscription, self._subscription = self._subscription, None
        self._iterator = None
        if subscription is not None:
            await subscription.close()

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

    def stop(self) -> None:
        """Ask :meth:`run` to return after the message in hand (at once when idle)."""
        self._stopping = True
        if self._waiting and self._run_task is not None and not self._run_task.done():
            self._run_task.cancel()

    # ---------------------------------------------------------------------------- iteration

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> LifecycleMessage:
        if self._iterator is None:
            raise RuntimeError("open the stream first: `async with FleetStream(...) as stream`")
        current, self._current = self._current, None
        if current is not None:
            await self._done(*current)
        while True:
            delivery = await anext(self._iterator)
            message = await self._admit(delivery)
            if message is None:
                continue
            if not self.filter.matches(message):
                self.stats.filtered += 1
                await delivery.ack()
                continue
            self._current = (delivery, message)
            return message

    # ------------------------------------------------------------------------------ running

    async def run(self) -> None:
        """Dispatch every message to the matching handlers until :meth:`stop` or cancellation."""
        if not self._routes:
            raise RuntimeError("no handlers: register some with @stream.on(...) first")
        self._run_task = asyncio.current_task()
        self._stopping = False
        await self.open()
        assert self._iterator is not None
        flusher = asyncio.create_task(self._flush_regularly())
        try:
            while not self._stopping:
                self._waiting = True
                try:
                    delivery = await anext(self._iterator)
                except StopAsyncIteration:
                    break
                except asyncio.CancelledError:
                    task = self._run_task
                    if self._stopping and task is not None and task.uncancel() == 0:
                        break
                    raise
                finally:
                    self._waiting = False
                await self.process(delivery, batch=True)
        finally:
            self._run_task = None
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
            await self._flush()
            await self.close(handled=False)

    async def process(self, delivery: Delivery, *, batch: bool = False) -> None:
        """Parse, dedupe, filter, dispatch and settle one delivery (``batch``: the ack may wait
        for the batch, see ``ack_batch``)."""
        message = await self._admit(delivery)
        if message is None:
            return
        if not self._all and not self.filter.matches(message):
            self.stats.filtered += 1
            await delivery.ack()
            return
        try:
            for route in self._routes:
                if route.all or route.filter.matches(message):
                    await route.handler(message)
        except Exception as exc:  # a handler's failure: retried, then dead-lettered
            await self._failed(delivery, message, exc)
            return
        await self._done(delivery, message, batch=batch)

    # ------------------------------------------------------------------------------ settling

    async def _admit(self, delivery: Delivery) -> LifecycleMessage | None:
        """The message to handle, or None when it was settled here (bad, duplicate, skipped)."""
        self.stats.received += 1
        body = delivery.body
        try:
            message = fast_decode(body)
        except SchemaError as exc:
            if isinstance(exc, UnknownMessageType) and _is_newer_minor_type(exc, body):
                self.stats.skipped_unknown += 1
                if str(exc) not in self._warned_types:
                    self._warned_types.add(str(exc))
                    log.warning(
                        "group %s: skipping a message type this version does not know (%s); "
                        "a newer agent sends it. Upgrade the consumers to handle it.",
                        self.group,
                        exc,
                    )
                await delivery.ack()
                return None
            reason = classify_bad_input(body, exc)
            self.stats.dead_lettered += 1
            log.warning(
                "group %s: message %s dead-lettered (%s): %s",
                self.group,
                delivery.message_id or "(no id)",
                reason.value,
                exc,
            )
            await delivery.dead_letter(reason.value, str(exc)[:1000])
            return None
        if message.id in self.dedupe:
            self.stats.duplicates += 1
            log.debug("group %s: message %s handled already: acked", self.group, message.id)
            await delivery.ack()
            return None
        return message

    async def _done(
        self, delivery: Delivery, message: LifecycleMessage, *, batch: bool = False
    ) -> None:
        self.dedupe.add(message.id)
        self.stats.handled += 1
        if batch and self.ack_batch > 1 and _acks_through(delivery):
            self._unacked.append(delivery)
            if len(self._unacked) >= self.ack_batch:
                await self._flush()
            return
        await delivery.ack()

    async def _flush(self) -> None:
        """Ack every handled delivery waiting for its batch, in one frame."""
        if not self._unacked:
            return
        batch, self._unacked = self._unacked, []
        last = batch[-1]
        assert isinstance(last, _AcksThrough)
        try:
            await last.ack_through()
        except TransportError as exc:
            # The link went: the broker delivers them again, and the dedupe window drops them.
            log.warning(
                "group %s: acking %d handled messages failed: %s", self.group, len(batch), exc
            )

    async def _flush_regularly(self) -> None:
        while True:
            await asyncio.sleep(self.ack_interval)
            await self._flush()

    async def _failed(
        self, delivery: Delivery, message: LifecycleMessage, error: BaseException | None
    ) -> None:
        attempt = delivery.delivery_count + 1
        what = "the consumer stopped" if error is None else f"{type(error).__name__}: {error}"
        if error is not None and attempt >= self.max_attempts:
            self.stats.dead_lettered += 1
            log.error(
                "group %s: message %s (%s) failed %d times, dead-lettered: %s",
                self.group,
                message.id,
                message.kind.value,
                attempt,
                what,
                exc_info=error,
            )
            await delivery.dead_letter(
                DeadLetterReason.HANDLER_FAILED.value,
                f"failed {attempt} times; last error {what}"[:1000],
            )
            return
        self.stats.retried += 1
        if error is not None:
            log.warning(
                "group %s: message %s (%s) failed (attempt %d of %d), retrying: %s",
                self.group,
                message.id,
                message.kind.value,
                attempt,
                self.max_attempts,
                what,
            )
            # Back off a little (capped, jittered) so a failing dependency gets a breath.
            delay = min(self.retry_delay * 2 ** (attempt - 1), 1.0)
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
        await delivery.retry()
