"""Time for the simulator: a real clock for serving, a manual one for deterministic tests.

The simulator keeps every deadline in *real* seconds on the clock's monotonic scale; the
``--speed`` factor is applied once, when a simulated duration is turned into a deadline (see
:meth:`publisher.simulator.Simulator.to_real`). The wall clock exists for ``NotBefore``, which is
always a real wall-clock time, and for the times shown by the admin API.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "ManualClock", "SystemClock"]


@runtime_checkable
class Clock(Protocol):
    """Where the simulator reads the time from."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back; only differences mean anything."""
        ...

    def time(self) -> float:
        """Wall-clock seconds since the Unix epoch."""
        ...


class SystemClock:
    """The machine's clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told to: for tests that must not sleep.

    >>> clock = ManualClock(wall=1_650_000_000.0)
    >>> clock.advance(2.5)
    >>> clock.monotonic()
    2.5
    """

    def __init__(self, *, wall: float = 1_650_000_000.0, monotonic: float = 0.0) -> None:
        self._wall = wall
        self._monotonic = monotonic

    def monotonic(self) -> float:
        return self._monotonic

    def time(self) -> float:
        return self._wall

    def advance(self, seconds: float) -> None:
        """Move both clocks forward by ``seconds`` real seconds."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back (advance by {seconds!r})")
        self._monotonic += seconds
        self._wall += seconds
