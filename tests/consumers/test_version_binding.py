"""An approval is bound to the version of the event its decider judged: an event that changed
after it was approved is never started on the old judgement. The issue's own scenario, on the
real RabbitMQ with the simulator over HTTP, a real agent and the approver:

the policy approves a 5 s Freeze while the agent is down (the approval waits in the VM's queue);
IMDS changes the event to a 30 s Freeze; the agent comes back, publishes ``updated``, refuses the
old approval (``event-changed``) and does not POST; the approver decides again on the new
version (wait, for the default policy)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from consumers import Action, PolicySet
from consumers._approver import ApproverService, Decision
from consumers._audit import open_ledger
from publisher import Agent
from publisher.simulator import EventSpec, EventState, EventType, Simulator, SimulatorConfig, serve
from schemas import (
    ApprovalOutcomeMessage,
    ChannelNames,
    MessageType,
    ScheduledEventsDocument,
    event_version,
    load_signing_key,
)
from schemas.approvals import write_key_pair
from schemas.transport import open_transport
from schemas.transport.rabbitmq import RabbitMQTransport

from ..publisher.harness import recorder
from ._agents import agent_settings

pytestmark = [pytest.mark.rabbitmq]


async def _until(predicate, within: float = 15.0) -> None:
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 - other components' state
            await asyncio.sleep(0.05)


async def test_an_event_changed_after_its_approval_is_judged_again_and_never_posted(
    amqp_url: str, tmp_path: Path
) -> None:
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:10])
    _, public = write_key_pair(tmp_path)
    key = load_signing_key(tmp_path / "approver.key")
    simulator = Simulator(SimulatorConfig(rate_limit=0), vms=["web-7"])
    decisions: list[Decision] = []
    try:
        await _scenario(amqp_url, channels, public, key, simulator, tmp_path, decisions)
    finally:
        async with RabbitMQTransport(amqp_url, channels) as cleaner:
            await cleaner.delete_topology(
                groups=("approver", "audit"), vms=["web-7"], exchanges=True
            )


async def _scenario(amqp_url, channels, public, key, simulator, tmp_path, decisions) -> None:
    async with (
        serve(simulator) as server,
        open_ledger(f"sqlite:///{tmp_path / 'central.db'}") as ledger,
        open_transport(amqp_url, channels) as link,
        recorder(amqp_url, channels) as rec,
    ):
        settings = agent_settings(
            server.vm_url("web-7"),
            amqp_url,
            channels,
            public,
            tmp_path / "state",
            imds_first_timeout=5.0,
        )
        # The approver's group exists from the start (it is a standing service).
        await link.declare_group("approver", exclusive=True)
        if True:
            # 1. The agent sees the Freeze (5 s) and announces it, then goes down.
            agent = Agent(settings)
            run = asyncio.create_task(agent.run())
            await agent.started(15)
            freeze = simulator.add_event(
                EventSpec(
                    event_type=EventType.FREEZE, duration_in_seconds=5, not_before_seconds=900
                )
            )
            await rec.wait_kind(MessageType.SCHEDULED)
            agent.stop("down for the test")
            await run
            # 2. The approver approves it while the agent is down: the approval waits.
            approver = ApproverService(
                link, key, PolicySet.default(), db=ledger.db, on_decision=decisions.append
            )
            approving = asyncio.create_task(approver.run())
            await _until(lambda: any(d.action is Action.APPROVE for d in decisions))
            first = decisions[-1]
            # 3. Azure changes the event: now a 30 s Freeze, a new version.
            simulator.update_event(freeze.event_id, duration_in_seconds=30)
            # 4. The agent comes back: updated, and the old approval refused.
            agent = Agent(settings)
            run = asyncio.create_task(agent.run())
            await agent.started(15)
            await rec.wait_kind(MessageType.UPDATED)
            await rec.wait_kind(MessageType.APPROVAL_REJECTED)
            await _until(
                lambda: any(
                    d.action is Action.WAIT and d.event_version != first.event_version
                    for d in decisions
                )
            )
            await asyncio.sleep(1.0)  # nothing more may happen
            agent.stop("test over")
            await run
            approver.stop()
            await approving
            history = await ledger.history(event_id=freeze.event_id)

    (rejected,) = rec.of(MessageType.APPROVAL_REJECTED)
    assert isinstance(rejected, ApprovalOutcomeMessage)
    assert rejected.data.reason == "event-changed"
    assert rejected.data.event_version == first.event_version
    assert [r.method for r in simulator.requests(vm="web-7") if r.method == "POST"] == []
    assert simulator.get_event(freeze.event_id).state is EventState.SCHEDULED
    # The approver: approve on the first version, then wait on the second (30 s is not short).
    assert first.action is Action.APPROVE
    later = [d for d in decisions if d.event_version != first.event_version]
    assert [d.action for d in later] == [Action.WAIT]
    assert "NotBefore" in later[0].reason
    # Both decisions, with the versions judged, are in the audit history.
    recorded = [(e.kind, e.body.get("event_version")) for e in history if e.record == "decision"]
    assert ("decision.approve", first.event_version) in recorded
    assert ("decision.wait", later[0].event_version) in recorded


async def test_approve_from_the_command_line_binds_to_the_ledgers_version_and_waits_for_it(
    amqp_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`scheduled-events approve EVENT --vm VM --db LEDGER`: the version comes from the audit
    ledger (the agents' newest report), a --event-version the ledger contradicts is refused,
    and the command waits for the agent's answer and prints it (applied: the POST reached
    IMDS); a VM whose agent does not answer is a clear timeout, exit 1."""
    from consumers._audit_service import AuditService
    from consumers._cli import main

    suffix = uuid.uuid4().hex[:10]
    channels = ChannelNames().suffixed(suffix)
    _, public = write_key_pair(tmp_path)
    simulator = Simulator(SimulatorConfig(rate_limit=0), vms=["web-7"])
    db = f"sqlite:///{tmp_path / 'central.db'}"
    common = [
        "--broker", amqp_url, "--channel-suffix", suffix,
        "--signing-key", str(tmp_path / "approver.key"), "--db", db,
    ]  # fmt: skip
    try:
        async with (
            serve(simulator) as server,
            open_ledger(db) as ledger,
            open_transport(amqp_url, channels) as link,
        ):
            audit = AuditService(link, ledger)
            auditing = asyncio.create_task(audit.run())
            agent = Agent(
                agent_settings(
                    server.vm_url("web-7"), amqp_url, channels, public, tmp_path / "state"
                )
            )
            run = asyncio.create_task(agent.run())
            await agent.started(15)
            freeze = simulator.add_event(
                EventSpec(
                    event_type=EventType.FREEZE, duration_in_seconds=5, not_before_seconds=900
                )
            )
            await _until_reported(ledger, freeze.event_id, "Scheduled")
            contradicted = await asyncio.to_thread(
                main, ["approve", freeze.event_id, "--vm", "web-7", *common,
                       "--event-version", "0" * 32]
            )  # fmt: skip
            refusal = capsys.readouterr().err
            applied = await asyncio.to_thread(
                main, ["approve", freeze.event_id, "--vm", "web-7", *common, "--timeout", "20"]
            )
            answer = capsys.readouterr().out
            await _until_reported(ledger, freeze.event_id, "Started")
            again = await asyncio.to_thread(
                main, ["approve", freeze.event_id, "--vm", "web-7", *common, "--timeout", "1"]
            )
            started = capsys.readouterr().err
            agent.stop("test over")
            await run
            # The agent is down: an approval of another event waits in its queue, unanswered.
            second = simulator.add_event(
                EventSpec(
                    event_type=EventType.FREEZE, duration_in_seconds=5, not_before_seconds=900
                )
            )
            document = ScheduledEventsDocument.from_imds(
                simulator.scheduled_events_document("web-7")
            )
            (judged,) = [e for e in document.events if e.event_id == second.event_id]
            silent = await asyncio.to_thread(
                main,
                ["approve", second.event_id, "--vm", "web-7", *common[:-2], "--timeout", "1",
                 "--event-version", event_version(judged)],
            )  # fmt: skip
            timeout_line = capsys.readouterr().err
            audit.stop()
            await auditing
    finally:
        async with RabbitMQTransport(amqp_url, channels) as cleaner:
            await cleaner.delete_topology(
                groups=("audit", "approve"), vms=["web-7"], exchanges=True
            )
    assert contradicted == 2
    assert "is not the version the ledger knows" in refusal
    assert applied == 0
    assert "Freeze, 5 s" in answer  # the version it approved, described
    assert "applied by web-7" in answer
    assert [r.method for r in simulator.requests(vm="web-7") if r.method == "POST"] == ["POST"]
    assert again == 2
    assert "is Started in the newest report: only a Scheduled event can be approved" in started
    assert silent == 1
    assert "no outcome from web-7 within 1 s" in timeout_line


async def _until_reported(ledger, event_id: str, status: str) -> None:
    """Until the ledger's newest report of the event (the audit writes it) has ``status``."""
    async with asyncio.timeout(15):
        while ((await ledger.latest_event(event_id)) or {}).get("EventStatus") != status:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
