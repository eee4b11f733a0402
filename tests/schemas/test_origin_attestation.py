"""An attestation is whatever the sender put in a message property: :meth:`OriginVerifier.check`
promises :class:`OriginRejected` (which ``authenticate`` turns into a dead letter) for every one
that does not hold, whatever its shape, and never lets another exception out into the consumer.

Before, two crafted structures escaped as the wrong exception: a SignerInfo naming its
certificate by subject key identifier (``"serial_number" in sid``: TypeError, from the message
properties alone) and a messageDigest attribute with no value (IndexError, reached with the
public signing certificate copied from any signed message)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from asn1crypto import algos, cms, core
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from publisher.simulator._attestation import AttestationCa, Attestor
from schemas.origin import ATTESTATION, KEY, SIGNATURE, OriginRejected, OriginVerifier, key_nonce

CA = AttestationCa.generate(seed=1)
ATTESTOR = Attestor(CA, location="westeurope", seed=1)
ORIGIN = Ed25519PrivateKey.from_private_bytes(b"\x07" * 32)  # the same in every worker
RAW = ORIGIN.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
VM_ID = "11111111-2222-3333-4444-555555555555"
NOW = datetime(2030, 1, 1, tzinfo=UTC)
BODY = b'{"a message": 1}'


def _content(**changes: Any) -> bytes:
    document: dict[str, Any] = {
        "nonce": key_nonce(RAW),
        "vmId": VM_ID,
        "subscriptionId": "sub",
        "timeStamp": {
            "createdOn": "12/31/29 00:00:00 -0000",
            "expiresOn": "01/02/30 00:00:00 -0000",
        },
    }
    document.update(changes)
    return json.dumps(document).encode()


GENUINE = ATTESTOR.sign(_content())


def _check(attestation: object) -> None:
    properties = {
        KEY: base64.b64encode(RAW).decode(),
        SIGNATURE: base64.b64encode(ORIGIN.sign(BODY)).decode(),
        ATTESTATION: attestation,
    }
    OriginVerifier([CA.certificate]).check(
        BODY, properties, vm_name="web-7", vm_id=VM_ID, written=NOW, now=NOW
    )


def _no_other_error(attestation: object) -> None:
    """Fails the test when anything but OriginRejected leaves the check (a change to what no
    signature covers, such as SignedData's version, may still pass)."""
    try:
        _check(attestation)
    except OriginRejected:
        return
    except Exception as exc:
        pytest.fail(f"{type(exc).__name__} escapes OriginVerifier.check: {exc}")


def _refused(attestation: object) -> str:
    """Why ``attestation`` was refused; fails the test when anything but OriginRejected left
    the check, or nothing did."""
    try:
        _check(attestation)
    except OriginRejected as exc:
        return str(exc)
    except Exception as exc:
        pytest.fail(f"{type(exc).__name__} escapes OriginVerifier.check: {exc}")
    pytest.fail("a crafted attestation was accepted")


def test_the_genuine_attestation_passes() -> None:
    _check(GENUINE)


# ------------------------------------------------------------------ crafted structures


def _signer(info: cms.ContentInfo) -> cms.SignerInfo:
    signer: cms.SignerInfo = info["content"]["signer_infos"][0]
    return signer


def _digest_attribute(info: cms.ContentInfo) -> cms.CMSAttribute:
    for attribute in _signer(info)["signed_attrs"]:
        if attribute["type"].native == "message_digest":
            return attribute
    raise AssertionError("no messageDigest")


def _set(path: Callable[[cms.ContentInfo], Any], key: str, value: Any) -> Callable[..., None]:
    def mutate(info: cms.ContentInfo) -> None:
        path(info)[key] = value

    return mutate


def _signed(info: cms.ContentInfo) -> cms.SignedData:
    signed: cms.SignedData = info["content"]
    return signed


def _rebuilt(value: Any, left_out: str) -> Any:
    """``value`` (an ASN.1 sequence) without its optional field ``left_out``."""
    names = [name for name, *_ in value._fields if name != left_out]
    return type(value)({n: value[n] for n in names if not isinstance(value[n], core.Void)})


def _without_certificates(info: cms.ContentInfo) -> None:
    info["content"] = _rebuilt(_signed(info), "certificates")


def _without_signed_attributes(info: cms.ContentInfo) -> None:
    _signed(info)["signer_infos"] = cms.SignerInfos([_rebuilt(_signer(info), "signed_attrs")])


def _detached(info: cms.ContentInfo) -> None:
    encapsulated = _signed(info)["encap_content_info"]
    _signed(info)["encap_content_info"] = _rebuilt(encapsulated, "content")


def _certificates(count: int) -> Callable[[cms.ContentInfo], None]:
    def mutate(info: cms.ContentInfo) -> None:
        carried = _signed(info)["certificates"][0]
        _signed(info)["certificates"] = cms.CertificateSet([carried] * count)

    return mutate


def _two_digest_attributes(info: cms.ContentInfo) -> None:
    attributes = _signer(info)["signed_attrs"]
    extra = cms.CMSAttribute(
        {"type": "message_digest", "values": [b"\x00" * 32]},
    )
    _signer(info)["signed_attrs"] = cms.CMSAttributes([*attributes, extra])


def _no_digest_attribute(info: cms.ContentInfo) -> None:
    kept = [a for a in _signer(info)["signed_attrs"] if a["type"].native != "message_digest"]
    _signer(info)["signed_attrs"] = cms.CMSAttributes(kept)


def _serial(value: int) -> Callable[[cms.ContentInfo], None]:
    def mutate(info: cms.ContentInfo) -> None:
        _signer(info)["sid"].chosen["serial_number"] = value

    return mutate


CRAFTED: dict[str, Callable[[cms.ContentInfo], None]] = {
    "signer named by subject key identifier": _set(
        _signer, "sid", cms.SignerIdentifier(name="subject_key_identifier", value=b"\x01" * 20)
    ),
    "messageDigest with no value": _set(_digest_attribute, "values", cms.SetOfOctetString([])),
    "messageDigest with two values": _set(
        _digest_attribute, "values", cms.SetOfOctetString([b"\x00" * 32, b"\x01" * 32])
    ),
    "two messageDigest attributes": _two_digest_attributes,
    "no messageDigest attribute": _no_digest_attribute,
    "no signed attributes": _without_signed_attributes,
    "no signer": _set(_signed, "signer_infos", cms.SignerInfos([])),
    "two signers": lambda info: _set(
        _signed, "signer_infos", cms.SignerInfos([_signer(info), _signer(info)])
    )(info),
    "no certificate": _set(_signed, "certificates", cms.CertificateSet([])),
    "certificates left out": _without_certificates,
    "the signing certificate forty times": _certificates(40),
    "digest md5": _set(
        lambda i: _signer(i)["digest_algorithm"], "algorithm", algos.DigestAlgorithmId("md5")
    ),
    "digest of an unknown OID": _set(
        lambda i: _signer(i)["digest_algorithm"], "algorithm", algos.DigestAlgorithmId("1.2.3.4")
    ),
    "detached content": _detached,
    "content of another type": _set(
        lambda i: _signed(i)["encap_content_info"], "content_type", cms.ContentType("digested_data")
    ),
    "empty signature": _set(_signer, "signature", b""),
    "garbage signature": _set(_signer, "signature", b"\x30\x03\x02\x01\x01"),
    "serial 0": _serial(0),
    "negative serial": _serial(-5),
    "serial of 400 digits": _serial(10**400),
}


@pytest.mark.parametrize("mutate", CRAFTED.values(), ids=CRAFTED.keys())
def test_a_crafted_attestation_is_origin_rejected(
    mutate: Callable[[cms.ContentInfo], None],
) -> None:
    info = cms.ContentInfo.load(base64.b64decode(GENUINE))
    mutate(info)
    _refused(base64.b64encode(info.dump(force=True)).decode())


@pytest.mark.parametrize(
    "attestation",
    [
        "",
        "%%%",
        "é" * 10,
        base64.b64encode(b"\x30\x03\x02\x01\x01").decode(),
        base64.b64encode(b"\x30\x80" * 5000).decode(),  # indefinite lengths, nested
        GENUINE + "AAAA",  # trailing bytes after the DER
        base64.b64encode(base64.b64decode(GENUINE) + b"\x00" * 4).decode(),
        "A" * (1 << 20),  # a megabyte: refused unread
    ],
    ids=[
        "empty",
        "not base64",
        "not ASCII",
        "an INTEGER",
        "nested indefinite lengths",
        "base64 after the DER",
        "bytes after the DER",
        "a megabyte",
    ],
)
def test_an_attestation_that_is_no_pkcs7_is_origin_rejected(attestation: str) -> None:
    _refused(attestation)


@pytest.mark.parametrize("attestation", [None, 7, b"bytes", ["list"]])
def test_an_attestation_property_that_is_no_text_is_origin_rejected(attestation: object) -> None:
    _refused(attestation)


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe not UTF-8",
        b"[]",
        b'"text"',
        b"[" * 100_000,  # deeper than Python recurses
        _content(timeStamp="now"),
        _content(timeStamp={"createdOn": 7, "expiresOn": None}),
        _content(timeStamp={"createdOn": "13/45/99 99:99:99 -0000", "expiresOn": ""}),
        _content(vmId={"a": 1}),
        _content(nonce=["x"]),
        json.dumps({"nonce": 1, "vmId": 2, "timeStamp": {}}).encode(),
    ],
    ids=[
        "not UTF-8",
        "a list",
        "a string",
        "nested deep",
        "timeStamp a string",
        "times not text",
        "times no dates",
        "vmId an object",
        "nonce a list",
        "no times",
    ],
)
def test_a_signed_document_that_is_not_what_azure_signs_is_origin_rejected(content: bytes) -> None:
    """Signed by the trusted CA, so it reaches the document's parser."""
    _refused(ATTESTOR.sign(content))


# --------------------------------------------------------------------------- every byte


def test_no_single_byte_changed_anywhere_in_the_der_escapes_as_another_error() -> None:
    der = base64.b64decode(GENUINE)
    for position in range(len(der)):
        for value in {0x00, 0xFF, (der[position] + 1) % 256, 0x80}:
            if value == der[position]:
                continue
            changed = der[:position] + bytes([value]) + der[position + 1 :]
            _no_other_error(base64.b64encode(changed).decode())


def test_no_truncation_of_the_der_escapes_as_another_error() -> None:
    der = base64.b64decode(GENUINE)
    for end in range(len(der)):
        _refused(base64.b64encode(der[:end]).decode())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=255)),
        min_size=1,
        max_size=12,
    ),
    st.binary(max_size=64),
)
def test_no_mix_of_changed_and_added_bytes_escapes_as_another_error(
    changes: list[tuple[int, int]], inserted: bytes
) -> None:
    der = bytearray(base64.b64decode(GENUINE))
    for position, value in changes:
        der[position % len(der)] = value
    at = changes[0][0] % len(der)
    der[at:at] = inserted
    _no_other_error(base64.b64encode(bytes(der)).decode())


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2048))
def test_no_bytes_at_all_escape_as_another_error(raw: bytes) -> None:
    _refused(base64.b64encode(raw).decode())
