"""How often the agent asks IMDS: a request limiter for every call, and an adaptive cadence.

IMDS throttles a VM above 5 requests per second (429). :class:`RequestLimiter` is a sliding
window over every request the agent makes (polls, approval POSTs, identity, approval checks), so
no one-second window ever holds more than the limit. :class:`Cadence` polls once per
``poll_interval``, faster for a while after a change or an approval, and while a Scheduled
event's NotBefore is near.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

from schemas import ScheduledEvent

__all__ = ["Cadence", "RequestLimiter"]

#: Extra spacing so requests that arrive late at IMDS still fall into separate windows.
_WINDOW_MARGIN = 0.02


class RequestLimiter:
    """At most ``max_requests`` starts in any ``period`` seconds."""

    def __init__(
        self,
        max_requests: int = 5,
        period: float = 1.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_requests = max_requests
        self.period = period + _WINDOW_MARGIN
        self._clock = clock
        self._starts: deque[float] = deque(maxlen=max_requests)
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        """Wait (bounded by ``period``) until one more request fits in the window."""
        async with self._lock:
            if len(self._starts) == self.max_requests:
                wait = self._starts[0] + self.period - self._clock()
                if wait > 0:
                    await asyncio.sleep(wait)
            self._starts.append(self._clock())


class Cadence:
    """When the next poll is due. ``boost()`` (a change, an approval) makes polling fast for
    ``fast_seconds``; ``wake()`` makes the next poll due now."""

    def __init__(
        self,
        interval: float,
        fast_interval: float,
        fast_seconds: float,
        lead_seconds: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.fast_interval = min(fast_interval, interval)
        self.fast_seconds = fast_seconds
        self.lead_seconds = lead_seconds
        self._clock = clock
        self._fast_until = 0.0
        self._woken = asyncio.Event()

    def boost(self) -> None:
        self._fast_until = self._clock() + self.fast_seconds

    def wake(self) -> None:
        self.boost()
        self._woken.set()

    def next_interval(self, events: Iterable[ScheduledEvent], now: datetime | None = None) -> float:
        """The interval until the next poll, given the events this agent watches."""
        if self._clock() < self._fast_until:
            return self.fast_interval
        moment = now or datetime.now(UTC)
        for event in events:
            if event.is_scheduled and event.not_before is not None:
                # Near NotBefore, and for a while after it while the event has not started.
                left = (event.not_before - moment).total_seconds()
                if -60.0 <= left <= self.lead_seconds:
                    return self.fast_interval
        return self.interval

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, or less when :meth:`wake` is called."""
        if seconds > 0 and not self._woken.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), seconds)
        self._woken.clear()
