"""The dedupe window: message ids already handled, with what each said, so a redelivery or an
agent's repeat reaches the handler once, and another message under a handled id is caught.
Bounded in size and in age, because the stream never ends; and fair between senders when full,
because every VM may publish and ids are the senders' own: a sender that publishes new ids
without end evicts its own entries, never another's while the window has room for that one's.
A sender is who the stream can tell apart (its ``party``): the broker user that published where
the origin check maps broker users to VMs (one may speak for a whole scale set), not the VM
names it claims; else the VM."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["DedupeWindow"]

#: The one party of every key that is not a ``(vm, id)`` tuple, added without a party.
_SHARED = object()

#: An entry of the window: (when it was added, the digest, its key, its party's name). The
#: name, not the party: an entry of strings alone is left alone by the cyclic GC.
_Entry = tuple[float, str, object, object]


class _Party:
    """One party's entries, oldest first, from ``head`` on (a list and where it starts: a deque
    costs 760 bytes even for one entry, and a window can hold as many parties as ids). An entry
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

    def drop_stale(self, seen: OrderedDict[object, _Entry]) -> None:
        """Forget its stale places, once they are most of its list (O(1) amortized)."""
        if self.stale > self.held + 32:
            self.entries = [e for e in self.entries[self.head :] if seen.get(e[2]) is e]
            self.head = self.stale = 0

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

    Each entry belongs to a party: the ``party`` it was added with (the stream passes the broker
    user that published under a broker-user origin check, see :class:`~consumers.FleetStream`),
    else the VM of its ``(vm, id)`` key. Entries older than ``ttl`` go first. When the window is
    still full, the entry evicted to make room is the oldest of the party holding the most
    entries: the adding party's own when it is one of those, the oldest in the window when every
    party holds one. So a party flooding new ids evicts its own entries, however many VM names
    it puts on them, and a party holding no more than its share (``size`` divided by the parties
    in the window) loses entries only to age. Adding and looking up cost O(1) (amortized): each
    party's entries are kept in their order, and the parties by how many they hold, so no add
    looks at every party. The key alone decides what is found (a party is only whose room an
    entry takes): a key added again under another party is that party's newest from then on.

    Keys that are not tuples (a library user's own) added without a party all count as one:
    among themselves the window is the plain least-recently-added one it always was, and
    together they are one party to the VMs.

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
    >>> for n in range(100):  # one sender naming a new VM for each id: still one party
    ...     window.add((f"web-{n + 3}", f"flood-{n}"), party="flooder")
    >>> ("web-1", "m1") in window, ("web-102", "flood-99") in window
    (True, True)
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

    def add(self, key: object, digest: str = "", party: object = None) -> None:
        """Remember ``key`` (again: as its party's newest), dropping what aged out, then, while
        the window is over its size, the oldest entry of the party holding the most.
        ``party``: whose room the entry takes (None: the VM of a ``(vm, id)`` key)."""
        now = self._clock()
        seen = self._seen
        if self.ttl is not None and seen:
            horizon = now - self.ttl
            if next(iter(seen.values()))[0] < horizon:
                self._expire(horizon)
        if party is None:
            party = key[0] if isinstance(key, tuple) and key else _SHARED
        own = self._parties.get(party)
        if own is None:
            own = self._parties[party] = _Party(party)
        entry = (now, digest, key, party)
        before = seen.setdefault(key, entry)
        if before is not entry:  # added again: now its party's newest
            seen[key] = entry
            seen.move_to_end(key)
            other = own if before[3] == party else self._parties[before[3]]
            other.stale += 1
            if other is own:
                own.entries.append(entry)
                own.drop_stale(seen)
                return
            # Another party's until now: it leaves that one's count for this one's (the
            # window holds as many entries as before).
            self._recount(other, other.held - 1)
            if other.held:
                other.drop_stale(seen)
        held = own.held
        if held and held >= self._most - 1 and len(seen) == self.size + 1:
            # Full, and this party is one holding the most now (a party flooding new ids, or
            # every party holding its share): its own oldest makes the room, and how many
            # each party holds does not change.
            del seen[own.take_oldest(seen)[2]]
            own.entries.append(entry)
            return
        own.entries.append(entry)
        self._recount(own, held + 1)
        while len(seen) > self.size:
            self._make_room(own)

    def _expire(self, horizon: float) -> None:
        """Drop every entry added before ``horizon``: the oldest of the window are each their
        party's oldest too."""
        seen = self._seen
        while seen:
            oldest = next(iter(seen.values()))
            if oldest[0] >= horizon:
                break
            self._drop_oldest(self._parties[oldest[3]])

    def _make_room(self, adding: _Party) -> None:
        """Evict one entry, never the one ``adding`` has just added."""
        most = self._most
        if most == 1:  # every party holds one: the oldest entry goes, not the one just added
            party = self._parties[next(iter(self._seen.values()))[3]]
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
