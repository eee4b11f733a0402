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

__all__ = ["Backoff"]

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
