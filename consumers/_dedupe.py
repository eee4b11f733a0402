"""The dedupe window: message ids already handled, with what each said, so a redelivery or an
agent's repeat reaches the handler once, and another message under a handled id is caught.
Bounded in size and in age, because the stream never ends."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["DedupeWindow"]


class DedupeWindow:
    """The last ``size`` ids seen within ``ttl`` seconds (None: no age limit), each with the
    digest of what it said (:func:`schemas.messages.content_digest`).

    Keys are ``(vm, id)`` in the stream: ids are deterministic and derived from the VM's
    identity (the same transition of the same event on the same VM has the same id), so the
    window catches agent restarts that republish as well as broker redeliveries, and one VM's
    messages can never occupy another VM's ids.

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
        self._seen: OrderedDict[object, tuple[float, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def get(self, key: object) -> str | None:
        """The digest recorded for ``key`` ("" when none was given), or None if not seen."""
        entry = self._seen.get(key)
        if entry is None:
            return None
        added, digest = entry
        if self.ttl is not None and self._clock() - added > self.ttl:
            del self._seen[key]
            return None
        return digest

    def __contains__(self, key: object) -> bool:
        return self.get(key) is not None

    def add(self, key: object, digest: str = "") -> None:
        now = self._clock()
        seen = self._seen
        seen[key] = (now, digest)
        seen.move_to_end(key)
        while len(seen) > self.size:
            seen.popitem(last=False)
        if self.ttl is not None:
            horizon = now - self.ttl
            while seen:
                oldest, (added, _) = next(iter(seen.items()))
                if added >= horizon:
                    break
                del seen[oldest]
