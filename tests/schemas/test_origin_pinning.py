"""Without an inventory, OriginVerifier binds a VM name to the first vmId it sees signing for it
(trust on first use, for the life of the process). Azure attests a vmId, never a name, so what a
VM may pin is the question: before, one VM with its own genuine attestation could sign messages
under ever new names, and every one stayed pinned to its vmId for the life of the process
(30,000 invented names: 30,000 entries, never freed), and each real VM of such a name was then
refused. A message whose body signature did not verify pinned its name too (the pin came first).

Now a vmId speaks for one name: the first it signs a valid message as (or the inventory's);
a name is pinned only by a message that verifies whole; and at most a bounded number of names
is pinned (past it a new name is refused, naming the inventory as the way out)."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import schemas.origin
from publisher.simulator._attestation import AttestationCa, Attestor
from schemas.origin import ATTESTATION, KEY, SIGNATURE, OriginRejected, OriginVerifier, key_nonce

CA = AttestationCa.generate(seed=1)
ATTESTOR = Attestor(CA, location="westeurope", seed=1)
NOW = datetime(2030, 1, 1, tzinfo=UTC)
BODY = b"{}"


@dataclass
class Vm:
    """A VM that holds a genuine attestation of its vmId for an origin key of its own."""

    vm_id: str
    key: Ed25519PrivateKey
    attestation: str

    @classmethod
    def attested(cls, vm_id: str) -> Vm:
        key = Ed25519PrivateKey.generate()
        raw = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        content = {
            "nonce": key_nonce(raw),
            "vmId": vm_id,
            "timeStamp": {
                "createdOn": "12/31/29 00:00:00 -0000",
                "expiresOn": "01/02/30 00:00:00 -0000",
            },
        }
        return cls(vm_id, key, ATTESTOR.sign(json.dumps(content).encode()))

    def properties(self, body: bytes = BODY, *, signed: bool = True) -> dict[str, str]:
        raw = self.key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        signature = self.key.sign(body) if signed else b"\x00" * 64
        return {
            KEY: base64.b64encode(raw).decode(),
            SIGNATURE: base64.b64encode(signature).decode(),
            ATTESTATION: self.attestation,
        }

    def says(self, verifier: OriginVerifier, name: str, *, signed: bool = True) -> None:
        verifier.check(
            BODY,
            self.properties(signed=signed),
            vm_name=name,
            vm_id=self.vm_id,
            written=NOW,
            now=NOW,
        )


ATTACKER = Vm.attested("aaaaaaaa-0000-0000-0000-000000000001")
WEB9 = Vm.attested("99999999-0000-0000-0000-000000000009")


def test_a_vm_cannot_pin_names_that_are_not_its_own() -> None:
    verifier = OriginVerifier([CA.certificate])
    ATTACKER.says(verifier, "attacker-1")  # its own name, the first it signs as
    refused = 0
    for n in range(30_000):
        with pytest.raises(OriginRejected, match="attacker-1"):
            ATTACKER.says(verifier, f"made-up-{n}")
        refused += 1
    with pytest.raises(OriginRejected):
        ATTACKER.says(verifier, "web-9")
    assert refused == 30_000
    assert len(verifier._pinned) == 1  # nothing kept for the names it invented
    WEB9.says(verifier, "web-9")  # the real VM of a name it tried is not refused
    ATTACKER.says(verifier, "ATTACKER-1")  # names compare case-insensitively


def test_a_message_whose_body_signature_fails_pins_nothing() -> None:
    """Its key and attestation may be copies of another VM's (they travel with every message
    on the stream): without the key's signature it proves nothing, so it binds nothing."""
    verifier = OriginVerifier([CA.certificate])
    with pytest.raises(OriginRejected, match="signature"):
        ATTACKER.says(verifier, "web-9", signed=False)
    WEB9.says(verifier, "web-9")
    ATTACKER.says(verifier, "attacker-1")


def test_the_inventory_decides_a_vmid_s_name_too() -> None:
    verifier = OriginVerifier([CA.certificate], inventory={"attacker-1": ATTACKER.vm_id})
    with pytest.raises(OriginRejected, match="inventory"):
        ATTACKER.says(verifier, "web-9")  # a name the inventory leaves to first use
    WEB9.says(verifier, "web-9")
    ATTACKER.says(verifier, "attacker-1")


def test_a_name_pinned_stays_with_its_vmid() -> None:
    verifier = OriginVerifier([CA.certificate])
    WEB9.says(verifier, "web-9")
    with pytest.raises(OriginRejected, match="first one seen"):
        ATTACKER.says(verifier, "web-9")


def test_past_the_bound_a_new_name_is_refused_not_an_old_one_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forgetting the oldest pin would let any VM take that name next; refusing the new one
    fails closed and says what to do."""
    monkeypatch.setattr(schemas.origin, "_MAX_PINNED", 2)
    verifier = OriginVerifier([CA.certificate])
    first, second, third = (Vm.attested(f"{n}0000000-0000-0000-0000-000000000000") for n in "123")
    first.says(verifier, "web-1")
    second.says(verifier, "web-2")
    with pytest.raises(OriginRejected, match="inventory"):
        third.says(verifier, "web-3")
    first.says(verifier, "web-1")
    second.says(verifier, "web-2")
    assert len(verifier._pinned) == 2
