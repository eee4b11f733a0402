"""The outbox publisher: sends what the state store holds, oldest first, one at a time.

A row is deleted only after the broker confirmed it. When the transport fails the row stays and
is tried again after a short jittered delay (capped at half a second, so publishing resumes
within a second of the broker coming back). Replays carry the stored bytes: same id, same body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from schemas import SchemaError, TransportError, decode
from schemas.transport import Transport
from schemas.wire import lifecycle_message

from ._backoff import Backoff
from ._observability import Metrics
from ._state import OutboxRow, StateStore

__all__ = ["OutboxPublisher"]

log = logging.getLogger(__name__)

#: Check the store now and then even without a wake-up (rows left by a previous run).
_IDLE_RECHECK = 5.0


class OutboxPublisher:
    """Run :meth:`run` in a task; call :meth:`notify` after each commit."""

    def __init__(
        self,
        store: StateStore,
        transport: Transport,
        metrics: Metrics,
        *,
        publish_timeout: float = 10.0,
        connected: asyncio.Event | None = None,
    ) -> None:
        self._store = store
        self._transport = transport
        self._metrics = metrics
        self._timeout = publish_timeout
        self._connected = connected
        self._wake = asyncio.Event()
        #: Set while the outbox is known to be empty.
        self.empty = asyncio.Event()
        self.backoff = Backoff(0.05, 0.5)

    def notify(self) -> None:
        self.empty.clear()
        self._wake.set()

    async def run(self) -> None:
        """Publish until cancelled."""
        if self._connected is not None:
            await self._connected.wait()
        while True:
            self._wake.clear()
            rows = await self._store.pending()
            if not rows:
                self.empty.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), _IDLE_RECHECK)
                continue
            self.empty.clear()
            for row in rows:
                if not await self._publish(row):
                    delay = self.backoff.next()
                    await asyncio.sleep(delay)
                    break
                self.backoff.reset()

    async def _publish(self, row: OutboxRow) -> bool:
        """True when the row was confirmed (or could never be sent) and is gone."""
        try:
            outgoing = lifecycle_message(decode(row.body))
        except SchemaError as exc:
            # Only a downgrade of the agent could make its own stored message unreadable.
            log.error(
                "outbox row %d (%s) cannot be decoded, dropped: %s",
                row.sequence,
                row.message_id,
                exc,
            )
            await self._store.delete(row.sequence)
            return True
        try:
            await asyncio.wait_for(self._transport.publish(outgoing), self._timeout)
        except (TransportError, TimeoutError) as exc:
            self._metrics.publish_failures.inc()
            log.warning(
                "publishing %s %s failed (%r); kept in the outbox, retrying",
                row.kind,
                row.message_id,
                exc,
            )
            return False
        latency = max(time.time() - row.created, 0.0)
        self._metrics.publish_latency.observe(latency)
        self._metrics.published.labels(row.kind).inc()
        depth = await self._store.delete(row.sequence)
        self._metrics.outbox_depth.set(depth)
        log.debug(
            "published %s %s seq=%d in %.3f s", row.kind, row.message_id, row.sequence, latency
        )
        return True

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
