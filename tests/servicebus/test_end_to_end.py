"""End to end on Service Bus, through the real SDK and the protocol double: IMDS simulator ->
agents -> topic -> approver (session-enabled subscription) -> session queue -> agent -> IMDS
StartRequests. The same services as on RabbitMQ; only ``--broker`` differs."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from consumers._approver import ApproverService, Decision
from publisher import Agent, AgentSettings
from publisher.simulator import (
    EventSource,
    EventSpec,
    EventState,
    EventType,
    Simulator,
    SimulatorConfig,
    serve,
)
from schemas import ChannelNames, load_signing_key
from schemas.approvals import write_key_pair
from schemas.transport import open_transport
from tests.servicebus_double import EntityOptions, ServiceBusDouble

pytestmark = [pytest.mark.servicebus, pytest.mark.slow]

VMS = ("WestNO_0", "WestNO_1")


async def test_agents_and_the_approver_over_service_bus_start_events_early(tmp_path: Path):
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:10])
    _, public = write_key_pair(tmp_path)
    key = load_signing_key(tmp_path / "approver.key")
    double = ServiceBusDouble(
        session_queues=[channels.approvals_queue],
        session_topics={channels.events_topic: ["approver"]},
        options=EntityOptions(lock_duration=10.0),
    )
    simulator = Simulator(SimulatorConfig(speed=60, rate_limit=0), vms=list(VMS))
    decisions: list[Decision] = []
    with double:
        broker = double.connection_string
        async with serve(simulator) as server, open_transport(broker, channels) as link:
            approver = ApproverService(link, key, on_decision=decisions.append)
            agents = [
                Agent(
                    AgentSettings(
                        imds_url=server.vm_url(name),
                        broker=broker,
                        state_dir=None,
                        trust_keys=(public,),
                        poll_interval=0.2,
                        fast_poll_interval=0.1,
                        drain_timeout=5.0,
                        channels=channels,
                    )
                )
                for name in VMS
            ]
            async with asyncio.TaskGroup() as group:
                group.create_task(approver.run())
                runs = [group.create_task(agent.run()) for agent in agents]
                try:
                    async with asyncio.timeout(60):
                        for agent in agents:
                            await agent.started()
                    # The documents' sample policy: a short Freeze and a user reboot are
                    # approved at once; a platform Redeploy is left to its NotBefore.
                    freeze = simulator.add_event(
                        EventSpec(
                            event_type=EventType.FREEZE,
                            resources=VMS,
                            duration_in_seconds=5,
                            not_before_seconds=900,
                            run_seconds=60,
                        )
                    )
                    reboot = simulator.add_event(
                        EventSpec(
                            event_type=EventType.REBOOT,
                            resources=("WestNO_1",),
                            event_source=EventSource.USER,
                            not_before_seconds=900,
                            run_seconds=60,
                        )
                    )
                    redeploy = simulator.add_event(
                        EventSpec(
                            event_type=EventType.REDEPLOY,
                            resources=("WestNO_0",),
                            not_before_seconds=900,
                        )
                    )
                    for event in (freeze, reboot):
                        await simulator.wait_for_state(
                            event.event_id, EventState.COMPLETED, within=40
                        )
                    await asyncio.sleep(1.0)
                    untouched = simulator.get_event(redeploy.event_id)
                finally:
                    for agent in agents:
                        agent.stop("test over")
                    async with asyncio.timeout(20):
                        await asyncio.gather(*runs, return_exceptions=True)
                    approver.stop()

    freeze_info = simulator.get_event(freeze.event_id)
    reboot_info = simulator.get_event(reboot.event_id)
    # Started by an approval that travelled through Service Bus, not by NotBefore (15 s away).
    assert freeze_info.approvals, "the Freeze started without an approval"
    assert [a.vm for a in reboot_info.approvals] == ["WestNO_1"]
    assert untouched.state is EventState.SCHEDULED
    assert not untouched.approvals
    approved = {d.event_id for d in decisions if d.action.value == "approve"}
    assert approved == {freeze.event_id, reboot.event_id}
    # The approver saw each VM's outcome come back on the stream.
    view = approver.fleet.event(freeze.event_id)
    assert view is not None
    assert view.approved
