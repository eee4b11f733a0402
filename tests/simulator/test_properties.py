"""Properties over random sequences of operations, in-process with a manual clock.

Whatever happens, for every VM: the DocumentIncarnation never goes back; when it stays put the
VM's visible list (ids and statuses) stays put too; an event is listed, while Scheduled or
Started, for exactly the VMs of its Resources and the rest of their sets (standalone "a" and
"b"; "s_0" and "s_3" share a placement group, "s_1" is alone in another); and a Started event
never shows a NotBefore.
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

VMS = ("a", "b", "s_0", "s_3", "s_1")
GROUPS = {"a": {"a"}, "b": {"b"}, "s_0": {"s_0", "s_3"}, "s_3": {"s_0", "s_3"}, "s_1": {"s_1"}}


def _spec(**fields: Any) -> EventSpec:
    return EventSpec(**fields)


# Not st.builds(EventSpec): its signature names the JSON aliases, which hypothesis would fill too.
specs = st.builds(
    _spec,
    event_type=st.sampled_from(list(EventType)),
    resources=st.one_of(
        st.none(), st.lists(st.sampled_from(VMS), min_size=1, max_size=4, unique=True).map(tuple)
    ),
    event_status=st.sampled_from(list(EventStatus)),
    run_seconds=st.floats(min_value=0, max_value=120),
    require_all_approvals=st.booleans(),
)

# Scale-set deletes: one Terminate per VM, in one of two operations.
deletions = st.builds(
    _spec,
    event_type=st.just(EventType.TERMINATE),
    resources=st.sampled_from(VMS).map(lambda vm: (vm,)),
    operation_id=st.sampled_from(["op-1", "op-2"]),
    run_seconds=st.floats(min_value=0, max_value=120),
)

operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), specs),
        st.tuples(st.just("add"), deletions),
        st.tuples(st.just("advance"), st.floats(min_value=0, max_value=1000)),
        st.tuples(st.just("approve"), st.sampled_from(VMS), st.integers(0, 20)),
        st.tuples(st.just("cancel"), st.integers(0, 20)),
        st.tuples(st.just("start"), st.integers(0, 20)),
        st.tuples(st.just("complete"), st.integers(0, 20)),
        st.tuples(
            st.just("update"),
            st.fixed_dictionaries(
                {},
                optional={
                    "duration_in_seconds": st.integers(-1, 30),
                    "not_before_seconds": st.floats(min_value=0, max_value=2000),
                    "resources": st.lists(
                        st.sampled_from(VMS), min_size=1, max_size=4, unique=True
                    ),
                    "description": st.sampled_from(["x", "y"]),
                },
            ).filter(bool),
            st.integers(0, 20),
        ),
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
                elif op[0] == "update":
                    sim.update_event(event_id, **op[1])
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
                assert vm in set().union(*(GROUPS[r] for r in shown["Resources"]))
                assert (shown["NotBefore"] == "") == (shown["EventStatus"] == "Started")
            before[vm] = after
        for event in sim.events():
            listed = event.state in (EventState.SCHEDULED, EventState.STARTED)
            audience = set().union(*(GROUPS[r] for r in event.resources))
            assert set(event.seen_by) == audience
            for vm in VMS:
                shown_ids = {e["EventId"] for e in before[vm]["Events"]}
                assert (event.event_id in shown_ids) == (listed and vm in audience)
        # An approved deletion waits only while another of its operation is unapproved.
        for event in sim.events(EventState.SCHEDULED):
            if event.operation_id is not None and event.approvals:
                siblings = [
                    e
                    for e in sim.events(EventState.SCHEDULED)
                    if e.operation_id == event.operation_id
                ]
                assert any(not e.approvals for e in siblings)
