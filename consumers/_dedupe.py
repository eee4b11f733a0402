"""The dedupe window: message ids already handled, so a redelivery or an agent's repeat reaches
the handler once. Bounded in size and in age, because the stream never ends."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["DedupeWindow"]


class DedupeWindow:
    """The last ``size`` ids seen within ``ttl`` seconds (None: no age limit).

    Message ids are deterministic (the same transition of the same event on the same VM has the
    same id), so the window catches agent restarts that republish as well as broker redeliveries.

    >>> window = DedupeWindow(size=2)
    >>> window.add("a"); window.add("b"); window.add("c")
    >>> "a" in window, "c" in window
    (False, True)
    """

    def __init__(
        self,
        size: int = 100_000,
        ttl: float | None = 6 * 3600.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if size < 1:
            raise ValueError("the dedupe window needs room for at least one id")
        self.size = size
        self.ttl = ttl
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, message_id: object) -> bool:
        added = self._seen.get(message_id)  # type: ignore[call-overload]
        if added is None:
            return False
        if self.ttl is not None and self._clock() - added > self.ttl:
            del self._seen[message_id]  # type: ignore[arg-type]
            return False
        return True

    def add(self, message_id: str) -> None:
        now = self._clock()
        seen = self._seen
        seen[message_id] = now
        seen.move_to_end(message_id)
        while len(seen) > self.size:
            seen.popitem(last=False)
        if self.ttl is not None:
            horizon = now - self.ttl
            while seen:
                oldest_id, added = next(iter(seen.items()))
                if added >= horizon:
                    break
                del seen[oldest_id]
