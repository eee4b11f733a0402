"""The outbox publisher: sends what the state store holds, oldest first, one at a time.

A row is deleted only after the broker confirmed it. When the transport fails the row stays and
is tried again after a short jittered delay (capped at half a second, so publishing resumes
within a second of the broker coming back). Replays carry the stored bytes: same id, same body.

A row that can never be sent does not block the rows behind it, and is never thrown away: one
the agent cannot read back (a cell of the wrong type, a body that is no message: a hand edit, a
downgrade or a damaged disk could do that) or one the broker refuses for good
(:class:`~schemas.MessageRefused`, over its size limit) is set aside in its own table, counted
in ``agent_outbox_set_aside``, logged once, and reported by ``/healthz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

from schemas import MessageRefused, SchemaError, TransportError, decode
from schemas._backoff import Backoff
from schemas.messages import MAX_MESSAGE_BYTES
from schemas.transport import Transport
from schemas.wire import lifecycle_message

from ._observability import Metrics
from ._state import OutboxRow, StateStore

__all__ = ["OutboxPublisher"]

log = logging.getLogger(__name__)

#: Check the store now and then even without a wake-up. Every commit wakes the publisher and
#: the rows a previous run left are read at start, so this is a safety net only: every 30 s (a
#: store read each time; every 5 s it was most of an idle agent's state traffic).
_IDLE_RECHECK = 30.0


class OutboxPublisher:
    """Run :meth:`run` in a task; call :meth:`notify` after each commit.

    ``failing_since`` (monotonic) is set while publishing fails, for ``/healthz``; ``depth``
    and ``oldest`` are the live outbox (updated on every publish, not only on commit)."""

    def __init__(
        self,
        store: StateStore,
        transport: Transport,
        metrics: Metrics,
        *,
        publish_timeout: float = 10.0,
        connected: asyncio.Event | None = None,
        sign: Callable[[bytes], Mapping[str, str]] | None = None,
        signing_ready: asyncio.Event | None = None,
    ) -> None:
        self._store = store
        self._transport = transport
        self._metrics = metrics
        self._timeout = publish_timeout
        self._connected = connected
        self._sign = sign
        self._signing_ready = signing_ready
        self._wake = asyncio.Event()
        #: Set while the outbox is known to be empty.
        self.empty = asyncio.Event()
        self.backoff = Backoff(0.05, 0.5)
        self.failing_since: float | None = None
        #: Monotonic time since which rows wait with no publish confirmed (None when empty):
        #: a publish stuck waiting for a confirm counts too, not only one that failed.
        self.stalled_since: float | None = None
        self.last_error: str | None = None
        self.depth = 0
        #: Wall-clock time the oldest row still waiting was written; None when empty.
        self.oldest: float | None = None
        self.set_aside = 0

    def notify(self) -> None:
        self.empty.clear()
        self._wake.set()

    async def refresh(self) -> None:
        """Read the depth, the oldest row and the rows set aside from the store."""
        self.depth = await self._store.depth()
        self.oldest = await self._store.oldest()
        self.set_aside = await self._store.set_aside_count()
        self._metrics.outbox_depth.set(self.depth)
        self._metrics.outbox_set_aside.set(self.set_aside)

    async def run(self) -> None:
        """Publish until cancelled."""
        await self.refresh()
        if self._connected is not None:
            await self._connected.wait()
        if self._signing_ready is not None:
            await self._signing_ready.wait()  # nothing goes out unsigned
        while True:
            self._wake.clear()
            rows = await self._store.pending()
            if not rows:
                self.depth, self.oldest = 0, None
                self.stalled_since = None
                self._metrics.outbox_depth.set(0)
                self.empty.set()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_IDLE_RECHECK):
                        await self._wake.wait()
                continue
            self.empty.clear()
            self.oldest = next((r.created for r in rows if r.unreadable is None), None)
            if self.stalled_since is None:
                self.stalled_since = time.monotonic()
            for row in rows:
                if not await self._publish(row):
                    delay = self.backoff.next()
                    await asyncio.sleep(delay)
                    break
                self.backoff.reset()

    async def _publish(self, row: OutboxRow) -> bool:
        """True when the row is gone from the outbox (confirmed, or set aside)."""
        if row.unreadable is not None:
            await self._set_aside(row, "unreadable", f"the stored row: {row.unreadable}")
            return True
        try:
            message = decode(row.body)
        except SchemaError as exc:
            await self._set_aside(row, "unreadable", f"cannot be read back: {exc}")
            return True
        outgoing = lifecycle_message(message)
        if self._sign is not None:
            signed = {**outgoing.properties, **self._sign(outgoing.body)}
            outgoing = dataclasses.replace(outgoing, properties=signed)
        if len(outgoing.body) > MAX_MESSAGE_BYTES:
            await self._set_aside(row, "refused", f"{len(outgoing.body)} bytes is over the limit")
            return True
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the result and drops
            # a cancel that arrives as the publish completes, and the publisher, cancelled by a
            # stop or by another part of the agent failing, went back to waiting for work.
            async with asyncio.timeout(self._timeout):
                await self._transport.publish(outgoing)
        except MessageRefused as exc:
            await self._set_aside(row, "refused", str(exc))
            return True
        except (TransportError, TimeoutError) as exc:
            self._metrics.publish_failures.inc()
            if self.failing_since is None:
                self.failing_since = time.monotonic()
            self.last_error = str(exc) or type(exc).__name__
            log.warning(
                "publishing %s %s failed (%r); kept in the outbox, retrying",
                row.kind,
                row.message_id,
                exc,
            )
            return False
        self.failing_since = None
        self.stalled_since = time.monotonic()
        self.last_error = None
        latency = max(time.time() - row.created, 0.0)
        self._metrics.publish_latency.observe(latency)
        # The kind the message says, not the row's own cell: a label is made for each value.
        self._metrics.published.labels(message.kind.value).inc()
        self.depth = await self._store.delete(row.sequence)
        self._metrics.outbox_depth.set(self.depth)
        log.debug(
            "published %s %s seq=%d in %.3f s", row.kind, row.message_id, row.sequence, latency
        )
        return True

    async def _set_aside(self, row: OutboxRow, why: str, reason: str) -> None:
        self.depth = await self._store.set_aside(row, why, reason)
        self.set_aside += 1
        self._metrics.outbox_set_aside.set(self.set_aside)
        self._metrics.outbox_depth.set(self.depth)
        log.error(
            "outbox row %d (%s %s) set aside, %s: %s; it is kept in the state store "
            "(outbox_set_aside) and the messages behind it go on",
            row.sequence,
            row.kind,
            row.message_id,
            why,
            reason,
        )

    async def drain(self, timeout: float) -> bool:  # noqa: ASYNC109
        """Wait until the outbox is empty; False when ``timeout`` passed first."""
        self.notify()
        try:
            async with asyncio.timeout(timeout):
                while True:
                    await self.empty.wait()
                    if await self._store.depth() == 0:
                        return True
                    self.notify()
                    await asyncio.sleep(0.05)
        except TimeoutError:
            return False
