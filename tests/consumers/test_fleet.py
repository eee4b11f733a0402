"""The fleet view: one event as every VM of its Resources reported it, and agent liveness."""

from __future__ import annotations

import copy
from datetime import datetime, timedelta
from typing import Any

import pytest

from consumers import EventPhase, FleetView
from consumers import _fleet as fleet_module
from consumers._fleet import MAX_HOOKS_PER_VM, MAX_OUTCOMES_PER_VM, SentApproval
from schemas import LifecycleMessage, MessageType, event_version

from ._factory import T0, event, heartbeat, hook, outcome, transition, vm


def test_one_event_merged_across_the_vms_of_its_resources():
    view = FleetView(clock=lambda: T0 + timedelta(minutes=5))
    resources = ("web-1", "web-2", "web-3")
    scheduled = event("EVT-9", resources=resources, not_before=T0 + timedelta(minutes=15))
    view.apply(transition("scheduled", scheduled, vm("web-1"), at=T0))
    view.apply(transition("scheduled", scheduled, vm("web-2"), at=T0 + timedelta(seconds=2)))
    state = view.event("EVT-9")
    assert state is not None
    assert state.phase is EventPhase.SCHEDULED
    assert state.reported() == ("web-1", "web-2")
    assert state.silent() == ("web-3",)
    assert state.time_to_not_before(T0 + timedelta(minutes=5)) == timedelta(minutes=10)
    assert state.reports["web-2"].at == T0 + timedelta(seconds=2)

    started = event("EVT-9", resources=resources, status="Started")
    view.apply(transition("started", started, vm("web-2"), at=T0 + timedelta(minutes=16)))
    assert state.phase.value == "started"
    assert state.started
    assert not state.completed
    assert state.time_to_not_before() is None
    assert state.reports["web-2"].kind is MessageType.STARTED
    assert state.reports["web-1"].kind is MessageType.SCHEDULED  # web-1 has not seen it yet

    view.apply(transition("completed", started, vm("web-1"), at=T0 + timedelta(minutes=20)))
    assert not state.completed  # web-2, live, still reports it running: it speaks for itself
    view.apply(transition("completed", started, vm("web-2"), at=T0 + timedelta(minutes=20)))
    assert state.completed
    # A late, older report never moves the event backwards.
    view.apply(transition("scheduled", scheduled, vm("web-3"), at=T0 + timedelta(seconds=5)))
    assert state.phase is EventPhase.COMPLETED
    assert state.silent() == ()


def test_a_canceled_event_and_hooks_and_approval_outcomes():
    view = FleetView()
    ev = event("EVT-2", resources=("a", "b"))
    view.apply(transition("scheduled", ev, vm("a")))
    view.apply(hook(vm("a"), ev))
    view.apply(hook(vm("b"), ev, exit_code=3))
    state = view.event("EVT-2")
    assert state is not None
    assert state.hooks_done("a")
    assert not state.hooks_done("b")
    assert not state.approved
    view.apply(outcome(vm("a"), ev, applied=True))
    assert state.approved
    view.apply(transition("canceled", ev, vm("a"), at=T0 + timedelta(minutes=1)))
    assert state.canceled
    assert state.phase.is_over
    assert list(view.events(open_only=True)) == []
    assert view.prune(T0 + timedelta(hours=2)) == ["EVT-2"]
    assert view.event("EVT-2") is None


def test_liveness_follows_heartbeats_and_offline():
    now = [T0]
    view = FleetView(liveness_timeout=timedelta(seconds=90), clock=lambda: now[0])
    view.apply(heartbeat(vm("web-1"), at=T0))
    view.apply(heartbeat(vm("web-2"), at=T0))
    view.apply(transition("scheduled", event("E", resources=("web-1", "web-2")), vm("web-2")))
    assert view.live_vms("E") == ("web-1", "web-2")
    now[0] = T0 + timedelta(seconds=100)
    view.apply(heartbeat(vm("web-2"), at=now[0]))
    assert view.live_vms("E") == ("web-2",)  # web-1 went silent
    view.apply(heartbeat(vm("WEB-2"), at=now[0], kind=MessageType.AGENT_OFFLINE))
    assert view.live_vms("E") == ()
    agent = view.agent("web-2")
    assert agent is not None
    assert agent.offline_reason == "SIGTERM"
    assert agent.last_heartbeat == now[0]
    address = view.reply_address("web-2")
    assert address is not None
    assert address.key == "WEB-2"


def test_an_agent_is_live_for_the_heartbeat_interval_it_declares():
    """An operator may lengthen the agents' heartbeats (at 10,000 VMs a heartbeat a minute is
    167 messages a second to every consumer group). Each agent says in its own messages how
    long it may stay quiet, and the view counts it live for 2.5 of those intervals when that is
    longer than its own ``liveness_timeout``: one heartbeat may be lost, the next late. An agent
    that declares nothing (older than schema 1.2) is judged by ``liveness_timeout`` alone, as is
    one whose newer message no longer declares an interval."""
    now = [T0]
    view = FleetView(liveness_timeout=timedelta(seconds=150), clock=lambda: now[0])
    view.apply(heartbeat(vm("slow"), at=T0, heartbeat_interval=300.0))
    view.apply(heartbeat(vm("plain"), at=T0))
    view.apply(heartbeat(vm("brisk"), at=T0, heartbeat_interval=10.0))
    now[0] = T0 + timedelta(seconds=149)
    assert [view.is_live(name) for name in ("slow", "plain", "brisk")] == [True, True, True]
    now[0] = T0 + timedelta(seconds=200)  # within 2.5 x 300 s, past 150 s
    assert [view.is_live(name) for name in ("slow", "plain", "brisk")] == [True, False, False]
    agent = view.agent("slow")
    assert agent is not None
    assert agent.heartbeat_interval == 300.0
    assert view.liveness_of(agent) == timedelta(seconds=750)
    now[0] = T0 + timedelta(seconds=751)
    assert not view.is_live("slow")
    # Heard again, from an agent that no longer declares an interval: the view's own timeout.
    view.apply(heartbeat(vm("slow"), at=now[0]))
    now[0] += timedelta(seconds=200)
    assert not view.is_live("slow")


def test_an_end_waits_for_a_vm_whose_agent_declared_a_long_heartbeat_interval():
    """A VM's event started; another VM that sees it reports it over. VM a says nothing while
    its event runs (nothing changes) and heartbeats every 10 minutes, as it declared: five
    minutes later it is still live, so the event stays open and a stays down. Judged by the
    view's 150 s alone, the event ended at that prune and a's fault domain counted a free VM
    while a was in maintenance: a cap on unavailability would have let one more go."""
    now = [T0]
    view = FleetView(clock=lambda: now[0], liveness_timeout=timedelta(seconds=150))
    view.apply(heartbeat(vm("a", fd=1), at=T0, heartbeat_interval=600.0))
    _, started = _started_on_a(view)
    now[0] = T0 + timedelta(minutes=1)
    view.apply(transition("completed", started, vm("b"), at=now[0]))
    now[0] = T0 + timedelta(minutes=6)
    view.prune()
    state = view.event("EVT-5")
    assert state is not None
    assert not state.phase.is_over
    assert view.is_down("a")
    now[0] = T0 + timedelta(minutes=27)  # 2.5 x 10 minutes after a was last heard
    view.prune()
    assert state.completed
    assert not view.is_down("a")


def test_an_outcome_under_another_vms_id_does_not_replace_that_vms_outcome():
    """Ids are the senders' own, and a VM can compute another's. VM b's ``approval.rejected``
    under the id of a's ``approval.applied`` must not erase that the event was approved (the
    approver counts an approved event's VMs as unavailable: without it, the capacity the event
    holds would look free)."""
    view = FleetView()
    ev = event("EVT-3", resources=("a", "b"))
    view.apply(transition("scheduled", ev, vm("a")))
    applied = outcome(vm("a"), ev, applied=True)
    view.apply(applied)
    view.apply(outcome(vm("b"), ev, applied=False).model_copy(update={"id": applied.id}))
    state = view.event("EVT-3")
    assert state is not None
    assert state.approved
    assert state.unavailable
    assert sorted(o.vm.name for o in state.outcomes.values()) == ["a", "b"]


def _started_on_a(view: FleetView):
    """EVT-5 hits VM a only (fault domain 1); a's agent reported it scheduled, then started (a
    is down)."""
    scheduled = event("EVT-5", resources=("a",))
    started = event("EVT-5", resources=("a",), status="Started")
    view.apply(transition("scheduled", scheduled, vm("a", fd=1), at=T0))
    view.apply(transition("started", started, vm("a", fd=1), at=T0 + timedelta(minutes=1)))
    return scheduled, started


def test_a_vm_cannot_end_another_vms_event_for_it():
    """Each VM speaks for itself. A VM that sees an event (its availability set's) and reports
    it over while the VM the event hits still reports it running must not end it: the
    approver would count that VM available while it is in maintenance, and a cap on
    unavailability would let one more VM of its group go. The event ends once every VM still
    reporting it (its agent live) says so."""
    view = FleetView(clock=lambda: T0 + timedelta(minutes=2))
    _, started = _started_on_a(view)
    assert view.is_down("a")
    # Nor can it take a out of the event's Resources with a newer report of its own.
    moved = event("EVT-5", resources=("b",), status="Started")
    view.apply(transition("started", moved, vm("b"), at=T0 + timedelta(seconds=80)))
    assert view.is_down("a")
    view.apply(transition("completed", moved, vm("b"), at=T0 + timedelta(seconds=90)))
    state = view.event("EVT-5")
    assert state is not None
    assert state.started
    assert not state.phase.is_over
    assert view.is_down("a")
    view.apply(transition("completed", started, vm("a", fd=1), at=T0 + timedelta(minutes=2)))
    assert state.completed
    assert not view.is_down("a")


def test_an_end_waits_only_for_vms_whose_agents_are_live():
    """A VM whose agent went silent (or said it went offline) does not keep an event open that
    another VM reported over (it cannot report the end): the end applies at the first prune
    after the agent's liveness ran out."""
    now = [T0 + timedelta(minutes=2)]
    view = FleetView(clock=lambda: now[0], liveness_timeout=timedelta(minutes=2))
    _, started = _started_on_a(view)
    view.apply(transition("completed", started, vm("b"), at=now[0]))
    state = view.event("EVT-5")
    assert state is not None
    assert not state.phase.is_over  # a was heard from a minute ago
    now[0] = T0 + timedelta(minutes=4)
    view.prune()
    assert state.completed
    assert not view.is_down("a")
    freed, _ = view.take_changes()
    assert ("fault_domain", 1) in freed  # the approver decides again what a's group held


def test_a_vm_down_that_moves_to_another_group_reports_room_in_the_group_it_left():
    """VM a is down (its event started) in scale set S and fault domain 1; a redeploy moves it
    to scale set S2, same fault domain. S has one VM down fewer: the change says so, so the
    approver decides again what S holds. S2 has one more down and fault domain 1 is as it was:
    no room there. a's own held events are decided again too (its groups changed). Before,
    the move was reported as no change at all, and what S held waited for S's next change."""
    view = FleetView(clock=lambda: T0 + timedelta(minutes=2))
    view.apply(heartbeat(vm("b", scale_set="S", fd=1), at=T0))
    started = event("EVT-5", resources=("a",), status="Started")
    view.apply(transition("started", started, vm("a", scale_set="S", fd=1), at=T0))
    assert view.down_in("scale_set", "S") == {"a"}
    view.take_changes()
    view.apply(heartbeat(vm("a", scale_set="S2", fd=1), at=T0 + timedelta(minutes=2)))
    freed, downed = view.take_changes()
    assert freed == {("scale_set", "S")}
    assert downed == {"a"}
    assert view.down_in("scale_set", "S") == set()
    assert view.members("scale_set", "S") == {"b"}
    assert view.down_in("scale_set", "S2") == view.members("scale_set", "S2") == {"a"}
    assert view.down_in("fault_domain", 1) == {"a"}


def test_an_available_vm_that_moves_reports_its_new_group_and_itself():
    """VM b, available, moves from scale set S to S3: S3 has one more VM available (a cap in
    percent of it may allow one more down), and b's own held events are decided again: they
    were held on S, which no longer counts b, and S3 guards them now. Before, b was not
    reported, and its events stayed held on S (S3's room never reached them). S loses an
    available VM: no room freed there."""
    view = FleetView(clock=lambda: T0)
    view.apply(heartbeat(vm("b", scale_set="S"), at=T0))
    view.take_changes()
    view.apply(heartbeat(vm("b", scale_set="S3"), at=T0))
    assert view.take_changes() == ({("scale_set", "S3")}, {"b"})
    # Its identity changing in another way (a new vmId) moves it nowhere: nothing to decide.
    view.apply(heartbeat(vm("b", scale_set="S3").model_copy(update={"vm_id": "new"}), at=T0))
    assert view.take_changes() == (set(), set())


def test_a_vm_sending_a_new_group_in_every_heartbeat_does_not_grow_the_index():
    """A group a VM leaves and no VM is left in is forgotten: a VM that names a new scale set
    in each of 5,000 heartbeats costs the view its current one, not 5,000. Before, each left
    an empty entry behind."""
    view = FleetView(clock=lambda: T0)
    view.apply(heartbeat(vm("a", scale_set="S"), at=T0))
    for n in range(5000):
        view.apply(heartbeat(vm("b", scale_set=f"made-up-{n}"), at=T0))
    assert vars(view)["_members"] == {
        ("scale_set", "S"): {"a"},
        ("scale_set", "made-up-4999"): {"b"},
    }


def test_a_neighbour_reporting_an_event_that_does_not_hit_it_does_not_keep_it_open():
    """An agent with ``--all-events`` reports its neighbours' events too; it is not one of
    their VMs, so its report does not hold their end."""
    view = FleetView(clock=lambda: T0 + timedelta(minutes=2))
    scheduled, started = _started_on_a(view)
    view.apply(transition("scheduled", scheduled, vm("c"), at=T0 + timedelta(minutes=1)))
    view.apply(transition("completed", started, vm("a", fd=1), at=T0 + timedelta(minutes=2)))
    state = view.event("EVT-5")
    assert state is not None
    assert state.completed


def test_a_message_dated_ahead_of_the_clock_is_taken_as_sent_now():
    """A message's time is its sender's word. A VM that dates its heartbeat a year ahead must
    not stay live for a year after it fell silent (it would hold every end it blocks), nor
    keep its report of an event the newest for that long."""
    now = [T0]
    view = FleetView(clock=lambda: now[0], liveness_timeout=timedelta(minutes=2))
    view.apply(heartbeat(vm("b"), at=T0 + timedelta(days=365)))
    assert view.is_live("b")
    now[0] = T0 + timedelta(minutes=10)
    assert not view.is_live("b")  # taken as sent at T0 (+ the clock skew allowed, 5 min)
    ev = event("EVT-8", resources=("a", "b"))
    view.apply(transition("scheduled", ev, vm("b"), at=T0 + timedelta(days=365)))
    later = event("EVT-8", resources=("a", "b"), not_before=T0 + timedelta(hours=2))
    now[0] = T0 + timedelta(minutes=30)
    view.apply(transition("updated", later, vm("a"), at=now[0]))
    state = view.event("EVT-8")
    assert state is not None
    assert state.event == later


def test_a_vm_sending_version_after_version_of_made_up_resources_does_not_pile_them_up():
    """The VMs counted for an event are its Resources as each VM last reported them: a VM's
    newer version replaces its own contribution. One that sends thousands of made-up names in
    version after version costs the view its last version's names, not all of them."""
    view = FleetView(clock=lambda: T0 + timedelta(minutes=2))
    _started_on_a(view)
    for round_ in range(3):
        names = tuple(f"fake-{round_}-{i}" for i in range(1000))
        made_up = event("EVT-5", resources=("b", *names), status="Started")
        at = T0 + timedelta(seconds=70 + round_)
        view.apply(transition("started", made_up, vm("b"), at=at))
    state = view.event("EVT-5")
    assert state is not None
    assert len(state.listed) == 1 + 1 + 1000  # a, b, the last round's names
    assert view.is_down("a")
    assert not view.is_down("fake-0-1")


def test_a_vm_inventing_hook_names_and_approval_ids_does_not_grow_its_event():
    """Hook results are kept by hook name and approval outcomes by id, both the sender's
    word: a VM sending 3,000 of each under new names and ids kept 3,000 of each in its
    event's state while it kept the event open. Now a VM's are bounded per event (the newest
    hooks; its refusals dropped oldest first), and its one applied outcome keeps counting."""
    fleet = FleetView(clock=lambda: T0)
    me = vm("web-1")
    ev = event("EVT-H", resources=("web-1",))
    fleet.apply(transition("scheduled", ev, me, at=T0))
    fleet.apply(outcome(me, ev, at=T0, approval_id="the-real-one"))
    for n in range(3000):
        at = T0 + timedelta(milliseconds=n)
        ran = hook(me, ev, at=at)
        fleet.apply(
            ran.model_copy(update={"data": ran.data.model_copy(update={"hook": f"hook-{n}"})})
        )
        fleet.apply(outcome(me, ev, applied=False, at=at, approval_id=f"A-{n}"))
    state = fleet.event("EVT-H")
    assert state is not None
    assert len(state.hooks["web-1"]) == MAX_HOOKS_PER_VM
    assert "scheduled/hook-2999" in state.hooks["web-1"]  # the newest kept
    assert len(state.outcomes) == MAX_OUTCOMES_PER_VM
    assert state.approved  # the applied outcome was not pushed out


def _picture(view: FleetView) -> dict[str, Any]:
    """Everything the view holds (events, agents, the unavailable index, the changes not yet
    taken), as a copy to compare with later."""
    return copy.deepcopy(vars(view))


def _a_minute_in() -> datetime:
    return T0 + timedelta(minutes=1)


def _fleet_with_history() -> FleetView:
    """Scale set S: EVT-1 on web-1 and web-2, approved and applied (both down); web-1's agent
    heard from."""
    view = FleetView(clock=_a_minute_in)
    web1, web2 = vm("web-1", scale_set="S"), vm("web-2", scale_set="S")
    ev = event("EVT-1", source="User", resources=("web-1", "web-2"))
    view.apply(heartbeat(web1, at=T0))
    view.apply(transition("scheduled", ev, web1, at=T0))
    view.apply(transition("scheduled", ev, web2, at=T0))
    view.apply(outcome(web1, ev, at=T0 + timedelta(seconds=1)))
    return view


_LATER = T0 + timedelta(seconds=30)
_MOVED = event(
    "EVT-1",
    source="User",
    resources=("web-1", "web-2", "web-3"),
    not_before=T0 + timedelta(hours=2),
)
_OTHER = event("EVT-2", resources=("web-3",))
_FAILING: dict[str, LifecycleMessage] = {
    "a-newer-report-of-other-content": transition(
        "updated", _MOVED, vm("web-2", scale_set="S"), at=_LATER
    ),
    "a-new-event-from-a-new-vm": transition("scheduled", _OTHER, vm("web-3", zone="2"), at=_LATER),
    "a-hook-result-of-a-new-event": hook(vm("web-2", scale_set="T"), _OTHER, at=_LATER),
    "an-outcome-of-a-new-event": outcome(vm("web-1", scale_set="S"), _OTHER, at=_LATER),
}


@pytest.mark.parametrize("name", list(_FAILING))
def test_a_message_that_fails_to_apply_leaves_the_view_as_it_was(monkeypatch, name):
    """A message is taken whole or not at all. Half taken (the agent heard, the VM's report
    kept, the event not), the view was neither before nor after it: the stream's retry, the
    next message, or nothing (a message dead-lettered after its retries) was judged against
    it. The failure is injected (the event's version raises once) because no real input is
    known to make applying a message raise any more: a NotBefore with no UTC equivalent did,
    and is now kept as text."""
    message = _FAILING[name]
    view, twin = _fleet_with_history(), _fleet_with_history()
    before = _picture(view)
    failures = [RuntimeError("injected: the event's version could not be computed")]

    def version_failing_once(ev: Any) -> str:
        if failures:
            raise failures.pop()
        return event_version(ev)

    monkeypatch.setattr(fleet_module, "event_version", version_failing_once)
    with pytest.raises(RuntimeError, match="injected"):
        view.apply(message)
    assert not failures  # the step did run, and failed
    assert _picture(view) == before
    # The retry (or the next message) finds the view as if the message had never come: it
    # ends as on a view that never failed.
    view.apply(message)
    twin.apply(message)
    assert _picture(view) == _picture(twin)
    state = view.event(message.subject or "")
    assert state is not None
    assert state.version == event_version(state.event)


def _fleet_with_more_history() -> FleetView:
    """Scale set S: EVT-1 on web-1 and web-2, an approval of it sent to web-2 and web-1's
    applied (both down). Zone 1: EVT-2 started on web-3 and web-4, web-4 reported it over
    while web-3, live, still runs it (its end waits)."""
    view = FleetView(clock=_a_minute_in)
    web1, web2 = vm("web-1", scale_set="S"), vm("web-2", scale_set="S")
    web3, web4 = vm("web-3", zone="1"), vm("web-4", zone="1")
    one = event("EVT-1", source="User", resources=("web-1", "web-2"))
    two = event("EVT-2", resources=("web-3", "web-4"), status="Started")
    view.apply(heartbeat(web1, at=T0))
    view.apply(transition("scheduled", one, web1, at=T0))
    view.apply(transition("scheduled", one, web2, at=T0))
    state = view.event("EVT-1")
    assert state is not None
    state.send(SentApproval("A-2", state.version, "web-2", T0))
    view.refresh(state)
    view.apply(outcome(web1, one, at=T0 + timedelta(seconds=1)))
    view.apply(transition("started", two, web3, at=T0))
    view.apply(transition("started", two, web4, at=T0))
    view.apply(transition("completed", two, web4, at=T0 + timedelta(seconds=2)))
    return view


_SOON = T0 + timedelta(seconds=10)
_ONE = event("EVT-1", source="User", resources=("web-1", "web-2"))
_TWO = event("EVT-2", resources=("web-3", "web-4"), status="Started")
_GIVEN_BACK: dict[str, LifecycleMessage] = {
    "a-new-agent-in-a-group": heartbeat(vm("web-9", scale_set="S"), at=_SOON),
    "a-down-vm-moving-group": heartbeat(vm("web-1", scale_set="T"), at=_SOON),
    "an-agent-going-offline": heartbeat(
        vm("web-3", zone="1"), at=_SOON, kind=MessageType.AGENT_OFFLINE
    ),
    "a-new-event-from-a-new-vm": transition(
        "scheduled", event("EVT-3", resources=("web-5",)), vm("web-5", zone="1"), at=_SOON
    ),
    "a-start": transition(
        "started",
        event("EVT-1", source="User", resources=("web-1", "web-2"), status="Started"),
        vm("web-1", scale_set="S"),
        at=_SOON,
    ),
    "the-last-end": transition("completed", _TWO, vm("web-3", zone="1"), at=_SOON),
    "an-end-that-waits": transition(
        "completed",
        event("EVT-1", source="User", resources=("web-1", "web-2"), status="Started"),
        vm("web-1", scale_set="S"),
        at=_SOON,
    ),
    "new-content-naming-another-vm": transition(
        "updated",
        event("EVT-1", source="User", resources=("web-1", "web-2", "web-3")),
        vm("web-2", scale_set="S"),
        at=_SOON,
    ),
    "a-hook-result": hook(vm("web-2", scale_set="S"), _ONE, at=_SOON),
    "a-refusal": outcome(
        vm("web-2", scale_set="S"), _ONE, applied=False, approval_id="A-2", at=_SOON
    ),
    "an-old-report": transition(
        "scheduled", _ONE, vm("web-1", scale_set="S"), at=T0 - timedelta(hours=1)
    ),
}


def _held(view: FleetView) -> dict[str, Any]:
    """What the view holds (:func:`_picture`), with the changes not yet taken left out and
    groups with no VM left as no group."""
    view.take_changes()
    picture = _picture(view)
    for index in ("_members", "_down_members"):
        picture[index] = {group: vms for group, vms in picture[index].items() if vms}
    return picture


@pytest.mark.parametrize("name", list(_GIVEN_BACK))
def test_a_message_given_back_leaves_the_view_as_if_it_never_came(name):
    """The approver takes a message into the view before it decides on it; when deciding
    fails, the stream retries the message, then dead-letters it, and a dead-lettered message
    is one the approver did not take (its database never has it). Given back, the view is as
    one that never had it: each event, agent, who is down per group, the ends waiting; and
    the changes that makes (a VM down again, room in a group again) are reported. Taken again
    (the retry), it ends as on a view that took it once."""
    message = _GIVEN_BACK[name]
    view, twin = _fleet_with_more_history(), _fleet_with_more_history()
    before = _held(view)
    _, taken = view.take(message)
    if name != "an-old-report":
        assert _held(view) != before  # it did change the view
    view.give_back(taken)
    assert _held(view) == before
    with pytest.raises(RuntimeError, match="only the last message"):
        view.give_back(taken)
    view.apply(message)
    twin.apply(message)
    assert _held(view) == _held(twin)


def test_a_message_given_back_reports_the_room_it_had_freed_as_taken_again():
    """web-3's end of EVT-2 frees zone 1; given back, web-3 and web-4 are down again: the
    change is reported, so whoever decided on the freed room decides again."""
    view = _fleet_with_more_history()
    view.take_changes()
    _, taken = view.take(_GIVEN_BACK["the-last-end"])
    freed, _ = view.take_changes()
    assert freed == {("zone", "1")}
    assert view.down_in("zone", "1") == set()
    view.give_back(taken)
    _, downed = view.take_changes()
    assert downed == {"web-3", "web-4"}
    assert view.down_in("zone", "1") == {"web-3", "web-4"}
