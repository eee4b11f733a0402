"""An event IMDS lists but describes in a way that cannot be read (a field missing, an EventId
over 200 characters, Resources that are not names...) costs that event, not the answer: the
agent publishes the answer's other events, holds the unreadable one at its last readable state
(never reported gone, never announced again), reports no disappearance while an item without a
readable EventId is listed, refuses an approval of it without a POST, and says so in its log and
metrics. Before, one such event made the whole answer an IMDS error: the VM's own Reboot beside
a neighbour's broken event was never reported for as long as IMDS listed it.

The simulator over HTTP serves the crafted answers (a fault's body, GETs only: the approvals'
POSTs reach the simulator, which records them); the in-memory broker, or RabbitMQ too where the
``broker`` fixture runs both."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from publisher.simulator import EventSpec, EventType, FaultSpec, Simulator
from schemas import ApprovalOutcomeMessage, MessageType, RejectReason
from schemas.channels import ChannelNames

from .conftest import Broker
from .harness import (
    Recorder,
    eventually,
    recorder,
    running,
    settings_for,
    signed_approval,
    simulator_server,
)
from .test_approvals import _outcome, _send, _web7


def _broker() -> tuple[str, ChannelNames]:
    unique = uuid.uuid4().hex[:8]
    return f"memory://unreadable-{unique}", ChannelNames().suffixed(unique)


def _transitions(rec: Recorder, event_id: str) -> list[str]:
    return [m.kind.value for m in rec.transitions() if m.subject == event_id]


class Answers:
    """What IMDS answers web-7 from now on (GETs only), each answer a newer incarnation than
    the last, starting above the simulator's own."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.incarnation = sim.incarnation("web-7") + 100

    def serve(self, *events: dict[str, Any]) -> None:
        self.incarnation += 1
        body = json.dumps({"DocumentIncarnation": self.incarnation, "Events": list(events)})
        self.sim.clear_faults()
        self.sim.add_fault(
            FaultSpec(
                vm="web-7", endpoint="scheduledevents", method="GET", body=body, times=100_000
            )
        )


def _as_served(sim: Simulator, event_id: str) -> dict[str, Any]:
    """The event as the simulator's IMDS shows it to web-7 now."""
    (event,) = [
        e for e in sim.scheduled_events_document("web-7")["Events"] if e["EventId"] == event_id
    ]
    return dict(event)


def _without(event: dict[str, Any], field: str) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k != field}


def _started(event: dict[str, Any]) -> dict[str, Any]:
    return dict(event, EventStatus="Started", NotBefore="")


def _count(agent: Any, name: str, labels: dict[str, str] | None = None) -> float:
    return agent.metrics.registry.get_sample_value(name, labels) or 0.0


async def _polls(agent: Any, count: int) -> None:
    """Wait until the agent has answered ``count`` more polls."""
    target = _count(agent, "agent_imds_polls_total") + count
    await eventually(lambda: _count(agent, "agent_imds_polls_total") >= target, 10)


def _posts(sim: Simulator) -> list[str]:
    """The POSTs (StartRequests) web-7 made to IMDS."""
    return [r.path for r in sim.requests(vm="web-7") if r.method == "POST"]


def _unreadable_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]


async def test_the_vms_own_reboot_beside_a_neighbours_event_without_event_type_is_published(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A placement group's answer: web-7's own Reboot, and a neighbour's event that came
    without its EventType. The Reboot is reported ``scheduled``; IMDS is not counted failing;
    the operator is told once which event is unreadable, why, and what the agent does."""
    broker, channels = _broker()
    caplog.set_level(logging.WARNING, logger="publisher._watch")
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        sim = server.simulator
        reboot = sim.add_event(
            EventSpec(event_type=EventType.REBOOT, resources=["web-7"], not_before_seconds=900)
        )
        own = _as_served(sim, reboot.event_id)
        neighbour_id = str(uuid.uuid4()).upper()
        neighbour = _without(dict(own, EventId=neighbour_id, Resources=["web-8"]), "EventType")
        Answers(sim).serve(neighbour, own)
        settings = settings_for(server, "web-7", broker, channels, tmp_path, poll_interval=0.2)
        async with running(settings) as agent:
            await rec.wait_kind(MessageType.SCHEDULED, within=10)
            await _polls(agent, 3)  # the same answer again: warned about once
            garbage = _count(agent, "agent_imds_errors_total", {"kind": "garbage"})
            seen = _count(agent, "agent_imds_unreadable_events_total")
            listed = _count(agent, "agent_imds_unreadable_events_listed")
    assert _transitions(rec, reboot.event_id) == ["scheduled"]
    assert garbage == 0
    assert (seen, listed) == (1, 1)
    (warned,) = _unreadable_warnings(caplog)
    assert repr(neighbour_id) in warned
    assert "EventType" in warned
    assert "its other events are published" in warned
    assert "held at its last readable state" in warned


async def test_an_event_unreadable_for_a_while_then_readable_again_invents_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """web-7's Freeze turns unreadable (a DurationInSeconds that is not a number) for a few
    polls, across a restart of the agent, while another event of web-7 appears: the new one is
    reported, the unreadable one is neither reported gone nor announced again, and its later
    start and end are reported once each against its last readable state."""
    broker, channels = _broker()
    caplog.set_level(logging.WARNING, logger="publisher._watch")
    state = tmp_path / "state"
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        sim = server.simulator
        freeze = sim.add_event(
            EventSpec(event_type=EventType.FREEZE, resources=["web-7"], not_before_seconds=900)
        )
        reboot = sim.add_event(
            EventSpec(event_type=EventType.REBOOT, resources=["web-7"], not_before_seconds=900)
        )
        first, second = _as_served(sim, freeze.event_id), _as_served(sim, reboot.event_id)
        unreadable = dict(first, DurationInSeconds="soon")
        answers = Answers(sim)
        answers.serve(first)
        settings = settings_for(server, "web-7", broker, channels, state, poll_interval=0.2)
        async with running(settings) as agent:
            await rec.wait_kind(MessageType.SCHEDULED, 1)
            answers.serve(unreadable, second)
            await rec.wait_kind(MessageType.SCHEDULED, 2)
            await _polls(agent, 3)
        # Restarted while the Freeze is still unreadable: the stored document holds it as last
        # read, so the agent neither drops it nor announces it again once it is readable.
        async with running(settings) as agent:
            await _polls(agent, 3)
            answers.serve(first, second)
            await _polls(agent, 3)
            answers.serve(_started(first), second)
            await rec.wait_kind(MessageType.STARTED, 1)
            answers.serve(second)
            await rec.wait_kind(MessageType.COMPLETED, 1)
            await _polls(agent, 3)
    assert _transitions(rec, freeze.event_id) == ["scheduled", "started", "completed"]
    assert _transitions(rec, reboot.event_id) == ["scheduled"]
    warned = _unreadable_warnings(caplog)
    assert len(warned) == 2  # once per agent run while IMDS listed it
    assert all("DurationInSeconds" in w for w in warned)


async def test_an_item_without_a_readable_event_id_holds_back_disappearances_until_gone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An unreadable item whose EventId cannot be read could be any event: while IMDS lists
    it, web-7's events missing from the answer are not reported ended (a new one is reported
    all the same); once it is gone, what ended meanwhile is reported, once."""
    broker, channels = _broker()
    caplog.set_level(logging.WARNING, logger="publisher._watch")
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        sim = server.simulator
        freeze, reboot, redeploy = (
            sim.add_event(EventSpec(event_type=kind, resources=["web-7"], not_before_seconds=900))
            for kind in (EventType.FREEZE, EventType.REBOOT, EventType.REDEPLOY)
        )
        a, b, c = (_as_served(sim, e.event_id) for e in (freeze, reboot, redeploy))
        nameless = _without(dict(a, Resources=["web-8"]), "EventId")
        answers = Answers(sim)
        answers.serve(a, _started(b))
        settings = settings_for(server, "web-7", broker, channels, tmp_path, poll_interval=0.2)
        async with running(settings) as agent:
            await rec.wait_kind(MessageType.STARTED, 1)
            await rec.wait_kind(MessageType.SCHEDULED, 1)
            answers.serve(nameless, c)
            await rec.wait_kind(MessageType.SCHEDULED, 2)
            await _polls(agent, 5)
            assert not rec.of(MessageType.CANCELED, MessageType.COMPLETED)
            answers.serve(c)
            await rec.wait_kind(MessageType.CANCELED, 1)
            await rec.wait_kind(MessageType.COMPLETED, 1)
            await _polls(agent, 3)
    assert _transitions(rec, freeze.event_id) == ["scheduled", "canceled"]
    assert _transitions(rec, reboot.event_id) == ["started", "completed"]
    assert _transitions(rec, redeploy.event_id) == ["scheduled"]
    (warned,) = _unreadable_warnings(caplog)
    assert "EventId" in warned
    assert "no event is taken for ended" in warned


async def test_an_approval_of_an_unreadable_event_is_refused_and_nothing_is_posted(
    broker: Broker, tmp_path: Path
) -> None:
    """The agent still holds the event as it last read it, Scheduled: an approval bound to that
    version must not start what IMDS now describes in a way that cannot be read. It is refused
    (``imds-refused``: the approver tries again later) with a reason that says so, and nothing
    is POSTed; once the event reads again, an approval is applied."""
    spec = EventSpec(event_type=EventType.REBOOT, resources=["web-7"], not_before_seconds=900)
    async with _web7(broker, tmp_path, spec) as (sim, rec, event, key, settings):
        served = _as_served(sim, event.event_id)
        answers = Answers(sim)
        answers.serve(served)
        async with running(replace(settings, poll_interval=0.2)) as agent:
            await rec.wait_kind(MessageType.SCHEDULED)
            answers.serve(_without(served, "EventStatus"))
            await eventually(lambda: _count(agent, "agent_imds_unreadable_events_listed") == 1, 10)
            # Decided just before a poll: it is checked on that poll's answer at once (the path
            # that could reach the document the agent trusts, where the event is held).
            refused = signed_approval(sim, event.event_id, "web-7", key)
            await _polls(agent, 1)
            await _send(broker, refused)
            outcome = await _outcome(rec, refused.approval_id)
            assert isinstance(outcome, ApprovalOutcomeMessage)
            assert outcome.kind is MessageType.APPROVAL_REJECTED
            assert outcome.data.reason == RejectReason.IMDS_REFUSED.value
            assert "cannot be read" in outcome.data.detail
            assert "EventStatus" in outcome.data.detail
            await asyncio.sleep(0.5)
            assert _posts(sim) == []
            answers.serve(served)
            await _polls(agent, 2)
            applied = signed_approval(sim, event.event_id, "web-7", key)
            await _send(broker, applied)
            assert (await _outcome(rec, applied.approval_id)).data.applied
            assert len(_posts(sim)) == 1
