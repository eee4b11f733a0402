"""Approvals: a central service's signed permission for one VM to start one event early.

The approver signs the canonical encoding of the approval (every field but ``signature``, as
JSON with sorted keys, no spaces, UTF-8, the two times as ``YYYY-MM-DDTHH:MM:SS.ffffffZ``) with
Ed25519. The agent verifies it against the public keys it trusts; each failure has its own
:class:`~schemas.RejectReason`.

The signed bytes are what the *signer* wrote: an approval received from the wire is verified over
every field it carries, those this version knows and those a newer minor version added, so an
agent one version behind its approver still verifies it. (Fields are JSON strings, integers,
booleans, null, lists and objects: no floats, whose text may not survive a round trip.)

An approval is bound to the version of the event its decider judged (``event_version``, see
:mod:`schemas.fingerprints`): the agent applies it only while the live event has that version.

>>> key = generate_signing_key()
>>> approval = sign(new_approval("EVT-1", "web-7", decided_by="policy"), key)
>>> verify(approval, {key_id(key.public_key()): key.public_key()}, vm_name="web-7")
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import uuid
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self

import pydantic_core
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
)

from ._errors import ApprovalRejected, ConfigError, RejectReason, SchemaError
from ._files import read_setting_file
from .fingerprints import EVENT_VERSION_DEFINITION
from .identity import MAX_KEY_LENGTH
from .versioning import SCHEMA_VERSION, check_version

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

__all__ = [
    "APPROVAL_CONTENT_TYPE",
    "DEFAULT_APPROVAL_TTL",
    "MAX_APPROVAL_BYTES",
    "MAX_CLOCK_SKEW",
    "Approval",
    "TrustedKey",
    "check_lifetime",
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
#: How far in the future ``issued_at`` may lie (the signer's clock ahead of the agent's).
MAX_CLOCK_SKEW = timedelta(minutes=5)
_TIMES = ("issued_at", "expires_at")


class Approval(BaseModel):
    """Permission for ``vm`` to start ``event_id`` now (IMDS ``StartRequests``)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    schemaversion: str = SCHEMA_VERSION
    #: Keys the outcome that reports an approval carries: bounded as every key of the contract
    #: (:data:`~schemas.MAX_KEY_LENGTH`), so a longer one is no approval, refused when read
    #: rather than failing the agent's report of it.
    approval_id: str = Field(min_length=1, max_length=MAX_KEY_LENGTH)
    event_id: str = Field(min_length=1, max_length=MAX_KEY_LENGTH)
    vm: str = Field(min_length=1, max_length=MAX_KEY_LENGTH)
    decided_by: str = Field(min_length=1)
    reason: str = ""
    issued_at: AwareDatetime
    expires_at: AwareDatetime
    #: Which key signed it: :func:`key_id` of the public key.
    key_id: str | None = None
    #: Base64 Ed25519 signature over :meth:`canonical_bytes`.
    signature: str | None = None
    #: (1.1) :func:`~schemas.fingerprints.event_version` of the event as its decider saw it.
    #: An approval without one (from a 1.0 approver) is never applied.
    event_version: str | None = Field(
        default=None,
        description="(1.1) The event version its decider judged; an approval without one is "
        "never applied. " + EVENT_VERSION_DEFINITION,
    )
    #: The fields as received (:meth:`from_bytes`), which are what was signed.
    _wire: dict[str, Any] | None = PrivateAttr(default=None)

    @field_validator("schemaversion")
    @classmethod
    def _readable_version(cls, value: str) -> str:
        return check_version(value)

    @field_validator(*_TIMES)
    @classmethod
    def _exists_in_utc(cls, value: datetime) -> datetime:
        """The times are signed (and compared) in UTC: one with none (year 1 at +01:00, year
        9999 at -01:00) is no time an approval can have, refused here rather than raising
        OverflowError in whatever first converts it (the signed bytes, before the signature
        is checked)."""
        try:
            value.astimezone(UTC)
        except OverflowError as exc:
            raise ValueError(
                f"time {value.isoformat()} lies outside years 1 to 9999 in UTC"
            ) from exc
        return value

    def canonical_bytes(self) -> bytes:
        """What is signed: every field but ``signature`` (as received, when it was), the times
        in UTC with microseconds, keys sorted, no spaces, UTF-8."""
        fields = dict(self._wire) if self._wire is not None else self.model_dump(mode="json")
        fields.pop("signature", None)
        for name in _TIMES:
            fields[name] = _utc(getattr(self, name))
        return json.dumps(
            fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode()

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy; a changed copy is no longer what was received, so it is signed (and
        verified) over its own fields."""
        copy = super().model_copy(update=update, deep=deep)
        if update:
            copy._wire = None
        return copy

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, raw: bytes | str) -> Approval:
        """Parse an approval; :class:`SchemaError` for anything that is not one (never
        another exception, whatever the bytes)."""
        data = raw.encode() if isinstance(raw, str) else bytes(raw)
        if len(data) > MAX_APPROVAL_BYTES:
            raise SchemaError(f"not an approval: {len(data)} bytes is too large")
        try:
            fields = pydantic_core.from_json(data, allow_inf_nan=False)
        except (ValueError, RecursionError) as exc:
            raise SchemaError(f"not an approval: not JSON: {exc}") from exc
        if not isinstance(fields, dict):
            raise SchemaError("not an approval: the JSON is not an object")
        try:
            approval = cls.model_validate(fields)
        except (ValidationError, RecursionError) as exc:
            raise SchemaError(f"not an approval: {exc}") from exc
        approval._wire = fields
        return approval


def _utc(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


#: An approval is a few hundred bytes; anything much larger is not one.
MAX_APPROVAL_BYTES = 64 * 1024


def new_approval(
    event_id: str,
    vm: str,
    *,
    decided_by: str,
    event_version: str | None,
    reason: str = "",
    ttl: timedelta = DEFAULT_APPROVAL_TTL,
    now: datetime | None = None,
) -> Approval:
    """An unsigned approval of ``event_id`` at ``event_version`` (see :func:`sign`)."""
    issued = now or datetime.now(UTC)
    return Approval(
        approval_id=str(uuid.uuid4()),
        event_id=event_id,
        vm=vm,
        decided_by=decided_by,
        reason=reason,
        issued_at=issued,
        expires_at=issued + ttl,
        event_version=event_version,
    )


class Verifier(Protocol):
    def verify(self, signature: bytes, data: bytes) -> None: ...


class TrustedKey:
    """An Ed25519 public key an agent trusts, read without :mod:`cryptography`: an agent on
    RabbitMQ needs that library (about 7 MiB of RSS on every VM) only once an approval arrives,
    so it is loaded by the first :meth:`verify`."""

    __slots__ = ("_key", "raw")

    def __init__(self, raw: bytes) -> None:
        if len(raw) != 32:
            raise ValueError(f"an Ed25519 public key is 32 bytes, not {len(raw)}")
        self.raw = raw
        self._key: Ed25519PublicKey | None = None

    def verify(self, signature: bytes, data: bytes) -> None:
        """ValueError unless ``signature`` is this key's over ``data``."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        if self._key is None:
            self._key = Ed25519PublicKey.from_public_bytes(self.raw)
        try:
            self._key.verify(signature, data)
        except InvalidSignature as exc:
            raise ValueError("invalid signature") from exc

    def __repr__(self) -> str:
        return f"TrustedKey({key_id(self)})"


def key_id(public_key: Ed25519PublicKey | TrustedKey) -> str:
    """A short, stable name for a public key: the first 16 hex digits of its SHA-256."""
    if isinstance(public_key, TrustedKey):
        raw = public_key.raw
    else:
        from cryptography.hazmat.primitives import serialization

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
    trusted: Mapping[str, Verifier],
    *,
    vm_name: str,
    now: datetime | None = None,
    max_lifetime: timedelta | None = None,
) -> None:
    """Raise :class:`ApprovalRejected` unless ``approval`` is signed by a trusted key, not
    expired, and addressed to ``vm_name``. Returns None when it may be applied.

    ``max_lifetime`` caps how long after ``issued_at`` it is accepted, whatever ``expires_at``
    says (the receiver's limit on what a signer may grant)."""
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
    except Exception as exc:  # InvalidSignature, binascii.Error, ValueError: all a bad signature
        if not _is_bad_signature(exc):
            raise
        raise ApprovalRejected(
            RejectReason.BAD_SIGNATURE, f"the signature does not match key {approval.key_id}"
        ) from exc
    check_lifetime(approval, now or datetime.now(UTC), max_lifetime)
    if approval.vm.casefold() != vm_name.casefold():
        raise ApprovalRejected(
            RejectReason.NOT_FOR_THIS_VM, f"the approval is for {approval.vm!r}, not {vm_name!r}"
        )


def _is_bad_signature(exc: Exception) -> bool:
    if isinstance(exc, ValueError):  # binascii.Error, TrustedKey's InvalidSignature
        return True
    from cryptography.exceptions import InvalidSignature

    return isinstance(exc, InvalidSignature)


def check_lifetime(approval: Approval, now: datetime, max_lifetime: timedelta | None) -> None:
    """:class:`ApprovalRejected` (``expired``) unless ``now`` lies in the approval's life:
    issued no later than :data:`MAX_CLOCK_SKEW` from now, and before ``expires_at`` and
    ``issued_at + max_lifetime``, whichever comes first (a cap that ends past year 9999, and
    so after any ``expires_at``, caps nothing)."""
    if approval.issued_at > now + MAX_CLOCK_SKEW:
        raise ApprovalRejected(
            RejectReason.EXPIRED,
            f"the approval is issued at {_utc(approval.issued_at)}, in the future (more than "
            f"{MAX_CLOCK_SKEW.total_seconds():.0f} s of clock skew): refused",
        )
    expiry = approval.expires_at
    capped = ""
    if max_lifetime is not None:
        try:
            cap = approval.issued_at + max_lifetime
        except OverflowError:  # past year 9999: no cap
            cap = expiry
        if cap < expiry:
            expiry = cap
            capped = f" (its lifetime capped at {max_lifetime.total_seconds():.0f} s by this agent)"
    if expiry <= now:
        raise ApprovalRejected(
            RejectReason.EXPIRED, f"the approval expired at {_utc(expiry)}{capped}"
        )


# ------------------------------------------------------------------------------------- key files


def generate_signing_key() -> Ed25519PrivateKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.generate()


def write_key_pair(directory: Path, name: str = "approver") -> tuple[Path, Path]:
    """Write ``<name>.key`` (PKCS#8 PEM, mode 0600) and ``<name>.pub`` (SubjectPublicKeyInfo PEM).
    Refuses to overwrite an existing key."""
    directory.mkdir(parents=True, exist_ok=True)
    private_path, public_path = directory / f"{name}.key", directory / f"{name}.pub"
    for path in (private_path, public_path):
        if path.exists():
            raise ConfigError(f"{path} exists already: refusing to overwrite a key")
    from cryptography.hazmat.primitives import serialization

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
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    data = read_setting_file(path, _MAX_KEY_FILE, "the signing key")
    if len(data) > _MAX_KEY_FILE:
        raise ConfigError(
            f"{path} is not a PEM private key: over {_MAX_KEY_FILE // 1024} KiB (an Ed25519 one "
            "is about 119 bytes)"
        )
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"{path} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{path} is not an Ed25519 key")
    return key


#: The most of a trust key file read (a PEM Ed25519 public key is 113 bytes).
_MAX_KEY_FILE = 64 * 1024
#: An Ed25519 SubjectPublicKeyInfo is this DER prefix (algorithm 1.3.101.112) and the 32 bytes.
_ED25519_SPKI = bytes.fromhex("302a300506032b6570032100")
_PEM_PUBLIC = re.compile(
    rb"-----BEGIN PUBLIC KEY-----\s*([A-Za-z0-9+/=\s]+?)\s*-----END PUBLIC KEY-----"
)


def load_public_keys(paths: Iterable[Path]) -> dict[str, TrustedKey]:
    """Trusted keys by :func:`key_id`, from PEM public key files (SubjectPublicKeyInfo, as
    :func:`write_key_pair` writes them); read without :mod:`cryptography` (see
    :class:`TrustedKey`)."""
    keys: dict[str, TrustedKey] = {}
    for path in paths:
        data = read_setting_file(path, _MAX_KEY_FILE, "the trust key")
        if len(data) > _MAX_KEY_FILE:
            raise ConfigError(
                f"{path} is not a PEM public key: over {_MAX_KEY_FILE // 1024} KiB (one is "
                "about 113 bytes)"
            )
        pem = _PEM_PUBLIC.search(data)
        try:
            der = base64.b64decode(b"".join(pem.group(1).split()), validate=True) if pem else b""
        except binascii.Error:
            der = b""
        if not der.startswith(b"\x30"):
            raise ConfigError(
                f"{path} is not a PEM public key (-----BEGIN PUBLIC KEY----- ..., as "
                "`scheduled-events keygen` writes it)"
            )
        if len(der) != len(_ED25519_SPKI) + 32 or not der.startswith(_ED25519_SPKI):
            raise ConfigError(f"{path} is not an Ed25519 public key")
        key = TrustedKey(der[len(_ED25519_SPKI) :])
        keys[key_id(key)] = key
    return keys
