"""The dedupe window on its own: bounded in size and age, and fair between parties when full (a
VM, or the sender the stream passes as its party, that publishes many new ids evicts its own
entries, never another's while there is room)."""

from __future__ import annotations

from collections import Counter, OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from consumers import DedupeWindow


def test_a_vm_flooding_new_ids_evicts_its_own_entries_not_another_vms():
    window = DedupeWindow(size=10, ttl=None)
    window.add(("web-a", "m-1"), "digest-a")
    for n in range(1_000):
        window.add(("web-b", f"flood-{n}"), f"digest-{n}")
    assert window.get(("web-a", "m-1")) == "digest-a"
    assert len(window) == 10
    # The flooder keeps its newest nine: its own window, still a dedupe window.
    assert all(("web-b", f"flood-{n}") in window for n in range(991, 1_000))
    assert ("web-b", "flood-990") not in window


def test_a_newcomer_takes_its_place_from_the_vm_holding_the_most():
    window = DedupeWindow(size=5, ttl=None)
    window.add(("web-b", "1"))  # the oldest entry of the window, but b's only one
    for n in range(4):
        window.add(("web-a", str(n)))
    window.add(("web-c", "1"))
    assert ("web-b", "1") in window
    assert ("web-c", "1") in window
    assert ("web-a", "0") not in window  # a held the most: its oldest made the room
    assert all(("web-a", str(n)) in window for n in (1, 2, 3))


def test_when_every_vm_holds_one_the_oldest_goes():
    window = DedupeWindow(size=3, ttl=None)
    for name in ("a", "b", "c", "d"):
        window.add((name, "1"))
    assert [(name, "1") in window for name in "abcd"] == [False, True, True, True]


def test_an_id_added_again_is_its_vms_newest():
    window = DedupeWindow(size=3, ttl=None)
    for n in (1, 2, 3):
        window.add(("web-a", str(n)))
    window.add(("web-a", "1"), "again")
    window.add(("web-a", "4"))
    assert ("web-a", "2") not in window
    assert window.get(("web-a", "1")) == "again"


def test_ids_added_again_and_again_keep_their_order_and_the_window_its_size():
    window = DedupeWindow(size=4, ttl=None)
    for n in (1, 2, 3):
        window.add(("web-a", str(n)))
    window.add(("web-b", "1"))
    for n in range(1_000):  # 1 and 2 again and again, 2 last: a's order is now 3, 1, 2
        window.add(("web-a", str(1 + n % 2)), f"again-{n}")
    window.add(("web-a", "4"))
    assert ("web-a", "3") not in window
    window.add(("web-a", "5"))
    assert ("web-a", "1") not in window
    assert window.get(("web-a", "2")) == "again-999"
    assert all(key in window for key in (("web-a", "4"), ("web-a", "5"), ("web-b", "1")))
    assert len(window) == 4


def test_a_window_made_smaller_sheds_from_the_vm_holding_the_most():
    window = DedupeWindow(size=4, ttl=None)
    for n in (1, 2, 3):
        window.add(("web-a", str(n)))
    window.add(("web-b", "1"))
    window.size = 2
    window.add(("web-a", "4"))
    assert len(window) == 2
    assert ("web-a", "4") in window
    assert ("web-b", "1") in window


def test_a_party_naming_a_new_vm_for_each_id_evicts_its_own_entries_not_another_vms():
    """The stream passes the broker user as the party: one that may speak for a whole scale
    set and names a new VM for each id is one party, not a thousand."""
    window = DedupeWindow(size=10, ttl=None)
    window.add(("web-a", "m-1"), "digest-a", "user-a")
    for n in range(1_000):
        window.add((f"flood_{n}", f"flood-{n}"), f"digest-{n}", "user-b")
    assert window.get(("web-a", "m-1")) == "digest-a"
    assert len(window) == 10
    assert all((f"flood_{n}", f"flood-{n}") in window for n in range(991, 1_000))
    assert ("flood_990", "flood-990") not in window


def test_without_a_party_each_vm_name_is_one():
    window = DedupeWindow(size=10, ttl=None)
    window.add(("web-a", "m-1"))
    for n in range(1_000):
        window.add((f"flood_{n}", f"flood-{n}"))
    assert ("web-a", "m-1") not in window  # every name held one: the oldest went


def test_an_id_added_again_under_another_party_takes_that_ones_room():
    window = DedupeWindow(size=4, ttl=None)
    window.add(("web-a", "1"), party="user-a")
    window.add(("web-a", "2"), party="user-a")
    window.add(("web-b", "1"), party="user-b")
    window.add(("web-a", "1"), "again", party="user-b")  # user-b's now: it holds two, a one
    window.add(("web-c", "1"), party="user-c")
    window.add(("web-d", "1"), party="user-d")  # over: user-b's oldest makes the room
    assert ("web-b", "1") not in window
    assert window.get(("web-a", "1")) == "again"
    assert all(key in window for key in (("web-a", "2"), ("web-c", "1"), ("web-d", "1")))
    assert len(window) == 4


def test_plain_keys_share_one_bucket_and_are_a_plain_lru_among_themselves():
    """Keys that are not ``(vm, id)`` tuples (a library user's own) are one party: among
    themselves the window is the LRU it always was, and together they cannot flood a VM out."""
    window = DedupeWindow(size=4, ttl=None)
    window.add(("web-a", "1"))
    for n in range(10):
        window.add(f"plain-{n}")
    assert ("web-a", "1") in window
    assert [f"plain-{n}" in window for n in range(6, 10)] == [False, True, True, True]
    assert len(window) == 4


def test_expired_entries_go_first_and_leave_the_counts_right():
    """Entries past the TTL are dropped before anyone is evicted for room, and a VM whose
    entries expired (some by a lookup, some by the sweep) counts only what it still holds."""
    now = [0.0]
    window = DedupeWindow(size=4, ttl=10, clock=lambda: now[0])
    for n in range(3):
        window.add(("web-b", str(n)))
    now[0] = 5
    window.add(("web-a", "1"))
    now[0] = 11
    assert ("web-b", "1") not in window  # expired, dropped by the lookup
    window.add(("web-a", "2"))  # the sweep drops b's other two
    assert len(window) == 2
    window.add(("web-b", "3"))
    window.add(("web-b", "4"))
    window.add(("web-c", "1"))  # full: a and b hold two each, one of them makes the room
    assert len(window) == 4
    assert ("web-c", "1") in window
    assert ("web-a", "2") in window  # each kept its newest
    assert ("web-b", "4") in window
    assert (("web-a", "1") in window) != (("web-b", "3") in window)  # one gave up its oldest
    now[0] = 30
    assert window.get(("web-c", "1")) is None
    window.add(("web-d", "1"))
    assert len(window) == 1


_VMS = ("web-a", "web-b", "web-c")
#: None: the VM's own; a name: a sender's (one named like a VM is that VM's party too).
_PARTIES = st.sampled_from([None, None, None, "user-1", "user-2", "web-a"])
_add = st.tuples(st.just("add"), st.sampled_from(_VMS), st.integers(0, 20), _PARTIES)
#: Few ids: keys added again, often under another party.
_again = st.tuples(st.just("add"), st.sampled_from(_VMS), st.integers(0, 2), _PARTIES)
_operations = st.lists(
    st.one_of(
        _add,
        _add,
        _again,
        st.tuples(st.just("add"), st.just("plain"), st.integers(0, 10), st.none()),
        st.tuples(st.just("get"), st.sampled_from(_VMS), st.integers(0, 20), st.none()),
        st.tuples(st.just("wait"), st.just(""), st.integers(0, 4), st.none()),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), _operations)
def test_eviction_takes_the_oldest_entry_of_a_party_holding_the_most(size, operations):
    """Against a model of the window: after every add, everything expired is gone, and when the
    window was over its size the one entry evicted was the oldest of a party holding the most
    entries (the adding party's own when it is one of those); the new entry is always kept. A
    key's party is the one it was last added with (its VM when none was given)."""
    now = [0.0]
    ttl = 10.0
    window = DedupeWindow(size=size, ttl=ttl, clock=lambda: now[0])
    model: OrderedDict[object, float] = OrderedDict()  # key -> when added, oldest first
    parties: dict[object, object] = {}

    def party(key: object) -> object:
        return parties[key]

    for op, vm, n, sender in operations:
        key: object = f"plain-{n}" if vm == "plain" else (vm, str(n))
        if op == "wait":
            now[0] += n
            continue
        if op == "get":
            expected = key in model and now[0] - model[key] <= ttl
            assert (key in window) is expected
            continue
        model[key] = now[0]
        model.move_to_end(key)
        parties[key] = sender if sender is not None else "plain" if vm == "plain" else vm
        window.add(key, party=sender)
        for old in [k for k, added in model.items() if now[0] - added > ttl]:
            del model[old]
        present = [k for k in model if k in window]
        assert key in present
        missing = [k for k in model if k not in present]
        assert len(missing) == max(0, len(model) - size)
        if missing:
            (gone,) = missing
            held = Counter(party(k) for k in model)
            most = max(held.values())
            assert held[party(gone)] == most
            assert gone == next(k for k in model if party(k) == party(gone))  # its oldest
            if held[party(key)] == most and most > 1:
                assert party(gone) == party(key)
            if most == 1:  # one each: the oldest of them all
                assert gone == next(iter(model))
            del model[gone]
        assert len(window) == len(model)
