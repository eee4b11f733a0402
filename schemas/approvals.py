"""Approvals: a central service's signed permission for one VM to start one event early.

The approver signs the canonical encoding of the approval (every field but ``signature``, as
JSON with sorted keys, no spaces, UTF-8) with Ed25519. The agent verifies it against the public
keys it trusts; each failure has its own :class:`~schemas.RejectReason`.

>>> key = generate_signing_key()
>>> approval = sign(new_approval("EVT-1", "web-7", decided_by="policy"), key)
>>> verify(approval, {key_id(key.public_key()): key.public_key()}, vm_name="web-7")
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import uuid
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, field_validator

from ._errors import ApprovalRejected, ConfigError, RejectReason, SchemaError
from .versioning import SCHEMA_VERSION, check_version

__all__ = [
    "APPROVAL_CONTENT_TYPE",
    "DEFAULT_APPROVAL_TTL",
    "Approval",
    "generate_signing_key",
    "key_id",
    "load_public_keys",
    "load_signing_key",
    "new_approval",
    "sign",
    "verify",
    "write_key_pair",
]

APPROVAL_CONTENT_TYPE = "application/json"
DEFAULT_APPROVAL_TTL = timedelta(minutes=10)


class Approval(BaseModel):
    """Permission for ``vm`` to start ``event_id`` now (IMDS ``StartRequests``)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    schemaversion: str = SCHEMA_VERSION
    approval_id: str = Field(min_length=1)
    event_id: str = Field(min_length=1)
    vm: str = Field(min_length=1)
    decided_by: str = Field(min_length=1)
    reason: str = ""
    issued_at: AwareDatetime
    expires_at: AwareDatetime
    #: Which key signed it: :func:`key_id` of the public key.
    key_id: str | None = None
    #: Base64 Ed25519 signature over :meth:`canonical_bytes`.
    signature: str | None = None

    @field_validator("schemaversion")
    @classmethod
    def _readable_version(cls, value: str) -> str:
        return check_version(value)

    def canonical_bytes(self) -> bytes:
        """What is signed: every field but ``signature``, times in UTC, keys sorted."""
        fields = self.model_dump(mode="json", exclude={"signature"})
        fields["issued_at"] = _utc(self.issued_at)
        fields["expires_at"] = _utc(self.expires_at)
        return json.dumps(
            fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode()

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, raw: bytes | str) -> Approval:
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise SchemaError(f"not an approval: {exc}") from exc


def _utc(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def new_approval(
    event_id: str,
    vm: str,
    *,
    decided_by: str,
    reason: str = "",
    ttl: timedelta = DEFAULT_APPROVAL_TTL,
    now: datetime | None = None,
) -> Approval:
    issued = now or datetime.now(UTC)
    return Approval(
        approval_id=str(uuid.uuid4()),
        event_id=event_id,
        vm=vm,
        decided_by=decided_by,
        reason=reason,
        issued_at=issued,
        expires_at=issued + ttl,
    )


def key_id(public_key: Ed25519PublicKey) -> str:
    """A short, stable name for a public key: the first 16 hex digits of its SHA-256."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def sign(approval: Approval, private_key: Ed25519PrivateKey) -> Approval:
    unsigned = approval.model_copy(
        update={"key_id": key_id(private_key.public_key()), "signature": None}
    )
    signature = private_key.sign(unsigned.canonical_bytes())
    return unsigned.model_copy(update={"signature": base64.b64encode(signature).decode()})


def verify(
    approval: Approval,
    trusted: Mapping[str, Ed25519PublicKey],
    *,
    vm_name: str,
    now: datetime | None = None,
) -> None:
    """Raise :class:`ApprovalRejected` unless ``approval`` is signed by a trusted key, not
    expired, and addressed to ``vm_name``. Returns None when it may be applied."""
    if not approval.signature or not approval.key_id:
        raise ApprovalRejected(RejectReason.MISSING_SIGNATURE, "the approval is not signed")
    public_key = trusted.get(approval.key_id)
    if public_key is None:
        raise ApprovalRejected(
            RejectReason.UNKNOWN_KEY, f"key {approval.key_id} is not among the trusted keys"
        )
    try:
        signature = base64.b64decode(approval.signature, validate=True)
        public_key.verify(signature, approval.canonical_bytes())
    except (InvalidSignature, binascii.Error, ValueError) as exc:
        raise ApprovalRejected(
            RejectReason.BAD_SIGNATURE, f"the signature does not match key {approval.key_id}"
        ) from exc
    moment = now or datetime.now(UTC)
    if approval.expires_at <= moment:
        raise ApprovalRejected(
            RejectReason.EXPIRED, f"the approval expired at {_utc(approval.expires_at)}"
        )
    if approval.vm.casefold() != vm_name.casefold():
        raise ApprovalRejected(
            RejectReason.NOT_FOR_THIS_VM, f"the approval is for {approval.vm!r}, not {vm_name!r}"
        )


# ------------------------------------------------------------------------------------- key files


def generate_signing_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def write_key_pair(directory: Path, name: str = "approver") -> tuple[Path, Path]:
    """Write ``<name>.key`` (PKCS#8 PEM, mode 0600) and ``<name>.pub`` (SubjectPublicKeyInfo PEM).
    Refuses to overwrite an existing key."""
    directory.mkdir(parents=True, exist_ok=True)
    private_path, public_path = directory / f"{name}.key", directory / f"{name}.pub"
    for path in (private_path, public_path):
        if path.exists():
            raise ConfigError(f"{path} exists already: refusing to overwrite a key")
    key = generate_signing_key()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    private_path.touch(mode=0o600)
    private_path.write_bytes(private_pem)
    public_path.write_bytes(public_pem)
    return private_path, public_path


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as exc:
        raise ConfigError(f"cannot read the signing key {path}: {exc.strerror}") from exc
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"{path} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{path} is not an Ed25519 key")
    return key


def load_public_keys(paths: Iterable[Path]) -> dict[str, Ed25519PublicKey]:
    """Trusted keys by :func:`key_id`, from PEM public key files (or private keys' public half)."""
    keys: dict[str, Ed25519PublicKey] = {}
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read the trust key {path}: {exc.strerror}") from exc
        try:
            key = serialization.load_pem_public_key(data)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise ConfigError(f"{path} is not a PEM public key: {exc}") from exc
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"{path} is not an Ed25519 public key")
        keys[key_id(key)] = key
    return keys
