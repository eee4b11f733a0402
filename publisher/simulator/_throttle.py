"""IMDS throttling: more than N requests in one second from one VM gets 429.

The window slides over one *real* second (``--speed`` does not change how fast a client may
ask). Only admitted requests count, so a client that backs off gets through again.
"""

from __future__ import annotations

from collections import deque

from ._clock import Clock

__all__ = ["RateLimiter"]

_WINDOW_SECONDS = 1.0


class RateLimiter:
    """Per-VM sliding-window limit; ``limit`` 0 turns it off."""

    def __init__(self, limit: int, clock: Clock) -> None:
        if limit < 0:
            raise ValueError(f"rate limit must be >= 0, got {limit}")
        self._limit = limit
        self._clock = clock
        self._recent: dict[str, deque[float]] = {}

    @property
    def limit(self) -> int:
        return self._limit

    def admit(self, vm: str) -> bool:
        """Count one request from ``vm``; False when it is over the limit."""
        if self._limit == 0:
            return True
        now = self._clock.monotonic()
        recent = self._recent.get(vm)
        if recent is None:
            recent = self._recent[vm] = deque()
        horizon = now - _WINDOW_SECONDS
        while recent and recent[0] <= horizon:
            recent.popleft()
        if len(recent) >= self._limit:
            return False
        recent.append(now)
        return True
