"""End to end on the real RabbitMQ and PostgreSQL, with the IMDS simulator over HTTP and real
agents: policies deciding on live events, the fleet view of one event across its VMs, the audit
history complete and in order; and the demo itself."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from consumers import (
    Action,
    ApproveUserInitiated,
    ApproveWhenHooksDone,
    EventPhase,
    MaxUnavailable,
    PolicySet,
)
from consumers._approver import ApproverService, Decision
from consumers._audit import open_ledger
from consumers._audit_service import AuditService
from consumers._demo import run_demo
from publisher import Agent, HookSpec
from publisher.simulator import EventSource as SimSource
from publisher.simulator import EventSpec, EventType, Simulator, SimulatorConfig, serve
from publisher.simulator import EventState as SimState
from schemas import ChannelNames, load_signing_key
from schemas.approvals import write_key_pair
from schemas.transport import open_transport
from schemas.transport.rabbitmq import RabbitMQTransport

from ._agents import agent_settings

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

VMS = ("ss_0", "ss_1", "ss_2")  # one scale set, "ss"


@pytest.mark.postgres
async def test_policies_fleet_view_and_audit_on_live_events(
    amqp_url,
    postgres_url,
    tmp_path: Path,
):
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:10])
    _, public = write_key_pair(tmp_path)
    key = load_signing_key(tmp_path / "approver.key")
    policies = PolicySet(
        (
            ApproveWhenHooksDone(frozenset({"reboot"})),
            ApproveUserInitiated(),
            MaxUnavailable("scale_set", count=2),
        )
    )
    simulator = Simulator(SimulatorConfig(speed=60, rate_limit=0), vms=list(VMS))
    decisions: list[Decision] = []
    async with (
        serve(simulator) as server,
        open_ledger(postgres_url) as ledger,
        open_transport(amqp_url, channels) as approver_link,
        open_transport(amqp_url, channels) as audit_link,
    ):
        approver = ApproverService(
            approver_link, key, policies, db=ledger.db, on_decision=decisions.append
        )
        audit = AuditService(audit_link, ledger)
        agents = [
            Agent(
                agent_settings(
                    server.vm_url(name),
                    amqp_url,
                    channels,
                    public,
                    None,
                    fast_poll_interval=0.1,
                    heartbeat_interval=5.0,
                    drain_timeout=5.0,
                    hooks=(HookSpec.parse("scheduled=true"),),
                )
            )
            for name in VMS
        ]
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(approver.run())
                group.create_task(audit.run())
                runs = [group.create_task(agent.run()) for agent in agents]
                try:
                    async with asyncio.timeout(30):
                        for agent in agents:
                            await agent.started()
                    # A platform reboot of two VMs: approved once both ran their hook.
                    first = simulator.add_event(
                        EventSpec(
                            event_type=EventType.REBOOT,
                            resources=("ss_0", "ss_1"),
                            not_before_seconds=900,
                            run_seconds=240,
                        )
                    )
                    await simulator.wait_for_state(first.event_id, SimState.STARTED, within=10)
                    # A user reboot of the third: 3 of "ss" down is over the cap of 2, so it
                    # waits until the first event is over.
                    second = simulator.add_event(
                        EventSpec(
                            event_type=EventType.REBOOT,
                            resources=("ss_2",),
                            event_source=SimSource.USER,
                            not_before_seconds=900,
                            run_seconds=30,
                        )
                    )
                    await simulator.wait_for_state(first.event_id, SimState.COMPLETED, within=15)
                    assert simulator.get_event(second.event_id).state is SimState.SCHEDULED
                    await simulator.wait_for_state(second.event_id, SimState.COMPLETED, within=15)
                    await asyncio.sleep(1.5)  # the agents see it go; the audit records it
                finally:
                    for agent in agents:
                        agent.stop("test over")
                    async with asyncio.timeout(15):
                        await asyncio.gather(*runs, return_exceptions=True)
                    approver.stop()
                    audit.stop()
            view = approver.fleet.event(first.event_id)
            history = await ledger.history(event_id=first.event_id)
            second_history = await ledger.history(event_id=second.event_id)
        finally:
            assert isinstance(approver_link, RabbitMQTransport)
            await approver_link.delete_topology(
                groups=("approver", "audit"), vms=VMS, exchanges=True
            )

    # Both events started early, by approval, never by NotBefore (15 s away in real time).
    for info in (simulator.get_event(first.event_id), simulator.get_event(second.event_id)):
        assert info.approvals, f"{info.event_id} started without an approval"
    by_event = {
        e: [(d.action, d.policy) for d in decisions if d.event_id == e]
        for e in (first.event_id, second.event_id)
    }
    assert by_event[first.event_id][0] == (Action.WAIT, "hooks_done")
    assert by_event[first.event_id][-1] == (Action.APPROVE, "hooks_done")
    assert (Action.WAIT, "max_unavailable.scale_set") in by_event[second.event_id]
    assert by_event[second.event_id][-1][0] is Action.APPROVE

    # The fleet view of the first event, across its two VMs.
    assert view is not None
    assert view.phase is EventPhase.COMPLETED
    assert set(view.reports) == {"ss_0", "ss_1"}
    assert view.silent() == ()
    assert view.hooks_done("ss_0")
    assert view.hooks_done("ss_1")
    assert view.approved

    # Its audit history: complete and in order.
    kinds = [entry.kind for entry in history]
    # Waiting decisions are recorded each time their reason changes (hooks on 2 VMs, then 1).
    assert sorted(k for k in kinds if k != "decision.wait") == sorted(
        [
            "scheduled",
            "scheduled",
            "hook.completed",
            "hook.completed",
            "decision.approve",
            "approval.applied",
            "started",
            "started",
            "completed",
            "completed",
        ]
    ), str(kinds)
    assert kinds.count("decision.wait") >= 1
    position = {kind: [i for i, k in enumerate(kinds) if k == kind] for kind in set(kinds)}
    assert max(position["scheduled"]) < position["decision.approve"][0]
    assert max(position["hook.completed"]) < position["decision.approve"][0]
    assert position["decision.approve"][0] < position["approval.applied"][0]
    assert position["approval.applied"][0] < min(position["started"])
    assert max(position["started"]) < min(position["completed"])
    assert [e.kind for e in second_history].count("decision.wait") >= 1


async def test_the_demo_runs_over_rabbitmq_and_passes(amqp_url, capsys):
    assert await run_demo(amqp_url, speed=60, quiet=True) == 0
    out = capsys.readouterr().out
    assert "demo passed: every event ended as expected" in out
    assert "approved by policy (Freeze of 5s < 9s)" in out
