"""A consumer with ``--origin signed`` meets every attestation a sender cares to craft: one that
does not hold costs that message (dead-lettered ``origin-mismatch``, counted as forged), never
the stream. Before, a SignerInfo naming its certificate by subject key identifier made the
verifier raise TypeError, which ``authenticate`` did not turn into a refusal: it left the
stream's admission, and the stream with it."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from asn1crypto import cms
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from consumers import FleetStream, Origin
from publisher.simulator._attestation import AttestationCa, Attestor
from schemas import VmIdentity
from schemas.origin import ATTESTATION, KEY, SIGNATURE, OriginVerifier, key_nonce
from schemas.transport import MemoryTransport, OutgoingMessage
from schemas.wire import lifecycle_message

from ._factory import heartbeat

VM_ID = "11111111-2222-3333-4444-555555555555"


def _signed(message: OutgoingMessage, key: Ed25519PrivateKey, attestation: str) -> OutgoingMessage:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return dataclasses.replace(
        message,
        properties={
            **message.properties,
            KEY: base64.b64encode(raw).decode(),
            SIGNATURE: base64.b64encode(key.sign(message.body)).decode(),
            ATTESTATION: attestation,
        },
    )


def _subject_key_id(attestation: str) -> str:
    info = cms.ContentInfo.load(base64.b64decode(attestation))
    info["content"]["signer_infos"][0]["sid"] = cms.SignerIdentifier(
        name="subject_key_identifier", value=b"\x01" * 20
    )
    return base64.b64encode(info.dump(force=True)).decode()


def _empty_digest(attestation: str) -> str:
    info = cms.ContentInfo.load(base64.b64decode(attestation))
    for attribute in info["content"]["signer_infos"][0]["signed_attrs"]:
        if attribute["type"].native == "message_digest":
            attribute["values"] = cms.SetOfOctetString([])
    return base64.b64encode(info.dump(force=True)).decode()


async def _first(stream: FleetStream) -> AsyncIterator[Any]:
    async for message in stream:
        yield message
        return


@pytest.mark.parametrize("craft", [_subject_key_id, _empty_digest])
async def test_a_crafted_attestation_costs_its_message_not_the_stream(craft: Any) -> None:
    ca = AttestationCa.generate(seed=1)
    key = Ed25519PrivateKey.generate()
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    content = json.dumps(
        {
            "nonce": key_nonce(raw),
            "vmId": VM_ID,
            "timeStamp": {
                "createdOn": "01/06/25 11:00:00 -0000",
                "expiresOn": "01/06/25 17:00:00 -0000",
            },
        }
    ).encode()
    genuine = Attestor(ca, location="westeurope", seed=1).sign(content)
    web1 = VmIdentity(name="web-1", resource_group="rg-web", subscription_id="s", vm_id=VM_ID)
    good = heartbeat(web1)
    async with MemoryTransport(f"crafted-{uuid.uuid4().hex}") as transport:
        stream = FleetStream(
            transport, "audit", origin=Origin.SIGNED, verifier=OriginVerifier([ca.certificate])
        )
        async with stream:
            crafted = heartbeat(web1, at=good.time.replace(minute=5))
            await transport.publish(_signed(lifecycle_message(crafted), key, craft(genuine)))
            await transport.publish(_signed(lifecycle_message(good), key, genuine))
            async with asyncio.timeout(5):
                received = [message async for message in _first(stream)]
        assert [m.id for m in received] == [good.id]
        assert stream.stats.forged == 1
        async with transport.dead_letters("audit") as dead, asyncio.timeout(2):
            async for delivery in dead:
                assert delivery.properties["dead_letter_reason"] == "origin-mismatch"
                assert delivery.message_id == crafted.id
                await delivery.ack()
                break
