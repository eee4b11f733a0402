"""The legitimate flows with the least-privilege users, end to end on the real RabbitMQ: in a
throwaway vhost made by deploy/rabbitmq/relay_rabbitmq.py, agents (each as its own VM user)
watch the IMDS simulator and publish, the approver (its approver user, checking that each
message comes from its own VM's user) approves, each agent receives its own approval and
applies it, the audit (its read-only user, with the same check) records the whole history,
and ``tail`` (its user) sees every message stamped with the VM's own user.

Also: the script's two ways of applying (one rabbitmqctl call per setting, or one import)
give the same permissions; running it again changes nothing; no password is ever printed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from pathlib import Path

import aio_pika
import pytest

from consumers import ApproveUserInitiated, PolicySet
from consumers._approver import ApproverService
from consumers._audit import open_ledger
from consumers._audit_service import AuditService
from consumers._origin import Origin
from publisher import Agent, AgentSettings
from publisher.simulator import EventSource as SimSource
from publisher.simulator import EventSpec, EventType, Simulator, SimulatorConfig, serve
from publisher.simulator import EventState as SimState
from schemas import load_signing_key
from schemas.approvals import write_key_pair
from schemas.channels import vm_word
from schemas.transport.rabbitmq import RabbitMQTransport

from ._rabbitmq import rabbitmqctl_or_skip, relay_vhost, run_script, script_ok

pytestmark = [pytest.mark.rabbitmq]


@pytest.mark.slow
async def test_agents_approver_and_audit_work_end_to_end_with_their_own_users(
    amqp_url, tmp_path: Path
):
    u = uuid.uuid4().hex[:6]
    vms = (f"Web.{u}.7", f"db-{u}-1")  # one with capitals and a dot: user web_<u>_7
    approver_user, audit_user, tail_user = f"approver-{u}", f"audit-{u}", f"tail-{u}"
    _, public = write_key_pair(tmp_path)
    key = load_signing_key(tmp_path / "approver.key")
    simulator = Simulator(SimulatorConfig(speed=60, rate_limit=0), vms=list(vms))
    seen: list[tuple[str, str | None]] = []  # (routing key, the broker-validated sender)

    with relay_vhost(
        amqp_url,
        tmp_path,
        vms=vms,
        approvers=(approver_user,),
        audits=(audit_user,),
        tails=(tail_user,),
    ) as relay:
        async with (
            serve(simulator) as server,
            open_ledger(str(tmp_path / "audit.db")) as ledger,
            RabbitMQTransport(relay.url(approver_user)) as approver_link,
            RabbitMQTransport(relay.url(audit_user)) as audit_link,
            RabbitMQTransport(relay.url(tail_user)) as tail_link,
        ):
            # The origin check on: each message must come from the broker user of its VM.
            approver = ApproverService(
                approver_link, key, PolicySet((ApproveUserInitiated(),)), origin=Origin.VM_USER
            )
            audit = AuditService(audit_link, ledger, origin=Origin.VM_USER)
            agents = [
                Agent(
                    AgentSettings(
                        imds_url=server.vm_url(vm),
                        broker=relay.url(vm_word(vm), declare="passive"),
                        state_dir=None,
                        trust_keys=(public,),
                        poll_interval=0.2,
                        fast_poll_interval=0.1,
                        heartbeat_interval=5.0,
                        drain_timeout=5.0,
                    )
                )
                for vm in vms
            ]

            async def watch() -> None:
                async with tail_link.subscribe("tail", transient=True) as subscription:
                    async for delivery in subscription:
                        seen.append((delivery.routing_key, delivery.sender))
                        await delivery.ack()

            async with asyncio.TaskGroup() as group:
                watcher = group.create_task(watch())
                group.create_task(approver.run())
                group.create_task(audit.run())
                await asyncio.sleep(0.5)  # the transient queue is bound before anything moves
                runs = [group.create_task(agent.run()) for agent in agents]
                try:
                    async with asyncio.timeout(30):
                        for agent in agents:
                            await agent.started()
                    # A user reboot on each VM: the policy approves it at once.
                    events = [
                        simulator.add_event(
                            EventSpec(
                                event_type=EventType.REBOOT,
                                resources=(vm,),
                                event_source=SimSource.USER,
                                not_before_seconds=900,
                                run_seconds=240,  # 4 s at 60x: the agents see it run
                            )
                        )
                        for vm in vms
                    ]
                    for event in events:
                        await simulator.wait_for_state(
                            event.event_id, SimState.COMPLETED, within=20
                        )
                    await asyncio.sleep(1.5)  # the agents see it go; the audit records it
                finally:
                    for agent in agents:
                        agent.stop("test over")
                    async with asyncio.timeout(15):
                        await asyncio.gather(*runs, return_exceptions=True)
                    approver.stop()
                    audit.stop()
                    watcher.cancel()
            histories = {vm: await ledger.history(vm=vm) for vm in vms}

    # Each event started early, by the approval its own VM received in its own queue.
    for event in events:
        info = simulator.get_event(event.event_id)
        assert info.approvals, f"{info.event_id} started without an approval"
    # The audit, with its read-only user, recorded every VM's whole history.
    for vm, history in histories.items():
        kinds = [entry.kind for entry in history]
        for kind in ("scheduled", "approval.applied", "started", "completed"):
            assert kind in kinds, f"{vm}: {kinds}"
    # Every lifecycle message is stamped by the broker with the user of the VM it names (only
    # agents publish there: the approver's and the audit's users cannot).
    assert seen
    for routing_key, sender in seen:
        assert sender == routing_key.rsplit(".", 1)[-1], (routing_key, sender)
    assert {sender for _, sender in seen} == {vm_word(vm) for vm in vms}


async def test_a_vm_user_cannot_speak_for_another_vm_even_on_its_own_routing_key(
    amqp_url, tmp_path: Path
):
    """The topic permission checks the routing key, not the body: web-1's user may publish on
    its own key a message that names web-2 (a User reboot, which the policy approves at
    once). The approver and the audit, checking that each message comes from the user of the
    VM it names, dead-letter it: no decision, no approval, nothing recorded about web-2."""
    import dataclasses

    from schemas.wire import lifecycle_message
    from tests.consumers._factory import event, transition, vm

    u = uuid.uuid4().hex[:6]
    forger, victim = f"web-{u}-1", f"web-{u}-2"
    approver_user, audit_user = f"approver-{u}", f"audit-{u}"
    write_key_pair(tmp_path)
    key = load_signing_key(tmp_path / "approver.key")
    decisions: list[object] = []
    with relay_vhost(
        amqp_url, tmp_path, vms=(forger, victim), approvers=(approver_user,), audits=(audit_user,)
    ) as relay:
        async with (
            open_ledger(str(tmp_path / "audit.db")) as ledger,
            RabbitMQTransport(relay.url(approver_user)) as approver_link,
            RabbitMQTransport(relay.url(audit_user)) as audit_link,
            RabbitMQTransport(relay.url(vm_word(forger), declare="passive")) as forger_link,
        ):
            approver = ApproverService(
                approver_link,
                key,
                PolicySet((ApproveUserInitiated(),)),
                origin=Origin.VM_USER,
                on_decision=decisions.append,
            )
            audit = AuditService(audit_link, ledger, origin=Origin.VM_USER)
            async with asyncio.TaskGroup() as group:
                group.create_task(approver.run())
                group.create_task(audit.run())
                try:
                    async with asyncio.timeout(20):
                        while not (approver.stream.subscribed and audit.stream.subscribed):  # noqa: ASYNC110
                            await asyncio.sleep(0.05)
                    reboot = event("EVT-FORGED", source="User", resources=(victim,))
                    outgoing = lifecycle_message(transition("scheduled", reboot, vm(victim)))
                    own_key = f"scheduled.Reboot.{vm_word(forger)}"  # its topic permission
                    await forger_link.publish(dataclasses.replace(outgoing, routing_key=own_key))
                    async with asyncio.timeout(20):
                        while approver.stream.stats.forged + audit.stream.stats.forged < 2:  # noqa: ASYNC110
                            await asyncio.sleep(0.05)
                    await asyncio.sleep(0.5)  # nothing else may follow
                finally:
                    approver.stop()
                    audit.stop()
            history = await ledger.history(vm=victim)
    assert decisions == []
    assert history == []
    assert approver.stream.stats.dead_lettered == audit.stream.stats.dead_lettered == 1


def _ctl(ctl: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ctl, *args], capture_output=True, text=True, timeout=60, check=check)


def _permissions(ctl: str, vhost: str) -> dict[str, tuple[object, ...]]:
    result: dict[str, tuple[object, ...]] = {}
    for kind in ("list_permissions", "list_topic_permissions"):
        output = subprocess.run(
            [ctl, kind, "-p", vhost, "-q", "--formatter", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        for row in json.loads(output):
            user = row.pop("user")
            exchange = row.pop("exchange", "")  # a user has one topic permission per exchange
            result[f"{kind}:{user}:{exchange}"] = tuple(sorted(row.items()))
    return result


@pytest.mark.slow
async def test_one_call_per_setting_and_one_import_give_the_same_users(amqp_url, tmp_path: Path):
    ctl = rabbitmqctl_or_skip()
    u = uuid.uuid4().hex[:6]
    with relay_vhost(amqp_url, tmp_path / "bulk", vms=(f"vm-{u}",), bulk=True) as bulk:
        bulk_permissions = _permissions(ctl, bulk.vhost)
        limits_bulk = _ctl(ctl, "list_user_limits", "--user", vm_word(f"vm-{u}"), "-q").stdout
    with relay_vhost(amqp_url, tmp_path / "calls", vms=(f"vm-{u}",), bulk=False) as calls:
        call_permissions = _permissions(ctl, calls.vhost)
        limits_calls = _ctl(ctl, "list_user_limits", "--user", vm_word(f"vm-{u}"), "-q").stdout
        password = calls.password(vm_word(f"vm-{u}"))

        # Again, with the same passwords: the same state, and the user still signs in.
        again = run_script(
            "vm", "--vhost", calls.vhost, "--passwords-dir", str(calls.passwords_dir), f"vm-{u}"
        )
        assert again.returncode == 0, again.stderr
        assert _permissions(ctl, calls.vhost) == call_permissions
        connection = await aio_pika.connect(calls.url(vm_word(f"vm-{u}")), timeout=10)
        await connection.close()
        # A new password from standard input replaces the old one; it is never printed.
        new = f"new-{uuid.uuid4().hex}"
        changed = run_script("vm", "--vhost", calls.vhost, "--password-stdin", f"vm-{u}", stdin=new)
        assert changed.returncode == 0, changed.stderr
        for output in (again.stdout, again.stderr, changed.stdout, changed.stderr):
            assert password not in output
            assert new not in output
        check = _ctl(ctl, "authenticate_user", vm_word(f"vm-{u}"), new, check=False)
        assert check.returncode == 0, check.stderr

    assert call_permissions == bulk_permissions
    assert json.loads(limits_calls) == json.loads(limits_bulk)
    assert json.loads(limits_calls) == {"max-connections": 3, "max-channels": 32}


def test_a_missing_vhost_is_an_error_with_the_fix():
    rabbitmqctl_or_skip()
    result = run_script(
        "audit", "--vhost", f"no-such-{uuid.uuid4().hex[:6]}", "--password-stdin", "x", stdin="pw"
    )
    assert result.returncode == 1
    assert "run `relay_rabbitmq.py vhost` first" in result.stderr


def test_help_and_dry_run_need_no_broker_and_show_no_password(tmp_path: Path):
    assert "least-privilege" in script_ok("--help")
    secret = f"secret-{uuid.uuid4().hex}"
    (tmp_path / "pw").write_text(secret + "\n")
    out = script_ok(
        "--dry-run",
        "--rabbitmqctl",
        "false",  # never run: --dry-run prints what it would do
        "approver",
        "--vhost",
        "relay",
        "--password-file",
        str(tmp_path / "pw"),
        "--bulk",
        "relay-approver",
    )
    assert "import_definitions" in out
    assert secret not in out
