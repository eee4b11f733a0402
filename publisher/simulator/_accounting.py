"""Request accounting per VM, for tests that hold an agent to IMDS's manners.

Since the last reset, for each VM: how many requests it made, the largest number in any
one-second window (on the simulator's clock, by arrival: a request that waits for a delay fault
counts when it came), and how many got which status from which endpoint and method. A test can
then say "this agent never asks more than twice a second" and "the documents' sample never got a
429 on a POST" without reading logs. The window slides: it is found with the arrivals of the
last second per VM (a handful for a polite client), O(1) amortized per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._events import iso_time
from ._faults import Endpoint

__all__ = ["RequestAccounting", "RequestStats"]

_WINDOW_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class RequestStats:
    """One VM's requests since ``since`` (wall time of the last reset).

    ``busiest_second`` is the wall time the busiest window began (its first request), None
    before any request. ``counts`` maps (endpoint, method, status) to a number of requests.
    """

    vm: str
    since: float
    total: int = 0
    max_per_second: int = 0
    busiest_second: float | None = None
    counts: dict[tuple[Endpoint, str, int], int] = field(default_factory=dict)

    def count(
        self,
        *,
        endpoint: Endpoint | None = None,
        method: str | None = None,
        status: int | None = None,
    ) -> int:
        """Requests answered that match every criterion given.

        >>> RequestStats("vm0", 0.0, counts={("scheduledevents", "POST", 200): 2}).count(
        ...     method="POST", status=429)
        0
        """
        return sum(
            n
            for (e, m, s), n in self.counts.items()
            if endpoint in (None, e) and method in (None, m) and status in (None, s)
        )

    def to_json(self) -> dict[str, Any]:
        """An item of ``GET /admin/requests/stats``."""
        return {
            "vm": self.vm,
            "since": iso_time(self.since),
            "total": self.total,
            "max_per_second": self.max_per_second,
            "busiest_second": None
            if self.busiest_second is None
            else iso_time(self.busiest_second),
            "requests": [
                {"endpoint": e, "method": m, "status": s, "count": n}
                for (e, m, s), n in self.counts.items()
            ],
        }


class _Tally:
    __slots__ = ("busiest", "counts", "maximum", "recent", "total")

    def __init__(self) -> None:
        self.recent: list[float] = []  # arrivals of the last second (a deque costs 600 bytes)
        self.total = 0
        self.maximum = 0
        self.busiest: float | None = None
        self.counts: dict[tuple[Endpoint, str, int], int] = {}


class RequestAccounting:
    """The tallies of every VM that asked since the last :meth:`reset`."""

    def __init__(self, since: float) -> None:
        self._since = since
        self._tallies: dict[str, _Tally] = {}

    def arrive(self, vm: str, mono: float, wall: float) -> None:
        """A request from ``vm`` came in (monotonic and wall time)."""
        tally = self._tallies.get(vm)
        if tally is None:
            tally = self._tallies[vm] = _Tally()
        recent = tally.recent
        horizon = mono - _WINDOW_SECONDS
        stale = 0
        while stale < len(recent) and recent[stale] <= horizon:
            stale += 1
        if stale:
            del recent[:stale]
        recent.append(mono)
        tally.total += 1
        if len(recent) > tally.maximum:
            tally.maximum = len(recent)
            tally.busiest = wall - (mono - recent[0])

    def answered(self, vm: str, endpoint: Endpoint, method: str, status: int) -> None:
        """The request from ``vm`` got ``status``."""
        tally = self._tallies.get(vm)
        if tally is None:  # arrived before a reset
            return
        key = (endpoint, method, status)
        tally.counts[key] = tally.counts.get(key, 0) + 1

    def stats(self, vm: str) -> RequestStats:
        tally = self._tallies.get(vm)
        if tally is None:
            return RequestStats(vm, self._since)
        return RequestStats(
            vm, self._since, tally.total, tally.maximum, tally.busiest, dict(tally.counts)
        )

    def vms(self) -> list[str]:
        """The VMs that asked, in the order they first did."""
        return list(self._tallies)

    def reset(self, since: float) -> None:
        self._since = since
        self._tallies.clear()
