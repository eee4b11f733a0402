"""The console's live copy of the fleet view keeps no record that grows with what VMs say.

The fleet view records, for the approver, which groups may have room again and which VMs' held
events are to be decided again, until the approver takes them (``FleetView.take_changes``). The
console's copy never took them: every group name a heartbeat gave (any VM may name a new scale
set, zone or fault domain in each one) stayed in those sets for the life of the console.
Measured in memory with tracemalloc; the console's only input here is messages, as from its
stream."""

from __future__ import annotations

import tracemalloc
from datetime import timedelta

from consumers.console._live import LiveFleet
from tests.consumers._factory import T0, heartbeat, vm


def _kept(live: LiveFleet, messages: int, offset: int) -> int:
    """Bytes still allocated after ``messages`` heartbeats of one VM, each naming a new scale
    set (the rows taken after each, as the page does)."""
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for n in range(offset, offset + messages):
            live.apply(heartbeat(vm("web-1", scale_set=f"ss-{n}"), at=T0 + timedelta(seconds=n)))
            live.take_changes()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    return sum(stat.size_diff for stat in after.compare_to(before, "filename"))


def test_group_names_vms_give_do_not_pile_up_in_the_consoles_fleet_view() -> None:
    live = LiveFleet()
    _kept(live, 2_000, 0)  # warm-up: caches, interned strings, the view's own tables
    kept = _kept(live, 20_000, 2_000)
    # Before: 4.35 MB (each group name kept in the view's record of freed room); now 4 KB.
    assert kept < 800_000, f"{kept} bytes kept for 20,000 heartbeats"
    assert live.fleet.take_changes() == (set(), set())
    live.prune(T0 + timedelta(days=30))  # the VM falls silent and leaves its group
    assert live.fleet.take_changes() == (set(), set())
