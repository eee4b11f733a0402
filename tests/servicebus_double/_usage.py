"""What the double's clients hold at once: connections and entity links, now, at their peak and
on average over a measurement window.

Service Bus limits what a namespace holds concurrently, not what it carries: 5,000 AMQP
connections per namespace and 5,000 concurrent receive requests per entity (an open receive
link polls for messages for as long as it is attached). The double counts the same things so a
test can say how many a client costs:

- ``connections``: AMQP connections (the SDK opens one per sender and one per receiver);
- ``receive_links`` / ``send_links``: links to entities (queues, topics, subscriptions), by
  the client's role, in total and per entity path; the ``$cbs`` and ``$management`` links of
  the SDK are not counted.

The proton thread changes the counts; tests read :meth:`UsageMeter.snapshot` from their own
thread, so every method takes the lock. A mean is time-weighted: the integral of the count over
the window divided by the window's length, so a connection held for 6 s of a 60 s window
counts 0.1.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["Reading", "Usage", "UsageMeter"]

Clock = Callable[[], float]


@dataclass(frozen=True)
class Reading:
    """One count over a window: its value now, its peak, its time-weighted mean, and how many
    were opened during the window."""

    now: int
    peak: int
    mean: float
    opened: int


@dataclass(frozen=True)
class Usage:
    """A snapshot of every count over the window that began ``seconds`` ago."""

    seconds: float
    connections: Reading
    receive_links: Reading
    send_links: Reading
    receive_links_by_entity: Mapping[str, Reading]
    send_links_by_entity: Mapping[str, Reading]


class _Gauge:
    def __init__(self, at: float) -> None:
        self.value = 0
        self.peak = 0
        self.opened = 0
        self._area = 0.0
        self._since = at
        self._changed = at

    def change(self, delta: int, at: float) -> None:
        self._area += self.value * (at - self._changed)
        self._changed = at
        self.value += delta
        if delta > 0:
            self.opened += delta
        self.peak = max(self.peak, self.value)

    def reading(self, at: float) -> Reading:
        area = self._area + self.value * (at - self._changed)
        span = at - self._since
        mean = area / span if span > 0 else float(self.value)
        return Reading(self.value, self.peak, mean, self.opened)

    def restart(self, at: float) -> None:
        self._area, self._since, self._changed = 0.0, at, at
        self.peak, self.opened = self.value, 0


class UsageMeter:
    """The double's counts; :meth:`restart` begins a new window (current values are kept)."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        start = clock()
        self._since = start
        self._connections = _Gauge(start)
        self._receive = _Gauge(start)
        self._send = _Gauge(start)
        self._receive_by_entity: dict[str, _Gauge] = {}
        self._send_by_entity: dict[str, _Gauge] = {}

    def connection(self, delta: int) -> None:
        with self._lock:
            self._connections.change(delta, self._clock())

    def link(self, entity: str, delta: int, *, receive: bool) -> None:
        """A client's receive (``receive=True``) or send link to ``entity`` opened or closed."""
        with self._lock:
            at = self._clock()
            total, by_entity = (
                (self._receive, self._receive_by_entity)
                if receive
                else (self._send, self._send_by_entity)
            )
            total.change(delta, at)
            gauge = by_entity.get(entity)
            if gauge is None:
                gauge = by_entity[entity] = _Gauge(self._since)
            gauge.change(delta, at)

    def snapshot(self) -> Usage:
        with self._lock:
            at = self._clock()
            return Usage(
                seconds=at - self._since,
                connections=self._connections.reading(at),
                receive_links=self._receive.reading(at),
                send_links=self._send.reading(at),
                receive_links_by_entity={
                    k: g.reading(at) for k, g in self._receive_by_entity.items()
                },
                send_links_by_entity={k: g.reading(at) for k, g in self._send_by_entity.items()},
            )

    def restart(self) -> None:
        with self._lock:
            at = self._clock()
            self._since = at
            gauges = [self._connections, self._receive, self._send]
            gauges += [*self._receive_by_entity.values(), *self._send_by_entity.values()]
            for gauge in gauges:
                gauge.restart(at)
