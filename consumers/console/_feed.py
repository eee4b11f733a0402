"""The live feed: changes coalesced on the server, one batch every ``interval``, to every page.

A burst of 10,000 messages becomes a few batches of changed rows (each row once per batch, in
chunks of at most ``chunk`` rows), not 10,000 redraws. Each page has a bounded queue; a page
that falls behind (its queue full) gets a fresh snapshot instead of the backlog. A new page
gets a snapshot first (``reset``), then the batches.

Server-sent events, one ``batch`` event per chunk::

    event: batch
    data: {"reset": true, "now": "...", "liveness": 150.0, "events": [...], "agents": [...],
           "removed": [...], "removed_agents": [...], "final": true}
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

from ._live import LiveFleet

__all__ = ["Feed", "Subscriber"]

log = logging.getLogger(__name__)

#: Seconds between keep-alive comments on an idle stream (proxies close silent connections).
KEEPALIVE_SECONDS = 15.0


class Subscriber:
    """One page's stream."""

    def __init__(self, size: int) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=size)
        self.needs_reset = True
        self.closed = False

    def offer(self, chunks: list[bytes]) -> None:
        if self.needs_reset:
            return  # a snapshot is coming: it holds these changes
        if self.queue.maxsize - self.queue.qsize() < len(chunks):
            # Behind: drop the backlog, send a snapshot instead.
            while not self.queue.empty():
                self.queue.get_nowait()
            self.needs_reset = True
            self.queue.put_nowait(b"")  # wake the writer
            return
        for chunk in chunks:
            self.queue.put_nowait(chunk)

    def close(self) -> None:
        self.closed = True
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(None)


class Feed:
    """Batches the changes of ``live`` every ``interval`` seconds to every subscriber."""

    def __init__(
        self,
        live: LiveFleet,
        *,
        interval: float = 0.25,
        chunk: int = 1000,
        queue_size: int = 256,
        liveness: float = 150.0,
    ) -> None:
        self.live = live
        self.interval = interval
        self.chunk = chunk
        self.queue_size = queue_size
        self.liveness = liveness
        self.subscribers: set[Subscriber] = set()
        self.batches = 0

    async def run(self) -> None:
        """Send a batch of what changed every ``interval`` seconds, until cancelled."""
        try:
            while True:
                await asyncio.sleep(self.interval)
                self.flush()
        finally:
            self.close()

    def close(self) -> None:
        """End every page's stream (the pages reconnect to whoever serves next)."""
        for subscriber in list(self.subscribers):
            subscriber.close()

    def flush(self) -> None:
        changes = self.live.take_changes()
        if changes is None:
            return
        self.batches += 1
        if not self.subscribers:
            return
        chunks = self._encode(changes, reset=False)
        for subscriber in list(self.subscribers):
            subscriber.offer(chunks)

    def _encode(self, changes: dict[str, Any], *, reset: bool) -> list[bytes]:
        now = datetime.now(UTC).isoformat()
        rows = [("events", row) for row in changes["events"]]
        rows += [("agents", row) for row in changes["agents"]]
        pieces: list[dict[str, Any]] = []
        for start in range(0, max(len(rows), 1), self.chunk):
            piece: dict[str, Any] = {"events": [], "agents": []}
            for kind, row in rows[start : start + self.chunk]:
                piece[kind].append(row)
            pieces.append(piece)
        pieces[0]["reset"] = reset
        pieces[-1]["removed"] = changes["removed"]
        pieces[-1]["removed_agents"] = changes["removed_agents"]
        pieces[-1]["final"] = True
        out = []
        for piece in pieces:
            piece["now"] = now
            piece["liveness"] = self.liveness
            text = json.dumps(piece, separators=(",", ":"))
            out.append(f"event: batch\ndata: {text}\n\n".encode())
        return out

    def snapshot(self) -> list[bytes]:
        events, agents = self.live.snapshot()
        return self._encode(
            {"events": events, "agents": agents, "removed": [], "removed_agents": []}, reset=True
        )

    async def stream(
        self,
        *,
        until: float | None = None,
        keepalive: float = KEEPALIVE_SECONDS,
        holds: Callable[[], bool] | None = None,
    ) -> AsyncIterator[bytes]:
        """One page's server-sent events: a snapshot, then the batches; ends at ``until``
        (loop time: the session's expiry), when the feed closes, or when ``holds()`` (asked
        before every snapshot, batch and keep-alive) says the session no longer holds."""
        subscriber = Subscriber(self.queue_size)
        self.subscribers.add(subscriber)
        loop = asyncio.get_running_loop()
        try:
            yield b"retry: 2000\n\n"
            while not subscriber.closed:
                if subscriber.needs_reset:
                    if holds is not None and not holds():
                        return
                    subscriber.needs_reset = False
                    for chunk in self.snapshot():
                        yield chunk
                timeout = keepalive
                if until is not None:
                    timeout = min(timeout, until - loop.time())
                    if timeout <= 0:
                        return
                try:
                    chunk_or_none = await asyncio.wait_for(subscriber.queue.get(), timeout)
                except TimeoutError:
                    chunk_or_none = b": keep-alive\n\n"
                if chunk_or_none is None or (holds is not None and not holds()):
                    return
                if chunk_or_none:
                    yield chunk_or_none
        finally:
            self.subscribers.discard(subscriber)
