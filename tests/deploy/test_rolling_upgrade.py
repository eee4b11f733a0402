"""A rolling upgrade from contract 1.0 to 1.1: agents one minor version apart share a fleet with
one current approver. deploy/README.md ("Rolling upgrade") draws the order from these facts:

- the current consumers read the golden 1.0 fixtures (tests/fixtures/1.0) and what a real 1.0
  agent published (tests/deploy/fixtures/agent-1.0-session.json, recorded by
  tests/deploy/record_old_agent.py from the last 1.0 commit), with its four-word routing keys;
  the current approver decides on its events and the audit records its whole history;
- that 1.0 agent reported a 1.1 approval as ``bad-signature`` (the event then started at its
  NotBefore), and a 1.0 approval carries no ``event_version``, so a 1.1 agent refuses it as
  ``unbound`` (tests/schemas/test_approvals.py verifies the golden 1.0 approval and checks
  that): across versions, approvals degrade to "NotBefore applies", never worse;
- a 1.0 agent sets no ``user_id``: with the origin check on (``--origin vm-user``, the default on
  RabbitMQ), the current services set its messages aside; during the upgrade they run with
  ``--origin any``;
- on RabbitMQ, the events exchange a 1.0 deployment declared (without the alternate exchange)
  is used as it is by 1.1, and 1.0 agents can still declare it; one that 1.1 created cannot be
  declared by a 1.0 agent.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from consumers import ApproveUserInitiated, EventPhase, PolicySet
from consumers._approver import ApproverService, Decision
from consumers._audit import open_ledger
from consumers._audit_service import AuditService
from consumers._origin import Origin
from schemas import ChannelNames, decode, load_signing_key
from schemas.approvals import write_key_pair
from schemas.transport import OutgoingMessage, open_transport

from ._paths import FIXTURES, ROOT

GOLDEN = ROOT / "tests" / "fixtures"
SESSION = json.loads((FIXTURES / "agent-1.0-session.json").read_text())["messages"]
TIMEOUT = 20


def _session_kinds() -> list[str]:
    return [m["body"]["type"].removeprefix("io.github.scheduledeventsrelay.") for m in SESSION]


def _outgoing(recorded: dict[str, Any]) -> OutgoingMessage:
    return OutgoingMessage(
        body=json.dumps(recorded["body"]).encode(),
        message_id=recorded["message_id"],
        content_type=recorded["content_type"],
        routing_key=recorded["routing_key"],
        properties=recorded["headers"],
    )


@pytest.mark.parametrize(
    "fixture",
    sorted(p for p in (GOLDEN / "1.0").glob("*.json") if p.name != "approval.json"),
    ids=lambda path: path.stem,
)
def test_every_golden_1_0_message_decodes_with_the_current_contract(fixture: Path):
    message = decode(fixture.read_bytes())
    assert message.schemaversion == "1.0"
    assert message.vm.name


def test_the_recorded_1_0_session_is_what_a_1_0_agent_publishes():
    assert _session_kinds() == [
        "agent.online",
        "scheduled",
        "hook.completed",
        "approval.rejected",
        "agent.heartbeat",
        "started",
        "agent.heartbeat",
        "agent.heartbeat",
        "completed",
        "scheduled",
        "hook.completed",
        "agent.heartbeat",
        "updated",
        "canceled",
        "agent.heartbeat",
        "agent.offline",
    ]
    for recorded in SESSION:
        message = decode(json.dumps(recorded["body"]))
        assert message.schemaversion == "1.0"
        assert recorded["user_id"] is None  # 1.0 agents do not set it
    # Its keys: the type's own dots kept (four words), the VM name's case kept.
    keys = {m["routing_key"] for m in SESSION}
    assert "approval.rejected.agent.WestNO_0" in keys
    assert "scheduled.Reboot.WestNO_0" in keys


def test_a_1_1_approval_reached_the_1_0_agent_as_a_bad_signature():
    """The 1.0 agent re-serialises only the fields it knows: the 1.1 approval's signature
    (over event_version too) does not verify, so it refuses it, and says so."""
    rejected = next(m for m in SESSION if m["routing_key"].startswith("approval.rejected."))
    assert rejected["body"]["data"]["reason"] == "bad-signature"
    started = next(m for m in SESSION if m["routing_key"].startswith("started."))
    assert started["body"]["data"]["event"]["EventId"] == rejected["body"]["data"]["event_id"]


def _relay(name: str) -> str:
    return f"memory://{name}-{uuid.uuid4().hex[:8]}"


async def _run_session(
    origin: Origin, tmp_path: Path
) -> tuple[ApproverService, AuditService, list[Decision], dict[str, list[str]]]:
    url = _relay("upgrade")
    write_key_pair(tmp_path)
    key = load_signing_key(tmp_path / "approver.key")
    decisions: list[Decision] = []
    async with (
        open_transport(url) as approver_link,
        open_transport(url) as audit_link,
        open_transport(url) as agent_link,
        open_ledger(str(tmp_path / "audit.db")) as ledger,
    ):
        approver = ApproverService(
            approver_link,
            key,
            PolicySet((ApproveUserInitiated(),)),
            origin=origin,
            on_decision=decisions.append,
        )
        audit = AuditService(audit_link, ledger, origin=origin)
        async with asyncio.TaskGroup() as group:
            group.create_task(approver.run())
            group.create_task(audit.run())
            try:
                await asyncio.sleep(0.2)
                for recorded in SESSION:
                    await agent_link.publish(_outgoing(recorded))
                async with asyncio.timeout(TIMEOUT):
                    # (polls the service's counter)
                    while origin is Origin.ANY and audit.appended < len(SESSION):  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)
            finally:
                approver.stop()
                audit.stop()
        history = {
            event: [entry.kind for entry in await ledger.history(event_id=event)]
            for event in {m["body"]["subject"] for m in SESSION if m["body"].get("subject")}
        }
    return approver, audit, decisions, history


async def test_the_current_approver_and_audit_take_a_1_0_agents_session(tmp_path: Path):
    approver, audit, decisions, history = await _run_session(Origin.ANY, tmp_path)

    assert audit.appended == len(SESSION)
    reboot = next(m for m in SESSION if m["routing_key"] == "scheduled.Reboot.WestNO_0")
    freeze = next(m for m in SESSION if m["routing_key"] == "scheduled.Freeze.WestNO_0")
    reboot_id = reboot["body"]["data"]["event"]["EventId"]
    freeze_id = freeze["body"]["data"]["event"]["EventId"]
    # The audit has each event's whole history, the 1.0 agent's rejection included.
    assert [k for k in history[reboot_id] if not k.startswith("decision.")] == [
        "scheduled",
        "hook.completed",
        "approval.rejected",
        "started",
        "completed",
    ]
    assert "canceled" in history[freeze_id]
    # The approver followed both events and decided on the user reboot by policy.
    view = approver.fleet.event(reboot_id)
    assert view is not None
    assert view.phase is EventPhase.COMPLETED
    canceled = approver.fleet.event(freeze_id)
    assert canceled is not None
    assert canceled.phase is EventPhase.CANCELED
    assert any(d.event_id == reboot_id for d in decisions)


async def test_with_the_origin_check_on_a_1_0_agent_is_set_aside(tmp_path: Path):
    """A 1.0 agent sets no user_id: ``--origin vm-user`` refuses every one of its messages, so
    the services run with ``--origin any`` until every agent runs 1.1 as its own user."""
    approver, audit, decisions, _ = await _run_session(Origin.VM_USER, tmp_path)
    assert audit.appended == 0
    assert decisions == []
    assert approver.fleet.event(SESSION[1]["body"]["data"]["event"]["EventId"]) is None


@pytest.mark.rabbitmq
async def test_an_events_exchange_from_1_0_is_kept_and_1_0_agents_still_declare_it(amqp_url):
    import aio_pika
    import aiormq.exceptions

    from schemas.transport.rabbitmq import RabbitMQTransport

    channels = ChannelNames().suffixed(f"up{uuid.uuid4().hex[:8]}")
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        async with asyncio.timeout(TIMEOUT):
            channel = await connection.channel()

            async def declare_as_1_0() -> None:
                await channel.declare_exchange(
                    channels.events_exchange, aio_pika.ExchangeType.TOPIC, durable=True
                )

            await declare_as_1_0()  # the deployment ran 1.0
            async with RabbitMQTransport(amqp_url, channels) as current:
                # 1.1 takes it as it is, and says how to add the catch-all without deleting it.
                assert current.catch_all_problem is not None
                assert "set_policy" in str(current.catch_all_problem)
                await current.declare_group("audit")
                await declare_as_1_0()  # a 1.0 agent that restarts meanwhile still connects
                exchange = await channel.get_exchange(channels.events_exchange, ensure=False)
                await exchange.publish(
                    aio_pika.Message(b"{}"), routing_key="approval.applied.Reboot.WestNO_0"
                )
                queue = await channel.get_queue(current.group_queue("audit"), ensure=False)
                for _ in range(50):
                    if (await queue.get(fail=False, no_ack=True)) is not None:
                        break
                    await asyncio.sleep(0.05)
                else:
                    pytest.fail("a 1.0 agent's four-word key did not reach the 1.1 group")
                await current.delete_topology(groups=("audit",), exchanges=True)

            # An exchange a 1.1 party created cannot be declared by a 1.0 agent.
            async with RabbitMQTransport(amqp_url, channels) as current:
                assert current.catch_all_problem is None
                channel = await connection.channel()
                with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
                    await declare_as_1_0()
                await current.delete_topology(exchanges=True)
    finally:
        cleanup = await connection.channel()
        await cleanup.queue_delete(channels.unrouted)
        await cleanup.exchange_delete(channels.unrouted)
        await connection.close()
