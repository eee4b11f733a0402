"""Capped exponential backoff with jitter, for every retry the relay makes, on either side.

The same class as ``publisher._backoff.Backoff`` (its model), here so that ``schemas`` (the
transports) and ``consumers`` can use it too: one backoff in the project, not one per retry loop.

::

    backoff = Backoff(0.05, 1.0)
    while not await attempt():
        await asyncio.sleep(backoff.next())
    backoff.reset()
"""

from __future__ import annotations

import random
import time
from typing import Literal

__all__ = ["Backoff", "FailingSpell"]

# The jitter's source, shared: a Random of its own costs each Backoff about 13 us (it seeds
# from 2.5 KB of os.urandom), and one is made per publish. Jitter needs no independence.
_JITTER = random.Random()


class Backoff:
    """``next()`` gives the next delay: uniform in ``[base * 2**n / 2, base * 2**n]``, never
    above ``cap``; ``reset()`` after a success."""

    def __init__(self, base: float, cap: float, *, rng: random.Random | None = None) -> None:
        if base <= 0 or cap < base:
            raise ValueError("backoff needs 0 < base <= cap")
        self.base = base
        self.cap = cap
        self.attempt = 0
        self._rng = rng or _JITTER

    def next(self) -> float:
        ceiling = min(self.cap, self.base * (2**self.attempt))
        self.attempt = min(self.attempt + 1, 32)
        return self._rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.attempt = 0


class FailingSpell:
    """How a retry loop says its failures: the first of a spell as a warning, again every
    ``reminder`` seconds while it lasts, the tries between at debug level (a line at every
    try, from every VM of a fleet, floods the logs), and once when it works again."""

    def __init__(self, reminder: float) -> None:
        self.reminder = reminder
        #: When the spell began (monotonic); None while it works.
        self.since: float | None = None
        self._said_at = 0.0

    def failed(self) -> Literal["first", "reminder", "again"]:
        """Count a failed try: the first of the spell, a reminder is due, or neither."""
        now = time.monotonic()
        if self.since is None:
            self.since = self._said_at = now
            return "first"
        if now - self._said_at >= self.reminder:
            self._said_at = now
            return "reminder"
        return "again"

    @property
    def lasted(self) -> float:
        """How long the spell has lasted in seconds (0 while it works)."""
        return 0.0 if self.since is None else time.monotonic() - self.since

    def ended(self) -> float | None:
        """It works: how long the spell lasted in seconds (None: there was none)."""
        since, self.since = self.since, None
        return None if since is None else time.monotonic() - since
