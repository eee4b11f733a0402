"""Signed approvals: each verification failure has its own reason."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from schemas import (
    MAX_KEY_LENGTH,
    Approval,
    ApprovalRejected,
    ConfigError,
    RejectReason,
    SchemaError,
    key_id,
    new_approval,
    sign,
    verify,
)
from schemas.approvals import (
    generate_signing_key,
    load_public_keys,
    load_signing_key,
    write_key_pair,
)

FIXTURES = Path(__file__).parent.parent / "fixtures"
NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
VERSION = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def key():
    return generate_signing_key()


def _trusted(*keys):
    return {key_id(k.public_key()): k.public_key() for k in keys}


def test_a_signed_approval_verifies_after_a_round_trip_through_json(key) -> None:
    approval = sign(
        new_approval("EVT", "web-7", decided_by="policy", event_version=VERSION, now=NOW), key
    )
    received = Approval.from_bytes(approval.to_bytes())
    verify(received, _trusted(key), vm_name="web-7", now=NOW + timedelta(minutes=1))


@pytest.mark.parametrize("version", ["1.0", "1.1", "1.2"])
def test_the_golden_approvals_of_every_version_verify_with_their_test_key(version: str) -> None:
    approval = Approval.from_bytes((FIXTURES / version / "approval.json").read_bytes())
    trusted = load_public_keys([FIXTURES / "keys" / "golden.pub"])
    verify(approval, trusted, vm_name="WestNO_0", now=approval.issued_at)
    # 1.0 approvals named no event version: an agent of 1.1 verifies them, then refuses them
    assert (approval.event_version is None) == (version == "1.0")


def test_an_approval_with_a_field_of_a_newer_minor_version_verifies(key) -> None:
    """The signed bytes are what the signer wrote, fields this version does not know included;
    changing such a field after signing breaks the signature."""
    approval = new_approval("EVT", "web-7", decided_by="policy", event_version=VERSION, now=NOW)
    fields = json.loads(approval.to_bytes())
    fields |= {"schemaversion": "1.9", "window": {"start": "02:00", "stop": 4}, "key_id": None}
    fields["key_id"] = key_id(key.public_key())
    canonical = {k: v for k, v in fields.items() if k != "signature"}
    for name in ("issued_at", "expires_at"):
        canonical[name] = (
            NOW.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            if name == "issued_at"
            else ((NOW + timedelta(minutes=10)).strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
        )
    signed_bytes = json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()
    fields["signature"] = base64.b64encode(key.sign(signed_bytes)).decode()
    received = Approval.from_bytes(json.dumps(fields))
    verify(received, _trusted(key), vm_name="web-7", now=NOW)
    fields["window"]["stop"] = 5
    with pytest.raises(ApprovalRejected) as caught:
        verify(Approval.from_bytes(json.dumps(fields)), _trusted(key), vm_name="web-7", now=NOW)
    assert caught.value.reason is RejectReason.BAD_SIGNATURE


def test_the_receivers_lifetime_cap_wins_over_what_the_signer_granted(key) -> None:
    approval = sign(
        new_approval(
            "EVT",
            "web-7",
            decided_by="policy",
            event_version=VERSION,
            ttl=timedelta(days=30),
            now=NOW,
        ),
        key,
    )
    later = NOW + timedelta(hours=2)
    verify(approval, _trusted(key), vm_name="web-7", now=later)
    with pytest.raises(ApprovalRejected, match="capped at 3600 s") as caught:
        verify(approval, _trusted(key), vm_name="web-7", now=later, max_lifetime=timedelta(hours=1))
    assert caught.value.reason is RejectReason.EXPIRED


@pytest.mark.parametrize(
    "lifetime", [timedelta(seconds=1e12), timedelta.max], ids=["1e12 s", "timedelta.max"]
)
def test_a_lifetime_cap_past_year_9999_caps_nothing(key, lifetime: timedelta) -> None:
    """issued_at plus a receiver's cap of about 2.5e11 s or more is no date (past year 9999):
    that addition raised OverflowError at the first approval. Such a cap caps nothing: what
    the signer granted decides."""
    approval = sign(
        new_approval("EVT", "web-7", decided_by="policy", event_version=VERSION, now=NOW), key
    )
    verify(approval, _trusted(key), vm_name="web-7", now=NOW, max_lifetime=lifetime)
    with pytest.raises(ApprovalRejected) as caught:
        verify(
            approval,
            _trusted(key),
            vm_name="web-7",
            now=NOW + timedelta(hours=1),
            max_lifetime=lifetime,
        )
    assert caught.value.reason is RejectReason.EXPIRED
    assert "capped" not in caught.value.detail


def test_an_approval_issued_in_the_future_is_refused(key) -> None:
    approval = sign(
        new_approval(
            "EVT", "web-7", decided_by="policy", event_version=VERSION, now=NOW + timedelta(hours=1)
        ),
        key,
    )
    with pytest.raises(ApprovalRejected, match="in the future") as caught:
        verify(approval, _trusted(key), vm_name="web-7", now=NOW, max_lifetime=timedelta(hours=1))
    assert caught.value.reason is RejectReason.EXPIRED


@pytest.mark.parametrize(
    "raw",
    [b"[" * 100_000, b"\xff\xfe", b'{"approval_id": 1}', b"null", b"x" * 70_000],
    ids=["deep", "not-utf8", "wrong-types", "null", "huge"],
)
def test_what_is_not_an_approval_is_a_schema_error_whatever_the_bytes(raw: bytes) -> None:
    with pytest.raises(SchemaError):
        Approval.from_bytes(raw)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("issued_at", "0001-01-01T00:00:00+01:00"),
        ("expires_at", "9999-12-31T23:59:59-01:00"),
    ],
    ids=["year-1-east", "year-9999-west"],
)
def test_an_approval_whose_times_have_no_utc_equivalent_is_a_schema_error(
    key, field: str, value: str
) -> None:
    """Its times are signed in UTC: one with no UTC equivalent (year 1 at +01:00 is year 0)
    made computing the signed bytes, and so verify(), raise OverflowError, for anyone who knew
    a trusted key's (public) id. It is refused when it is read, as what is not an approval."""
    approval = sign(
        new_approval("EVT", "web-7", decided_by="policy", event_version=VERSION, now=NOW), key
    )
    fields = json.loads(approval.to_bytes()) | {field: value}
    with pytest.raises(SchemaError, match="outside years 1 to 9999 in UTC"):
        Approval.from_bytes(json.dumps(fields))


@pytest.mark.parametrize("field", ["approval_id", "event_id", "vm"])
def test_ids_and_the_vm_are_at_most_the_contracts_key_length(key, field: str) -> None:
    """The outcome reports them, and the contract takes at most MAX_KEY_LENGTH characters
    there: an approval with a longer one parsed, and the agent's report of it then failed
    validation. It is refused when it is read; one of exactly that length is an approval."""
    approval = sign(
        new_approval("EVT", "web-7", decided_by="policy", event_version=VERSION, now=NOW), key
    )
    fields = json.loads(approval.to_bytes())
    assert Approval.from_bytes(json.dumps(fields | {field: "a" * MAX_KEY_LENGTH}))
    with pytest.raises(SchemaError, match=f"at most {MAX_KEY_LENGTH} characters"):
        Approval.from_bytes(json.dumps(fields | {field: "a" * (MAX_KEY_LENGTH + 1)}))


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (
            lambda a, k, other: a.model_copy(update={"signature": None}),
            RejectReason.MISSING_SIGNATURE,
        ),
        (
            lambda a, k, other: a.model_copy(update={"event_id": "OTHER"}),
            RejectReason.BAD_SIGNATURE,
        ),
        (
            lambda a, k, other: a.model_copy(update={"signature": "bm90IGEgc2lnbmF0dXJl"}),
            RejectReason.BAD_SIGNATURE,
        ),
        (lambda a, k, other: a.model_copy(update={"signature": "%%%"}), RejectReason.BAD_SIGNATURE),
        (lambda a, k, other: sign(a, other), RejectReason.UNKNOWN_KEY),
        (
            lambda a, k, other: sign(
                a.model_copy(update={"expires_at": NOW - timedelta(seconds=1)}), k
            ),
            RejectReason.EXPIRED,
        ),
        (
            lambda a, k, other: sign(a.model_copy(update={"vm": "web-8"}), k),
            RejectReason.NOT_FOR_THIS_VM,
        ),
    ],
    ids=[
        "missing",
        "forged-field",
        "wrong-signature",
        "not-base64",
        "unknown-key",
        "expired",
        "other-vm",
    ],
)
def test_each_failure_is_rejected_with_its_own_reason(key, tamper, reason) -> None:
    approval = sign(
        new_approval("EVT", "web-7", decided_by="policy", event_version=VERSION, now=NOW), key
    )
    with pytest.raises(ApprovalRejected) as caught:
        verify(
            tamper(approval, key, generate_signing_key()), _trusted(key), vm_name="web-7", now=NOW
        )
    assert caught.value.reason is reason


def test_the_canonical_encoding_does_not_depend_on_the_senders_time_zone(key) -> None:
    approval = new_approval("EVT", "web-7", decided_by="policy", event_version=VERSION, now=NOW)
    shifted = approval.model_copy(
        update={"issued_at": approval.issued_at.astimezone(datetime.now().astimezone().tzinfo)}
    )
    assert approval.canonical_bytes() == shifted.canonical_bytes()
    assert json.loads(approval.canonical_bytes())["issued_at"] == "2026-11-22T12:00:00.000000Z"


def test_key_files_round_trip_and_refuse_to_overwrite(tmp_path: Path) -> None:
    private_path, public_path = write_key_pair(tmp_path)
    assert (private_path.stat().st_mode & 0o777) == 0o600
    key = load_signing_key(private_path)
    assert list(load_public_keys([public_path])) == [key_id(key.public_key())]
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        write_key_pair(tmp_path)


def test_unreadable_or_wrong_key_files_are_config_errors_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "junk.pem").write_text("hello")
    with pytest.raises(ConfigError, match=r"junk\.pem"):
        load_public_keys([tmp_path / "junk.pem"])
    with pytest.raises(ConfigError, match=r"missing\.key"):
        load_signing_key(tmp_path / "missing.key")


def test_trust_keys_load_without_cryptography_until_an_approval_is_verified(
    tmp_path: Path,
) -> None:
    """An agent on RabbitMQ checks its trust keys at start but needs cryptography (about 7 MiB of
    RSS on every VM) only for its first approval: the keys are read without it, and the first
    verification loads it."""
    write_key_pair(tmp_path)
    code = f"""
import sys
from datetime import UTC, datetime
from pathlib import Path
import publisher._agent, schemas.transport.rabbitmq
from schemas import load_public_keys, verify, key_id
trusted = load_public_keys([Path({str(tmp_path / "approver.pub")!r})])
assert "cryptography" not in sys.modules, "imported at start"
from schemas.approvals import load_signing_key, new_approval, sign
key = load_signing_key(Path({str(tmp_path / "approver.key")!r}))
approval = sign(new_approval("EVT-1", "web-7", decided_by="test", event_version=None), key)
verify(approval, trusted, vm_name="web-7")
assert list(trusted) == [key_id(key.public_key())]
print("verified")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "verified"


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("hello", "is not a PEM public key"),
        ("-----BEGIN PUBLIC KEY-----\n!!!\n-----END PUBLIC KEY-----\n", "is not a PEM public key"),
        ("RSA", "is not an Ed25519 public key"),
        ("HUGE", "over 64 KiB"),
    ],
    ids=["not PEM", "bad base64", "RSA", "huge"],
)
def test_a_trust_key_that_is_not_an_ed25519_public_key_is_refused_naming_it(
    tmp_path: Path, text: str, complaint: str
) -> None:
    path = tmp_path / "trust.pub"
    if text == "RSA":
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        public = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key()
        text = public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ).decode()
    if text == "HUGE":  # a real key followed by 100 MB: refused without reading it all
        _, key_file = write_key_pair(tmp_path)
        text = key_file.read_text() + " " * (100 << 20)
    path.write_text(text)
    with pytest.raises(ConfigError, match=complaint) as caught:
        load_public_keys([path])
    assert str(path) in str(caught.value)
