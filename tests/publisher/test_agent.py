"""The agent end to end: simulator over HTTP -> agent -> broker -> a consumer group.

Each test runs against the in-memory broker and the real RabbitMQ (``broker`` fixture)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from cloudevents.core.formats.json import JSONFormat

from publisher.simulator import EventSpec, EventStatus, EventType, FaultSpec
from schemas import MessageType, TransitionMessage

from .conftest import Broker
from .harness import eventually, recorder, running, settings_for, simulator_server

SCHEMA_DIR = Path(__file__).parents[2] / "schemas" / "jsonschema"
TRANSITION_SCHEMA = json.loads((SCHEMA_DIR / "transition.json").read_text())


def _kinds_of(messages: list[Any], event_id: str) -> list[str]:
    return [m.kind.value for m in messages if m.kind.is_transition and m.subject == event_id]


def _assert_valid_cloudevent(body: bytes) -> None:
    event = JSONFormat().read(None, body)
    assert event.get_specversion() == "1.0"
    jsonschema.validate(json.loads(body), TRANSITION_SCHEMA, cls=jsonschema.Draft202012Validator)


async def test_every_transition_kind_is_published_once_as_a_valid_cloudevent(
    broker: Broker, tmp_path: Path
) -> None:
    async with (
        simulator_server("web-7", speed=60) as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        sim = server.simulator
        settings = settings_for(server, "web-7", broker.url, broker.channels, tmp_path)
        async with running(settings):
            freeze = sim.add_event(
                EventSpec(event_type=EventType.FREEZE, not_before_seconds=600, run_seconds=600)
            )
            born = sim.add_event(
                EventSpec(
                    event_type=EventType.REBOOT,
                    event_status=EventStatus.STARTED,
                    run_seconds=600,
                )
            )
            doomed = sim.add_event(EventSpec(event_type=EventType.REDEPLOY, not_before_seconds=600))
            await rec.wait_kind(MessageType.SCHEDULED, 2)
            await rec.wait_kind(MessageType.STARTED, 1)
            # "updated": IMDS serves the same event with a later NotBefore and a new text.
            wire = sim.scheduled_events_document("web-7")
            changed = dict(wire)
            changed["Events"] = [
                {**e, "NotBefore": "Mon, 01 Jan 2046 00:00:00 GMT", "Description": "moved"}
                if e["EventId"] == freeze.event_id
                else e
                for e in wire["Events"]
            ]
            sim.add_fault(
                FaultSpec(vm="web-7", endpoint="scheduledevents", times=3, body=json.dumps(changed))
            )
            await rec.wait_kind(MessageType.UPDATED, 1)
            await rec.wait_kind(MessageType.UPDATED, 2)  # and back when the fault is used up
            sim.start_event(freeze.event_id)
            sim.cancel_event(doomed.event_id)
            await rec.wait_kind(MessageType.STARTED, 2)
            await rec.wait_kind(MessageType.CANCELED, 1)
            sim.complete_event(freeze.event_id)
            sim.complete_event(born.event_id)
            await rec.wait_kind(MessageType.COMPLETED, 2)
            await asyncio.sleep(0.5)  # nothing more may come
        await rec.wait_kind(MessageType.AGENT_OFFLINE)

    messages = rec.messages
    assert _kinds_of(messages, freeze.event_id) == [
        "scheduled",
        "updated",
        "updated",
        "started",
        "completed",
    ]
    assert _kinds_of(messages, born.event_id) == ["started", "completed"]
    assert _kinds_of(messages, doomed.event_id) == ["scheduled", "canceled"]
    for message, body in zip(messages, rec.bodies, strict=True):
        if message.kind.is_transition:
            _assert_valid_cloudevent(body)
            assert isinstance(message, TransitionMessage)
            assert message.routing_key == f"{message.kind.value}.{message.event_type}.web-7"
            assert message.data.reply_to.key == "web-7"
    updated = [m for m in messages if m.kind is MessageType.UPDATED]
    assert updated[0].data.event.description == "moved"  # type: ignore[union-attr]
    assert len({m.id for m in messages}) == len(messages)
    sequences = [m.sequence for m in messages]
    assert sequences == sorted(sequences)
    assert messages[0].kind is MessageType.AGENT_ONLINE
    assert messages[-1].kind is MessageType.AGENT_OFFLINE


@pytest.mark.parametrize(
    "fault",
    [
        FaultSpec(status=500, times=3),
        FaultSpec(status=429, times=3),
        FaultSpec(status=503, times=3),
        FaultSpec(status=410, times=3),
        FaultSpec(body="<html>not json</html>", times=3),
        FaultSpec(body='{"DocumentIncarnation": 9}', times=3),  # no Events list: not "none"
        FaultSpec(delay_seconds=3, times=2),
    ],
    ids=["500", "429", "503", "410", "garbage", "partial", "silence"],
)
async def test_imds_failing_for_a_while_emits_no_transition(
    fault: FaultSpec, tmp_path: Path
) -> None:
    async with (
        simulator_server("web-7") as server,
        recorder("memory://faults", _channels(tmp_path)) as rec,
    ):
        sim = server.simulator
        sim.add_event(EventSpec(event_type=EventType.FREEZE, not_before_seconds=600))
        sim.add_event(
            EventSpec(
                event_type=EventType.REBOOT, event_status=EventStatus.STARTED, run_seconds=600
            )
        )
        settings = settings_for(
            server,
            "web-7",
            "memory://faults",
            _channels(tmp_path),
            tmp_path,
            imds_timeout=1.0,
            poll_interval=0.3,
        )
        async with running(settings) as agent:
            await rec.wait_for(lambda ms: len([m for m in ms if m.kind.is_transition]) == 2)
            sim.add_fault(fault.model_copy(update={"vm": "web-7", "endpoint": "scheduledevents"}))
            await eventually(lambda: not any(f.remaining for f in sim.faults()), 15)
            await asyncio.sleep(1.5)  # a few good polls after the fault
            errors = agent.metrics.registry.get_sample_value
            counted = sum(
                errors("agent_imds_errors_total", {"kind": k}) or 0
                for k in ("server", "throttled", "gone", "garbage", "timeout")
            )
            assert counted >= 1
    kinds = [m.kind.value for m in rec.transitions()]
    assert sorted(kinds) == ["scheduled", "started"]


def _channels(tmp_path: Path) -> Any:
    from schemas.channels import ChannelNames

    return ChannelNames().suffixed(tmp_path.name)


@pytest.mark.parametrize("all_events", [False, True], ids=["own", "all-events"])
async def test_events_of_other_vms_are_published_only_with_all_events(
    broker: Broker, tmp_path: Path, all_events: bool
) -> None:
    async with (
        simulator_server("web-7", "web-9", speed=60) as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        sim = server.simulator
        # The agent reads web-7's document but is told (instance metadata) it is web-9: the
        # document then holds an event that does not list it, as a shared document does.
        sim.add_fault(
            FaultSpec(
                vm="web-7",
                endpoint="instance",
                times=1,
                body=json.dumps(sim.instance_document("web-9")),
            )
        )
        theirs = sim.add_event(
            EventSpec(event_type=EventType.REBOOT, resources=["web-7"], not_before_seconds=600)
        )
        shared = sim.add_event(
            EventSpec(
                event_type=EventType.REDEPLOY, resources=["web-7", "web-9"], not_before_seconds=600
            )
        )
        settings = settings_for(
            server, "web-7", broker.url, broker.channels, tmp_path, all_events=all_events
        )
        async with running(settings) as agent:
            assert agent.identity is not None
            assert agent.identity.name == "web-9"
            await rec.wait_for(lambda ms: any(m.subject == shared.event_id for m in ms))
            sim.cancel_event(theirs.event_id)
            sim.cancel_event(shared.event_id)
            await rec.wait_kind(MessageType.CANCELED)
            await asyncio.sleep(1.2)
        seen = [(m.kind.value, m.subject) for m in rec.transitions()]
    expected = [("scheduled", shared.event_id), ("canceled", shared.event_id)]
    if all_events:
        expected += [("scheduled", theirs.event_id), ("canceled", theirs.event_id)]
    assert sorted(seen) == sorted(expected)
