"""Attested data: a PKCS#7 SignedData over the VM's attested document, signed by a leaf
certificate the simulator's test CA issued (or the caller's own CA)."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.serialization import pkcs7

from publisher.simulator import (
    AttestationCa,
    FaultSpec,
    ManualClock,
    Simulator,
    SimulatorConfig,
)

from .conftest import HEADERS, Harness

ATTESTED = "/metadata/attested/document?api-version=2020-09-01"
INSTANCE = "/metadata/instance?api-version=2021-02-01"


def _tlv(data: bytes, at: int) -> tuple[int, bytes, int]:
    """One DER element at ``at``: (tag, content, offset after it)."""
    tag, length = data[at], data[at + 1]
    at += 2
    if length & 0x80:
        count = length & 0x7F
        length = int.from_bytes(data[at : at + count], "big")
        at += count
    return tag, data[at : at + length], at + length


def _children(data: bytes) -> list[tuple[int, bytes]]:
    items, at = [], 0
    while at < len(data):
        tag, content, at = _tlv(data, at)
        items.append((tag, content))
    return items


def signed_content(der: bytes) -> bytes:
    """The encapsulated content of a PKCS#7 SignedData (ContentInfo -> [0] -> SignedData)."""
    _, content_info, _ = _tlv(der, 0)
    _, explicit = _children(content_info)[1]
    _, signed_data, _ = _tlv(explicit, 0)
    _, encap = _children(signed_data)[2]  # version, digestAlgorithms, encapContentInfo
    _, wrapped = _children(encap)[1]
    tag, octets, _ = _tlv(wrapped, 0)
    assert tag == 0x04
    return octets


async def _attested(harness: Harness, path: str = ATTESTED) -> dict[str, Any]:
    response = await harness.client.get(path, headers=HEADERS)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def test_the_document_is_signed_pkcs7_over_the_vms_identity(harness: Harness) -> None:
    body = await _attested(harness, ATTESTED + "&nonce=abcde12345")
    assert set(body) == {"encoding", "signature"}
    assert body["encoding"] == "pkcs7"
    der = base64.b64decode(body["signature"])
    document = json.loads(signed_content(der))
    compute = (await harness.client.get(INSTANCE, headers=HEADERS)).json()["compute"]
    assert document["nonce"] == "abcde12345"
    assert document["vmId"] == compute["vmId"]
    assert document["subscriptionId"] == compute["subscriptionId"]
    assert document["sku"] == compute["sku"]
    assert document["plan"] == {"name": "", "product": "", "publisher": ""}
    assert document["licenseType"] == ""
    created = datetime.strptime(document["timeStamp"]["createdOn"], "%m/%d/%y %H:%M:%S -0000")
    expires = datetime.strptime(document["timeStamp"]["expiresOn"], "%m/%d/%y %H:%M:%S -0000")
    assert created.replace(tzinfo=UTC).timestamp() == pytest.approx(harness.sim.clock.time(), 1)
    assert expires - created == timedelta(hours=6)
    # The content is Azure's compact, key-sorted JSON.
    assert (
        signed_content(der) == json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    )


async def test_the_signing_certificate_is_included_and_issued_by_the_ca(
    harness: Harness,
) -> None:
    der = base64.b64decode((await _attested(harness))["signature"])
    (leaf,) = pkcs7.load_der_pkcs7_certificates(der)
    ca = x509.load_pem_x509_certificate(harness.sim.attestation_ca_pem)
    leaf.verify_directly_issued_by(ca)
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "metadata.azure.com" in names.get_values_for_type(x509.DNSName)
    admin = await harness.client.get("/admin/attestation/ca.pem")
    assert admin.status_code == 200
    assert admin.content == harness.sim.attestation_ca_pem
    assert admin.headers["content-type"].startswith("application/x-pem-file")


def _openssl_verify(signature: Path, ca: Path) -> subprocess.CompletedProcess[bytes]:
    """``openssl cms -verify``: the signature, the chain to ``ca``, and the content out."""
    return subprocess.run(
        ["openssl", "cms", "-verify", "-binary", "-inform", "DER", "-in", str(signature),
         "-CAfile", str(ca), "-purpose", "any"],
        capture_output=True,
        timeout=30,
        check=False,
    )  # fmt: skip


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_openssl_verifies_the_signature_against_the_ca(
    harness: Harness, tmp_path: Path
) -> None:
    body = await _attested(harness, "/vm/vm2" + ATTESTED + "&nonce=Z9")
    (tmp_path / "sig.der").write_bytes(base64.b64decode(body["signature"]))
    (tmp_path / "ca.pem").write_bytes(harness.sim.attestation_ca_pem)
    verified = await asyncio.to_thread(_openssl_verify, tmp_path / "sig.der", tmp_path / "ca.pem")
    assert verified.returncode == 0, verified.stderr
    document = json.loads(verified.stdout)
    assert document["nonce"] == "Z9"
    assert document["vmId"] == harness.sim.identity("vm2").vm_id
    # Another CA does not verify it.
    (tmp_path / "other.pem").write_bytes(AttestationCa.generate().certificate_pem())
    refused = await asyncio.to_thread(_openssl_verify, tmp_path / "sig.der", tmp_path / "other.pem")
    assert refused.returncode != 0


async def test_without_a_nonce_imds_uses_the_utc_time(harness: Harness, clock: ManualClock) -> None:
    der = base64.b64decode((await _attested(harness))["signature"])
    nonce = json.loads(signed_content(der))["nonce"]
    assert nonce == datetime.fromtimestamp(clock.time(), UTC).strftime("%Y%m%d-%H%M%S")


@pytest.mark.parametrize("nonce", ["x" * 33, "abc-123", "d%C3%A9j%C3%A0", "a%20b"])
async def test_a_bad_nonce_is_400(harness: Harness, nonce: str) -> None:
    response = await harness.client.get(f"{ATTESTED}&nonce={nonce}", headers=HEADERS)
    assert response.status_code == 400
    assert "nonce" in response.json()["error"]


async def test_a_32_character_nonce_is_fine(harness: Harness) -> None:
    await _attested(harness, f"{ATTESTED}&nonce={'A1' * 16}")


@pytest.mark.parametrize(
    ("version", "fields"),
    [
        ("2018-10-01", {"nonce", "plan", "timeStamp", "vmId"}),
        ("2019-04-30", {"nonce", "plan", "timeStamp", "vmId", "subscriptionId"}),
        ("2019-11-01", {"nonce", "plan", "timeStamp", "vmId", "subscriptionId", "sku"}),
        (
            "2020-09-01",
            {"nonce", "plan", "timeStamp", "vmId", "subscriptionId", "sku", "licenseType"},
        ),
    ],
)
async def test_fields_per_api_version(harness: Harness, version: str, fields: set[str]) -> None:
    path = f"/metadata/attested/document?api-version={version}"
    der = base64.b64decode((await _attested(harness, path))["signature"])
    assert set(json.loads(signed_content(der))) == fields


@pytest.mark.parametrize("query", ["", "?api-version=2018-04-02", "?api-version=2030-01-01"])
async def test_attested_needs_a_version_that_has_it(harness: Harness, query: str) -> None:
    response = await harness.client.get(f"/metadata/attested/document{query}", headers=HEADERS)
    assert response.status_code == 400
    assert "2018-10-01" in response.json()["valid-versions"]
    assert "2018-04-02" not in response.json()["valid-versions"]


async def test_attested_follows_the_imds_rules(harness: Harness) -> None:
    assert (await harness.client.get(ATTESTED)).status_code == 400
    response = await harness.client.post(ATTESTED, headers=HEADERS)
    assert response.status_code == 405
    harness.sim.add_fault(FaultSpec(status=503, endpoint="attested"))
    assert (await harness.client.get(ATTESTED, headers=HEADERS)).status_code == 503
    assert (await harness.client.get(INSTANCE, headers=HEADERS)).status_code == 200


def test_a_callers_ca_signs_the_documents() -> None:
    ca = AttestationCa.generate()
    pem_key = ca.private_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    loaded = AttestationCa.from_pem(ca.certificate_pem(), pem_key)
    sim = Simulator(SimulatorConfig(attestation_ca=loaded), vms=["a"])
    assert sim.attestation_ca_pem == ca.certificate_pem()
    document = sim.attested_document("a", "n1")
    (leaf,) = pkcs7.load_der_pkcs7_certificates(base64.b64decode(document["signature"]))
    leaf.verify_directly_issued_by(ca.certificate)


def test_a_seed_makes_the_same_ca_key_in_every_process() -> None:
    one = Simulator(SimulatorConfig(seed=7), vms=["a"])
    two = Simulator(SimulatorConfig(seed=7), vms=["a"])
    other = Simulator(SimulatorConfig(seed=8), vms=["a"])

    def key(sim: Simulator) -> bytes:
        certificate = x509.load_pem_x509_certificate(sim.attestation_ca_pem)
        return certificate.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    assert key(one) == key(two) != key(other)
    # A leaf from one verifies against the other's CA certificate.
    (leaf,) = pkcs7.load_der_pkcs7_certificates(
        base64.b64decode(one.attested_document("a", "n")["signature"])
    )
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(two.attestation_ca_pem))


def test_a_bad_ca_pem_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="certificate"):
        AttestationCa.from_pem(b"nope", b"nope")
