"""How often the agent asks IMDS: a request limiter for every call, and an adaptive cadence.

IMDS throttles a VM above 5 requests per second (429) — across EVERY client on that VM: the
Azure guest agent, cluster resource agents, Kubernetes node handlers, the documents' own sample
loop. The budget is shared, so the agent takes a small part of it: :class:`RequestLimiter` is a
sliding window over every request the agent makes (polls, approval POSTs, identity), by
default at most 2 in any one-second window, each counted from when it is written (what IMDS
sees); a 429 halves that for a while (and the caller backs
off), so the agent slows down when the VM is busy instead of adding to it. :class:`Cadence`
polls once per ``poll_interval`` (1 s: one request per second while nothing is pending), faster
(every ``fast_interval``, 0.5 s) while something is seconds away: after an event of this VM
started (its end), or an approval was applied (its start, then its end), for at most
``fast_seconds`` and only until that event is gone from the document; and while a Scheduled
event's NotBefore is near. A new Scheduled event alone does not make polling fast: nothing
happens to it soon unless it is approved, and a fleet-wide wave would otherwise double every
VM's IMDS traffic at once. Nor does a neighbour's event (listed because it shares the
placement group, but not in this VM's ``Resources``) unless the agent reports every event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

from schemas import ScheduledEvent

__all__ = ["Cadence", "RequestLimiter", "RequestSlot"]

log = logging.getLogger(__name__)

#: Extra spacing so that requests IMDS receives a little late or early (the VM's load, the
#: host's) still fall into separate windows: a request let through when the window has room is
#: exactly one window after the one it waited for. With 20 ms, the simulator saw 3 requests
#: within a second from some VMs of a 2,000-VM run on this machine; with 100 ms, at most 2.
_WINDOW_MARGIN = 0.1
#: How long a 429 halves the limiter's rate.
_THROTTLED_SECONDS = 10.0


class RequestSlot:
    """One request's place in the limiter's window: held from when it is let through until it
    goes out (:meth:`went_out`, just before it is written), and counted from then."""

    __slots__ = ("_limiter", "at", "out")

    def __init__(self, limiter: RequestLimiter, at: float) -> None:
        self._limiter = limiter
        #: When it went out (until then, when it was let through).
        self.at = at
        self.out = False

    def went_out(self) -> None:
        """It is being written now. A second call changes nothing."""
        if not self.out:
            self._limiter._went_out(self)

    def release(self) -> None:
        """It was never written (its connection failed, its deadline passed first): its place
        goes to the next request. Nothing once it went out."""
        if not self.out:
            self._limiter._release(self)


class RequestLimiter:
    """At most ``max_requests`` requests in any ``period`` seconds; after :meth:`throttled`,
    half as many (at least one) for ``_THROTTLED_SECONDS``.

    A request counts from when it goes out, not from when it was let through: one whose
    connection takes its time to open (a loaded VM) holds its place meanwhile, then counts from
    the moment it is written. Counted from its admission it reached IMDS together with the
    requests let through after it: three within a second from a limiter of two."""

    def __init__(
        self,
        max_requests: int = 2,
        period: float = 1.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_requests = max_requests
        self.period = period + _WINDOW_MARGIN
        self._clock = clock
        #: The requests in the window: gone out within ``period``, or let through and not yet
        #: out (those hold their place however long they wait).
        self._slots: list[RequestSlot] = []
        self._lock = asyncio.Lock()
        #: Set when a request goes out: a wait on one still to go out ends then.
        self._went = asyncio.Event()
        self._slow_until = 0.0
        #: The most requests gone out in any one second since :meth:`reset_peak`.
        self.peak = 0
        self._recent: deque[float] = deque()

    @property
    def current_limit(self) -> int:
        if self._clock() < self._slow_until:
            return max(1, self.max_requests // 2)
        return self.max_requests

    def throttled(self) -> None:
        """IMDS answered 429: other clients on this VM need the budget; slow down."""
        if self._clock() >= self._slow_until:
            log.warning(
                "IMDS throttled this VM (429): the agent halves its request rate for %.0f s",
                _THROTTLED_SECONDS,
            )
        self._slow_until = self._clock() + _THROTTLED_SECONDS

    async def acquire(self) -> RequestSlot:
        """Wait until one more request fits in the window; its slot, whose :meth:`~RequestSlot.
        went_out` the caller calls as it writes the request."""
        async with self._lock:
            while True:
                now = self._clock()
                horizon = now - self.period
                self._slots = [s for s in self._slots if not s.out or s.at > horizon]
                if len(self._slots) < self.current_limit:
                    break
                gone = [s.at for s in self._slots if s.out]
                self._went.clear()
                # Until the oldest request gone out leaves the window, or one waiting goes out.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(gone) + self.period - now if gone else None):
                        await self._went.wait()
            slot = RequestSlot(self, self._clock())
            self._slots.append(slot)
            return slot

    def _went_out(self, slot: RequestSlot) -> None:
        now = self._clock()
        slot.at = max(slot.at, now)
        slot.out = True
        self._went.set()
        recent = self._recent
        recent.append(now)
        while recent and recent[0] <= now - 1.0:
            recent.popleft()
        self.peak = max(self.peak, len(recent))

    def _release(self, slot: RequestSlot) -> None:
        with contextlib.suppress(ValueError):
            self._slots.remove(slot)
        self._went.set()

    def reset_peak(self) -> None:
        self.peak = 0
        self._recent.clear()


class Cadence:
    """When the next poll is due. ``boost()`` (an event started, an approval applied) makes polling
    fast for at most ``fast_seconds``, while an event watched runs or one approved here has yet
    to start; ``wake()`` makes the next poll due now."""

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
        #: Events approved here (their StartRequests POSTed) not yet seen gone.
        self._approved: set[str] = set()
        #: Set by :meth:`wake`: poll now.
        self._woken = False
        #: Set by :meth:`wake` and :meth:`boost`: a waiting poller looks again at when to poll.
        self._stirred = asyncio.Event()

    def boost(self, approved: str | None = None) -> None:
        """Poll fast from now: an event started, or the event ``approved`` was POSTed (right
        after the poll it asked for, so the next one may be planned a slow interval away:
        :meth:`wait_next` plans it again)."""
        self._fast_until = self._clock() + self.fast_seconds
        if approved is not None:
            self._approved.add(approved)
        self._stirred.set()

    def wake(self) -> None:
        self._woken = True
        self._stirred.set()

    def pending(self, events: Iterable[ScheduledEvent], now: datetime | None = None) -> bool:
        """Whether something is about to happen: an event that runs or was approved here, within
        ``fast_seconds`` of the boost, or a Scheduled event whose NotBefore is near (or passed,
        while it has not started)."""
        events = tuple(events)
        if self._approved:
            self._approved.intersection_update(e.event_id for e in events)  # gone: over
        if self._clock() < self._fast_until and any(
            e.is_started or e.event_id in self._approved for e in events
        ):
            return True
        moment = now or datetime.now(UTC)
        for event in events:
            if event.is_scheduled and event.not_before is not None:
                left = (event.not_before - moment).total_seconds()
                if -60.0 <= left <= self.lead_seconds:
                    return True
        return False

    def next_interval(self, events: Iterable[ScheduledEvent], now: datetime | None = None) -> float:
        """The interval until the next poll, given the events this agent watches."""
        return self.fast_interval if self.pending(events, now) else self.interval

    async def wait_next(self, began: float, events: Iterable[ScheduledEvent]) -> None:
        """Wait until the poll after the one that began at ``began`` (on the cadence's clock) is
        due, given the events watched: sooner when :meth:`wake` is called, and planned again
        when :meth:`boost` is (a slow interval may turn fast meanwhile)."""
        events = tuple(events)
        await self._wait(lambda: began + self.next_interval(events))

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, or less when :meth:`wake` is called."""
        deadline = self._clock() + seconds
        await self._wait(lambda: deadline)

    async def _wait(self, due: Callable[[], float]) -> None:
        while not self._woken:
            left = due() - self._clock()
            if left <= 0:
                break
            self._stirred.clear()
            # asyncio.timeout, not wait_for: no task created and cancelled for every poll.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._stirred.wait()
        self._woken = False
