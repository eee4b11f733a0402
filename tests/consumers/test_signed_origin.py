"""Signed origins, for brokers that name no sender (Service Bus): each agent signs its messages
with a key Azure attests for its VM (IMDS attested data, here the simulator's, signed by a test
CA), and the consumers act only on messages whose signature, attestation, nonce and vmId hold.

The attestations come from the simulator over HTTP through the agent's own IMDS client; the end
to end test runs real agents and the approver over the Service Bus double (the real SDK)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from consumers import Action, DeadLetterReason, Origin
from consumers._approver import ApproverService, Decision
from publisher import Agent
from publisher._imds import ImdsClient
from publisher._origin import OriginSigner
from publisher.simulator import (
    EventSource,
    EventSpec,
    EventState,
    EventType,
    Simulator,
    SimulatorConfig,
    serve,
)
from schemas import (
    ChannelNames,
    ReplyAddress,
    ScheduledEventsDocument,
    TransitionMessage,
    VmIdentity,
    diff,
    load_signing_key,
)
from schemas.approvals import write_key_pair
from schemas.origin import OriginRejected, OriginVerifier
from schemas.transport import DEAD_LETTER_REASON, OutgoingMessage, open_transport
from schemas.wire import lifecycle_message

from ._agents import agent_settings


def _scheduled(sim: Simulator, vm: str, as_vm: str | None = None) -> TransitionMessage:
    """A genuine-looking ``scheduled`` message about ``vm``'s first event, claiming to come from
    ``as_vm`` (default: ``vm`` itself)."""
    name = as_vm or vm
    identity = VmIdentity.from_instance_metadata(sim.instance_document(name))
    document = ScheduledEventsDocument.from_imds(sim.scheduled_events_document(vm))
    (transition,) = diff(None, document)
    return TransitionMessage.build(
        transition,
        vm=identity,
        reply_to=ReplyAddress(channel="approvals", key=name),
        observed_at=datetime.now(UTC),
    )


async def _signer(url: str) -> OriginSigner:
    imds = ImdsClient(url, first_timeout=10)
    signer = OriginSigner(Ed25519PrivateKey.generate(), imds)
    await signer.refresh()
    await imds.aclose()
    return signer


async def _forged_user_reboot(sim: Simulator, signer_url: str, victim: str) -> OutgoingMessage:
    """``victim``'s Platform event turned into a User one (which the policy approves), signed
    with the attested key of the VM at ``signer_url`` (the only key a forger can get)."""
    forged = _scheduled(sim, victim)
    forged_event = forged.data.event.model_copy(update={"event_source": "User"})
    forged = forged.model_copy(
        update={"data": forged.data.model_copy(update={"event": forged_event})}
    )
    outgoing = lifecycle_message(forged)
    signer = await _signer(signer_url)
    return dataclasses.replace(
        outgoing, properties={**outgoing.properties, **signer.properties(outgoing.body)}
    )


def _agent(
    imds_url: str, broker: str, channels: ChannelNames, trust_key: Path, tmp_path: Path
) -> Agent:
    """A real agent on the broker (on Service Bus it signs its messages)."""
    return Agent(agent_settings(imds_url, broker, channels, trust_key, tmp_path / "state"))


def _verifier(sim: Simulator) -> OriginVerifier:
    return OriginVerifier(_trusted(sim))


def _trusted(sim: Simulator) -> list[Any]:
    from cryptography import x509

    return [x509.load_pem_x509_certificate(sim.attestation_ca_pem)]


async def test_a_message_signed_with_its_vms_attested_key_passes_and_every_forgery_fails() -> None:
    sim = Simulator(SimulatorConfig(rate_limit=0), vms=["web-7", "web-8"])
    sim.add_event(EventSpec(event_type=EventType.REBOOT, resources=("web-7", "web-8")))
    async with serve(sim) as server:
        web7 = await _signer(server.vm_url("web-7"))
        web8 = await _signer(server.vm_url("web-8"))
    verifier = _verifier(sim)
    genuine = _scheduled(sim, "web-7")
    body = genuine.to_bytes()
    properties = web7.properties(body)

    def check(
        body: bytes = body,
        properties: dict[str, str] = properties,
        name: str = "web-7",
        vm_id: str = genuine.vm.vm_id,
        written: datetime = genuine.time,
        using: OriginVerifier = verifier,
    ) -> None:
        using.check(body, properties, vm_name=name, vm_id=vm_id, written=written)

    check()  # the VM's own message, signed with its attested key
    cases: dict[str, Any] = {
        "unsigned": lambda: check(properties={}),
        "tampered body": lambda: check(body=body.replace(b"Reboot", b"Freeze")),
        "web-7's key and attestation claiming web-8's vmId": lambda: check(
            name="web-8", vm_id=_scheduled(sim, "web-8").vm.vm_id
        ),
        "web-8's attestation for web-7's key": lambda: check(
            properties={**properties, "origin-attestation": web8.attestation}  # type: ignore[dict-item]
        ),
        "another key signing with web-7's attestation": lambda: check(
            properties={
                **web8.properties(body),
                "origin-attestation": web7.attestation,  # type: ignore[dict-item]
            }
        ),
        "written long after the attestation expired": lambda: check(
            written=genuine.time + timedelta(hours=8)
        ),
        "an attestation no trusted CA signed": lambda: check(
            using=OriginVerifier(_trusted(Simulator(SimulatorConfig(rate_limit=0), vms=["x"])))
        ),
        "not base64 at all": lambda: check(properties={**properties, "origin-attestation": "%%%"}),
        "garbage PKCS#7": lambda: check(
            properties={
                **properties,
                "origin-attestation": base64.b64encode(b"\x30\x03\x02\x01\x01").decode(),
            }
        ),
    }
    for name, attempt in cases.items():
        with pytest.raises(OriginRejected):
            attempt()
        assert name


async def test_a_name_is_bound_to_one_vmid_unless_the_inventory_says_otherwise() -> None:
    sim = Simulator(SimulatorConfig(rate_limit=0), vms=["web-7", "web-8"])
    sim.add_event(EventSpec(event_type=EventType.REBOOT, resources=("web-7",)))
    async with serve(sim) as server:
        web7 = await _signer(server.vm_url("web-7"))
    message = _scheduled(sim, "web-7")
    body = message.to_bytes()
    verifier = OriginVerifier(_trusted(sim), inventory={"web-7": "not-its-vmid"})
    with pytest.raises(OriginRejected, match="not-its-vmid"):
        verifier.check(
            body,
            web7.properties(body),
            vm_name="web-7",
            vm_id=message.vm.vm_id,
            written=message.time,
        )


@pytest.mark.servicebus
@pytest.mark.slow
async def test_over_service_bus_signed_agents_are_approved_and_a_forgery_is_dead_lettered(
    tmp_path: Path,
) -> None:
    from tests.servicebus_double import EntityOptions, ServiceBusDouble

    channels = ChannelNames().suffixed(uuid.uuid4().hex[:10])
    _, public = write_key_pair(tmp_path)
    key = load_signing_key(tmp_path / "approver.key")
    double = ServiceBusDouble(
        session_queues=[channels.approvals_queue],
        session_topics={channels.events_topic: ["approver"]},
        options=EntityOptions(lock_duration=10.0),
    )
    sim = Simulator(SimulatorConfig(rate_limit=0), vms=["web-7", "web-8"])
    decisions: list[Decision] = []
    with double:
        broker = double.connection_string
        async with serve(sim) as server, open_transport(broker, channels) as link:
            approver = ApproverService(
                link,
                key,
                origin=Origin.SIGNED,
                verifier=_verifier(sim),
                on_decision=decisions.append,
            )
            agent = _agent(server.vm_url("web-7"), broker, channels, public, tmp_path)
            assert agent.settings.signs  # auto: on, on Service Bus
            approving = asyncio.create_task(approver.run())
            run = asyncio.create_task(agent.run())
            try:
                await agent.started(30)
                reboot = sim.add_event(
                    EventSpec(
                        event_type=EventType.REBOOT,
                        event_source=EventSource.USER,
                        resources=("web-7",),
                        not_before_seconds=900,
                        run_seconds=600,
                    )
                )
                await sim.wait_for_state(reboot.event_id, EventState.STARTED, within=30)
                # web-8's broker credential in a forger's hands: a user reboot "about web-8",
                # signed with web-7's attested key (the only one the forger can get).
                victim = sim.add_event(
                    EventSpec(
                        event_type=EventType.REBOOT,
                        resources=("web-8",),
                        not_before_seconds=900,
                    )
                )
                outgoing = await _forged_user_reboot(sim, server.vm_url("web-7"), "web-8")
                await link.publish(outgoing)
                async with link.dead_letters("approver") as dead:
                    async with asyncio.timeout(30):
                        letter = await anext(aiter(dead))
                        await letter.ack()
                await asyncio.sleep(1.0)
            finally:
                agent.stop("test over")
                await asyncio.gather(run, return_exceptions=True)
                approver.stop()
                await asyncio.gather(approving, return_exceptions=True)
    assert [a.vm for a in sim.get_event(reboot.event_id).approvals] == ["web-7"]
    assert letter.properties[DEAD_LETTER_REASON] == DeadLetterReason.ORIGIN_MISMATCH
    assert sim.get_event(victim.event_id).state is EventState.SCHEDULED
    assert not [d for d in decisions if d.event_id == victim.event_id]
    assert approver.stream.stats.forged == 1


async def test_over_service_bus_a_forged_copy_sent_first_does_not_hide_the_genuine_message(
    tmp_path: Path,
) -> None:
    """Service Bus drops a message whose ``message_id`` it saw in the last ten minutes
    (duplicate detection, on for the agents' repeats), and a lifecycle message's id is
    predictable. A forger who sends its copy of a VM's next message first (here: web-8's
    Platform reboot, turned into a User one) must neither be believed (the origin check
    dead-letters it) nor make the broker drop the genuine message after it: the broker's id
    includes the sender's origin key, so only an agent's own repeats collide."""
    from tests.servicebus_double import EntityOptions, ServiceBusDouble

    channels = ChannelNames().suffixed(uuid.uuid4().hex[:10])
    _, public = write_key_pair(tmp_path)
    key = load_signing_key(tmp_path / "approver.key")
    double = ServiceBusDouble(
        session_queues=[channels.approvals_queue],
        session_topics={channels.events_topic: ["approver"]},
        options=EntityOptions(lock_duration=10.0, duplicate_detection_window=600.0),
    )
    sim = Simulator(SimulatorConfig(rate_limit=0), vms=["web-7", "web-8"])
    decisions: list[Decision] = []
    with double:
        broker = double.connection_string
        async with serve(sim) as server, open_transport(broker, channels) as link:
            approver = ApproverService(
                link,
                key,
                origin=Origin.SIGNED,
                verifier=_verifier(sim),
                on_decision=decisions.append,
            )
            victim = sim.add_event(
                EventSpec(event_type=EventType.REBOOT, resources=("web-8",), not_before_seconds=900)
            )
            outgoing = await _forged_user_reboot(sim, server.vm_url("web-7"), "web-8")
            await link.publish(outgoing)  # first, before web-8's agent says anything
            agent = _agent(server.vm_url("web-8"), broker, channels, public, tmp_path)
            approving = asyncio.create_task(approver.run())
            run = asyncio.create_task(agent.run())
            try:
                async with link.dead_letters("approver") as dead:
                    async with asyncio.timeout(30):
                        letter = await anext(aiter(dead))
                        await letter.ack()
                async with asyncio.timeout(30):
                    while not [d for d in decisions if d.event_id == victim.event_id]:  # noqa: ASYNC110
                        await asyncio.sleep(0.1)
            finally:
                agent.stop("test over")
                await asyncio.gather(run, return_exceptions=True)
                approver.stop()
                await asyncio.gather(approving, return_exceptions=True)
    assert letter.properties[DEAD_LETTER_REASON] == DeadLetterReason.ORIGIN_MISMATCH
    (decision, *_) = [d for d in decisions if d.event_id == victim.event_id]
    assert decision.action is not Action.APPROVE  # the genuine Platform reboot, judged as such
    assert sim.get_event(victim.event_id).state is EventState.SCHEDULED
