"""The dedupe window: message ids already handled, with what each said, so a redelivery or an
agent's repeat reaches the handler once, and another message under a handled id is caught.
Bounded in size and in age, because the stream never ends; and fair between VMs when full,
because every VM may publish and ids are the senders' own: a VM that publishes new ids without
end evicts its own entries, never another VM's while the window has room for that VM's."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["DedupeWindow"]

#: The one party of every key that is not a ``(vm, id)`` tuple.
_SHARED = object()

#: An entry of the window: (when it was added, the digest, its key).
_Entry = tuple[float, str, object]


def _party(key: object) -> object:
    """Whose entry ``key`` is: the VM of a ``(vm, id)`` key, else the one shared party."""
    return key[0] if isinstance(key, tuple) and key else _SHARED


class _Party:
    """One VM's entries, oldest first, from ``head`` on (a list and where it starts: a deque
    costs 760 bytes even for one entry, and a window can hold as many VMs as ids). An entry
    added again is appended again; its older place is ``stale`` (no longer the entry the
    window holds under its key) and skipped."""

    __slots__ = ("entries", "head", "held", "name", "stale")

    def __init__(self, name: object) -> None:
        self.name = name
        self.entries: list[_Entry] = []
        self.head = 0
        #: How many entries it holds (its stale places not counted).
        self.held = 0
        #: How many of its places are stale (0 in the stream, which adds an id only once).
        self.stale = 0

    def take_oldest(self, seen: OrderedDict[object, _Entry]) -> _Entry:
        """Its oldest entry, gone from its list (still in ``seen``)."""
        entries, head = self.entries, self.head
        oldest = entries[head]
        head += 1
        if self.stale:
            while seen.get(oldest[2]) is not oldest:
                self.stale -= 1
                oldest = entries[head]
                head += 1
        if head > 32 and head > len(entries) >> 1:  # O(1) amortized: half of it is gone
            del entries[:head]
            head = 0
        self.head = head
        return oldest


class DedupeWindow:
    """The last ids seen within ``ttl`` seconds (None: no age limit), at most ``size`` of them,
    each with the digest of what it said (:func:`schemas.messages.content_digest`).

    Keys are ``(vm, id)`` in the stream: ids are deterministic and derived from the VM's
    identity (the same transition of the same event on the same VM has the same id), so the
    window catches agent restarts that republish as well as broker redeliveries, and one VM's
    messages can never occupy another VM's ids.

    Entries older than ``ttl`` go first. When the window is still full, the entry evicted to
    make room is the oldest of the VM holding the most entries: the adding VM's own when it is
    one of those, the oldest in the window when every VM holds one. So a VM flooding new ids
    evicts its own entries, and a VM holding no more than its share (``size`` divided by the
    VMs in the window) loses entries only to age. Adding and looking up cost O(1) (amortized):
    each VM's entries are kept in their order, and the VMs by how many they hold, so no add
    looks at every VM.

    Keys that are not tuples (a library user's own) all count as one VM: among themselves the
    window is the plain least-recently-added one it always was, and together they are one
    party to the VMs.

    >>> window = DedupeWindow(size=2)
    >>> window.add("a"); window.add("b"); window.add("c")
    >>> "a" in window, "c" in window
    (False, True)
    >>> window = DedupeWindow(size=3)
    >>> window.add(("web-1", "m1"))
    >>> for n in range(100):
    ...     window.add(("web-2", f"flood-{n}"))
    >>> ("web-1", "m1") in window, ("web-2", "flood-97") in window
    (True, False)
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
        #: Every entry by its key, oldest first: what ages out first.
        self._seen: OrderedDict[object, _Entry] = OrderedDict()
        self._parties: dict[object, _Party] = {}
        #: The parties by how many entries they hold, each in the order it came to that many.
        self._levels: dict[int, OrderedDict[_Party, None]] = {}
        #: How many entries the party holding the most holds.
        self._most = 0

    def __len__(self) -> int:
        return len(self._seen)

    def get(self, key: object) -> str | None:
        """The digest recorded for ``key`` ("" when none was given), or None if not seen."""
        entry = self._seen.get(key)
        if entry is None:
            return None
        if self.ttl is not None:
            horizon = self._clock() - self.ttl
            if entry[0] < horizon:
                self._expire(horizon)  # this one, and every older one with it
                return None
        return entry[1]

    def __contains__(self, key: object) -> bool:
        return self.get(key) is not None

    def add(self, key: object, digest: str = "") -> None:
        """Remember ``key`` (again: as its VM's newest), dropping what aged out, then, while the
        window is over its size, the oldest entry of the VM holding the most."""
        now = self._clock()
        seen = self._seen
        if self.ttl is not None and seen:
            horizon = now - self.ttl
            if next(iter(seen.values()))[0] < horizon:
                self._expire(horizon)
        name = key[0] if isinstance(key, tuple) and key else _SHARED
        party = self._parties.get(name)
        if party is None:
            party = self._parties[name] = _Party(name)
        entry = (now, digest, key)
        if seen.setdefault(key, entry) is not entry:  # added again: now its VM's newest
            seen[key] = entry
            seen.move_to_end(key)
            party.entries.append(entry)
            party.stale += 1
            if party.stale > party.held + 32:  # mostly stale places: drop them
                party.entries = [e for e in party.entries[party.head :] if seen.get(e[2]) is e]
                party.head = party.stale = 0
            return
        held = party.held
        if held and held >= self._most - 1 and len(seen) == self.size + 1:
            # Full, and this VM is one holding the most now (a VM flooding new ids, or every
            # VM holding its share): its own oldest makes the room, and how many each VM
            # holds does not change.
            del seen[party.take_oldest(seen)[2]]
            party.entries.append(entry)
            return
        party.entries.append(entry)
        self._recount(party, held + 1)
        while len(seen) > self.size:
            self._make_room(party)

    def _expire(self, horizon: float) -> None:
        """Drop every entry added before ``horizon``: the oldest of the window are each their
        VM's oldest too."""
        seen = self._seen
        while seen:
            oldest = next(iter(seen.values()))
            if oldest[0] >= horizon:
                break
            self._drop_oldest(self._parties[_party(oldest[2])])

    def _make_room(self, adding: _Party) -> None:
        """Evict one entry, never the one ``adding`` has just added."""
        most = self._most
        if most == 1:  # every VM holds one: the oldest entry goes, not the one just added
            party = self._parties[_party(next(iter(self._seen)))]
        elif adding.held == most:
            party = adding
        else:
            party = next(iter(self._levels[most]))
        self._drop_oldest(party)

    def _drop_oldest(self, party: _Party) -> None:
        del self._seen[party.take_oldest(self._seen)[2]]
        self._recount(party, party.held - 1)

    def _recount(self, party: _Party, held: int) -> None:
        """``party`` now holds ``held`` entries: one more or one less than it did."""
        levels = self._levels
        before, party.held = party.held, held
        if before:
            left = levels[before]
            del left[party]
            if not left:
                del levels[before]
                if before == self._most:
                    self._most = held
        if held:
            joined = levels.get(held)
            if joined is None:
                joined = levels[held] = OrderedDict()
            joined[party] = None
            if held > self._most:
                self._most = held
        else:
            del self._parties[party.name]
