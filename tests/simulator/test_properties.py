"""Properties over random sequences of operations, in-process with a manual clock.

Whatever happens, for every VM: the DocumentIncarnation never goes back; when it stays put the
VM's visible list (ids and statuses) stays put too; an event is listed for exactly the VMs
in its Resources while Scheduled or Started; and a Started event never shows a NotBefore.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from publisher.simulator import (
    EventSpec,
    EventState,
    EventStatus,
    EventType,
    ManualClock,
    Simulator,
    SimulatorConfig,
    SimulatorError,
)

VMS = ("a", "b", "c")


def _spec(**fields: Any) -> EventSpec:
    return EventSpec(**fields)


# Not st.builds(EventSpec): its signature names the JSON aliases, which hypothesis would fill too.
specs = st.builds(
    _spec,
    event_type=st.sampled_from(list(EventType)),
    resources=st.one_of(
        st.none(), st.lists(st.sampled_from(VMS), min_size=1, max_size=3, unique=True).map(tuple)
    ),
    event_status=st.sampled_from(list(EventStatus)),
    run_seconds=st.floats(min_value=0, max_value=120),
    require_all_approvals=st.booleans(),
)

operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), specs),
        st.tuples(st.just("advance"), st.floats(min_value=0, max_value=1000)),
        st.tuples(st.just("approve"), st.sampled_from(VMS), st.integers(0, 20)),
        st.tuples(st.just("cancel"), st.integers(0, 20)),
        st.tuples(st.just("start"), st.integers(0, 20)),
        st.tuples(st.just("complete"), st.integers(0, 20)),
    ),
    max_size=40,
)


def _visible(document: dict[str, Any]) -> list[tuple[str, str]]:
    return [(e["EventId"], e["EventStatus"]) for e in document["Events"]]


@settings(max_examples=150, deadline=None)
@given(operations)
def test_incarnations_track_exactly_the_visible_changes(ops: list[tuple[Any, ...]]) -> None:
    clock = ManualClock()
    sim = Simulator(SimulatorConfig(speed=60, rate_limit=0), clock=clock, vms=VMS)
    ids: list[str] = []
    before = {vm: sim.scheduled_events_document(vm) for vm in VMS}
    for op in ops:
        try:
            if op[0] == "add":
                ids.append(sim.add_event(op[1]).event_id)
            elif op[0] == "advance":
                clock.advance(op[1] / 60)
            elif ids:
                event_id = ids[op[-1] % len(ids)]
                if op[0] == "approve":
                    sim.approve(op[1], [event_id])
                elif op[0] == "cancel":
                    sim.cancel_event(event_id)
                elif op[0] == "start":
                    sim.start_event(event_id)
                else:
                    sim.complete_event(event_id)
        except SimulatorError:
            pass  # refused steps (unknown to that VM, wrong state) change nothing
        for vm in VMS:
            after = sim.scheduled_events_document(vm)
            old, new = before[vm]["DocumentIncarnation"], after["DocumentIncarnation"]
            assert new >= old
            # The documented guarantee: the same incarnation holds the same events. (An event
            # born and gone between two looks moves it with no visible difference: that's fine.)
            if new == old:
                assert _visible(after) == _visible(before[vm])
            for shown in after["Events"]:
                assert vm in shown["Resources"]
                assert (shown["NotBefore"] == "") == (shown["EventStatus"] == "Started")
            before[vm] = after
        for event in sim.events():
            listed = event.state in (EventState.SCHEDULED, EventState.STARTED)
            for vm in VMS:
                shown_ids = {e["EventId"] for e in before[vm]["Events"]}
                assert (event.event_id in shown_ids) == (listed and vm in event.resources)
