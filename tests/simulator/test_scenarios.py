"""Scenarios: the shipped ones load and play; bad files fail naming the bad field."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from publisher.simulator import (
    EventState,
    EventStatus,
    EventType,
    ManualClock,
    ScenarioError,
    Simulator,
    SimulatorConfig,
    load_scenario,
    run_scenario,
    shipped_scenarios,
)

SHIPPED = {
    "live-migration",
    "user-reboot",
    "spot-preemption",
    "scaleset-terminate",
    "hardware-failure",
    "canceled-redeploy",
    "fleet-wave",
}


def test_the_shipped_scenarios_are_there_and_valid() -> None:
    scenarios = shipped_scenarios()
    assert set(scenarios) == SHIPPED
    for name, scenario in scenarios.items():
        assert scenario.description, name
        assert scenario.all_vms(), name
        scenario.check_vms([])
        assert load_scenario(name) == scenario


async def test_live_migration_plays_the_documents_sequence() -> None:
    sim = Simulator(SimulatorConfig(speed=1000))
    refs = await run_scenario(sim, load_scenario("live-migration"))
    (event_id,) = refs["freeze"]
    assert event_id == "C7061BAC-AFDC-4513-B24B-AA5F13A16123"
    assert sim.group_of("WestNO_1") == ("WestNO_0", "WestNO_1")  # one placement group
    seen = [sim.scheduled_events_document("WestNO_1")]
    async with asyncio.timeout(5):
        while seen[-1]["Events"]:
            await asyncio.sleep(0.01)
            document = sim.scheduled_events_document("WestNO_1")
            if document != seen[-1]:
                seen.append(document)
    assert [d["DocumentIncarnation"] for d in seen] == [2, 3, 4]
    assert [e["EventStatus"] for d in seen for e in d["Events"]] == ["Scheduled", "Started"]
    assert seen[0]["Events"][0]["Resources"] == ["WestNO_0", "WestNO_1"]
    assert seen[0]["Events"][0]["DurationInSeconds"] == 5


async def test_canceled_redeploy() -> None:
    sim = Simulator(SimulatorConfig(speed=2000))
    refs = await run_scenario(sim, load_scenario("canceled-redeploy"))
    info = sim.get_event(refs["redeploy"][0])
    assert info.state is EventState.CANCELED
    assert info.started_at is None


async def test_hardware_failure_and_spot_and_user_reboot() -> None:
    sim = Simulator(SimulatorConfig(speed=1000))
    failure = await run_scenario(sim, load_scenario("hardware-failure"))
    assert sim.get_event(failure["failure"][0]).status is EventStatus.STARTED
    spot = await run_scenario(sim, load_scenario("spot-preemption"))
    preempt = sim.get_event(spot["preempt"][0])
    assert (preempt.event_type, preempt.resources) == (EventType.PREEMPT, ("spot-worker-0",))
    user = await run_scenario(sim, load_scenario("user-reboot"))
    assert sim.get_event(user["reboot"][0]).event_source.value == "User"


async def test_scaleset_terminate_one_event_per_vm_waiting_for_each_other() -> None:
    sim = Simulator(SimulatorConfig(speed=1000))
    refs = await run_scenario(sim, load_scenario("scaleset-terminate"))
    one, two = refs["terminate"]
    assert sim.vm_names() == ["web_0", "web_1", "web_2", "web_3"]
    assert [sim.get_event(i).resources for i in (one, two)] == [("web_1",), ("web_2",)]
    # The whole placement group sees both deletions; Resources says whose each is.
    assert [e["EventId"] for e in sim.scheduled_events_document("web_0")["Events"]] == [one, two]
    sim.approve("web_2", [two])
    assert sim.get_event(two).state is EventState.SCHEDULED  # waits for web_1's
    sim.approve("web_1", [one])
    assert {sim.get_event(i).state for i in (one, two)} == {EventState.STARTED}


async def test_the_fleet_wave_walks_update_domains_one_after_another() -> None:
    sim = Simulator(SimulatorConfig(speed=20_000), vms=[f"fleet_{i}" for i in range(20)])
    refs = await run_scenario(sim, load_scenario("fleet-wave"))
    for domain in range(5):
        events = [sim.get_event(i) for i in refs[f"ud{domain}"]]
        assert len(events) == 4  # one per VM of that domain
        assert all(sim.identity(e.resources[0]).platform_update_domain == domain for e in events)
    # Each domain starts only once the one before it is done.
    for domain in range(1, 5):
        before = max(sim.get_event(i).ended_at or 0 for i in refs[f"ud{domain - 1}"])
        created = min(sim.get_event(i).created_at for i in refs[f"ud{domain}"])
        assert created >= before - 0.01


async def test_a_refused_action_is_skipped_and_the_scenario_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(
        """
vms = ["a", "b"]
[[actions]]
at = 0
action = "create_event"
ref = "e"
event = { EventType = "Reboot" }
[[actions]]
at = 0
action = "start_event"
event = "e"
[[actions]]
at = 0
action = "cancel_event"   # refused: it is Started
event = "e"
[[actions]]
at = 0
action = "add_vms"
names = ["c"]
[[actions]]
at = 0
action = "fault"
fault = { vm = "c", status = 503 }
[[actions]]
at = 0
action = "create_event"
ref = "f"
event = { EventType = "Terminate", Resources = ["b", "c"], RequireAllApprovals = true }
[[actions]]
at = 0
action = "approve"
event = "f"
vm = "c"
""",
        encoding="utf-8",
    )
    scenario = load_scenario(path)
    assert scenario.name == "s"
    sim = Simulator(clock=ManualClock())
    refs = await run_scenario(sim, scenario)
    assert sim.get_event(refs["e"][0]).state is EventState.STARTED
    assert sim.vm_names() == ["a", "b", "c"]
    assert [f.spec.vm for f in sim.faults()] == ["c"]
    assert [a.vm for a in sim.get_event(refs["f"][0]).approvals] == ["c"]


def _write(tmp_path: Path, name: str, content: object) -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"vms": ["a"], "actions": []}, "actions: List should have at least 1 item"),
        ({"vms": ["a"]}, "actions: Field required"),
        ({"vms": ["a"], "actions": [{"at": 0, "action": "explode"}]}, "actions[0]"),
        (
            {"vms": ["a"], "actions": [{"at": 0, "action": "create_event", "event": {}}]},
            "actions[0].create_event.event.EventType: Field required",
        ),
        (
            {"actions": [{"at": -1, "action": "add_vms", "names": ["x"]}]},
            "actions[0].add_vms.at",
        ),
        (
            {"actions": [{"at": 0, "action": "cancel_event", "event": "nope"}]},
            "no earlier create_event has ref 'nope'",
        ),
        ({"vms": ["a"], "actions": [], "colour": "red"}, "colour"),
        ("[1, 2]", "an object"),
        ("{", "not valid JSON"),
    ],
)
def test_a_bad_json_scenario_names_the_problem(
    tmp_path: Path, content: object, message: str
) -> None:
    path = _write(tmp_path, "bad.json", content)
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    assert message in str(caught.value)
    assert "bad.json" in str(caught.value)


def test_a_bad_toml_scenario_names_the_problem(tmp_path: Path) -> None:
    path = _write(tmp_path, "bad.toml", "vms = [\n")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(path)


def test_an_unknown_vm_in_a_scenario_is_named() -> None:
    scenario = load_scenario("spot-preemption").model_copy(update={"vms": ["other"]})
    with pytest.raises(ScenarioError, match=r"actions\[0\]\.event\.Resources: unknown VM"):
        scenario.check_vms([])


def test_an_unknown_scenario_name_lists_the_shipped_ones(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="live-migration"):
        load_scenario("no-such-scenario")
    path = _write(tmp_path, "s.yaml", "{}")
    with pytest.raises(ScenarioError, match=r"\.json or \.toml"):
        load_scenario(path)
