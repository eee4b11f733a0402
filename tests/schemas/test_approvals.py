"""Signed approvals: each verification failure has its own reason."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from schemas import (
    Approval,
    ApprovalRejected,
    ConfigError,
    RejectReason,
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


@pytest.fixture
def key():
    return generate_signing_key()


def _trusted(*keys):
    return {key_id(k.public_key()): k.public_key() for k in keys}


def test_a_signed_approval_verifies_after_a_round_trip_through_json(key) -> None:
    approval = sign(new_approval("EVT", "web-7", decided_by="policy", now=NOW), key)
    received = Approval.from_bytes(approval.to_bytes())
    verify(received, _trusted(key), vm_name="web-7", now=NOW + timedelta(minutes=1))


def test_the_golden_approval_verifies_with_its_test_key() -> None:
    approval = Approval.from_bytes((FIXTURES / "1.0" / "approval.json").read_bytes())
    trusted = load_public_keys([FIXTURES / "keys" / "golden.pub"])
    verify(approval, trusted, vm_name="WestNO_0", now=approval.issued_at)


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
    approval = sign(new_approval("EVT", "web-7", decided_by="policy", now=NOW), key)
    with pytest.raises(ApprovalRejected) as caught:
        verify(
            tamper(approval, key, generate_signing_key()), _trusted(key), vm_name="web-7", now=NOW
        )
    assert caught.value.reason is reason


def test_the_canonical_encoding_does_not_depend_on_the_senders_time_zone(key) -> None:
    approval = new_approval("EVT", "web-7", decided_by="policy", now=NOW)
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
