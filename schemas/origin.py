"""Signed origins: how a VM proves that a lifecycle message is its own where the broker names no
sender (Azure Service Bus).

Each agent holds an Ed25519 key of its own (created in its state dir) and binds it to the VM's
Azure identity with IMDS **attested data**: it asks ``/metadata/attested/document`` with the
nonce :func:`key_nonce` of its public key, and Azure signs (PKCS#7) a document naming that nonce
and the VM's ``vmId``. Every lifecycle message then travels with three application properties:

=========================  ==================================================================
``origin-key``             the agent's Ed25519 public key, base64 (32 bytes)
``origin-signature``       Ed25519 over the message body, base64
``origin-attestation``     the attested document's ``signature`` field as IMDS gave it (the
                           base64 DER PKCS#7 that names the key's nonce and the VM's vmId)
=========================  ==================================================================

A consumer (:class:`OriginVerifier`) accepts a message only when the attestation is signed by a
certificate it trusts (Azure's in production; the simulator's test CA in tests), its nonce is the
key's, its vmId is the vmId the message claims, the message was written while the attestation
was valid, and the body's signature verifies with the key. A holder of a VM's broker credential
cannot make a message pass as another VM's: it would need that VM's attested document for a key
it holds, and only that VM's IMDS signs it.

Azure's attested document names the VM by ``vmId``, not by name; the name in a message is bound to
the vmId the first time they are seen together (trust on first use, for the process) unless the
operator gives an inventory (``name,vmId`` lines) that decides it. A VM has one name, so the
binding holds both ways: a vmId speaks for the one name it first signed a valid message as (or
the inventory gives it). A VM with a genuine attestation of its own can so take at most one name
from its real VM, and only one no message claimed before it (only an inventory prevents that):
not every name it cares to invent. Without an inventory at most :data:`_MAX_PINNED` names are
bound; a new name past that is refused (forgetting an old binding would let any VM take that
name next).
"""

from __future__ import annotations

import base64
import binascii
import csv
import hashlib
import io
import json
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ._errors import ConfigError, RelayError
from ._files import read_setting_file, read_setting_text

__all__ = [
    "ATTESTATION",
    "KEY",
    "SIGNATURE",
    "Attested",
    "OriginRejected",
    "OriginVerifier",
    "key_nonce",
    "load_trusted_certificates",
]

log = logging.getLogger(__name__)

KEY = "origin-key"
SIGNATURE = "origin-signature"
ATTESTATION = "origin-attestation"

#: How far a message's time may lie outside its attestation's validity (clock skew, a message
#: written just before the agent refreshed its attestation and published just after).
_SKEW = timedelta(minutes=10)
_CACHE = 20_000
#: The most VM names bound to a vmId by first use (without an inventory): more than a fleet
#: one consumer serves, each a few hundred bytes. Past it a new name is refused.
_MAX_PINNED = 100_000
#: The longest attestation taken, in characters. Azure's is a few KiB (the signed document and
#: the signing certificate): a longer one is refused before it is decoded, parsed or cached.
_MAX_ATTESTATION = 64 * 1024
#: The most certificates an attestation may carry (Azure's carries its signing certificate);
#: each one costs a parse and, in the chain check, a signature check per step.
_MAX_CERTIFICATES = 8


class OriginRejected(RelayError):
    """A message whose signed origin does not hold; the text says why."""


def key_nonce(public_key: bytes) -> str:
    """The attestation nonce that binds a raw 32-byte Ed25519 public key: the first 32 hex
    digits of its SHA-256 (IMDS takes up to 32 letters and digits)."""
    return hashlib.sha256(public_key).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Attested:
    """What a verified attestation says."""

    vm_id: str
    subscription_id: str
    nonce: str
    created: datetime
    expires: datetime


def _azure_time(text: str) -> datetime:
    # Azure: "11/30/20 21:19:19 -0000"
    return datetime.strptime(text, "%m/%d/%y %H:%M:%S %z").astimezone(UTC)


def load_trusted_certificates(paths: Iterable[Path]) -> list[Any]:
    """The certificates attestations must chain to (PEM files, one or more each)."""
    from cryptography import x509

    found: list[Any] = []
    for path in paths:
        data = read_setting_file(path, _MAX_CA_FILE, "the attestation CA")
        if len(data) > _MAX_CA_FILE:
            raise ConfigError(f"the attestation CA {path} is larger than 1 MiB")
        try:
            found.extend(x509.load_pem_x509_certificates(data))
        except ValueError as exc:
            raise ConfigError(f"{path} holds no PEM certificate: {exc}") from exc
    if not found:
        raise ConfigError("no attestation CA certificate given")
    return found


def _verify_signed_data(raw: bytes, trusted: list[Any], now: datetime) -> bytes:
    """The content of a PKCS#7 SignedData whose signer chains to ``trusted``; else raise
    :class:`OriginRejected`.

    ``raw`` is whatever a sender put in a message, so every part of it is read inside one
    ``try`` (asn1crypto parses lazily: a field is only parsed, and fails, when it is first
    read), into plain values, before anything is checked with them."""
    from asn1crypto import cms
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

    try:
        info = cms.ContentInfo.load(raw, strict=True)  # strict: nothing after the DER
        if info["content_type"].native != "signed_data":
            raise OriginRejected("the attestation is not PKCS#7 signed data")
        signed = info["content"]
        content = signed["encap_content_info"]["content"].native
        carried = signed["certificates"]
        if len(carried) > _MAX_CERTIFICATES:
            raise OriginRejected(
                f"the attestation carries {len(carried)} certificates (at most "
                f"{_MAX_CERTIFICATES} are taken)"
            )
        certificates = []
        for choice in carried:
            if choice.name != "certificate":
                raise OriginRejected("the attestation carries a certificate that is not X.509")
            # RFC 5280: positive. cryptography still loads another with a warning; refused here.
            if choice.chosen["tbs_certificate"]["serial_number"].native <= 0:
                raise OriginRejected("the attestation carries a certificate with no valid serial")
            certificates.append(x509.load_der_x509_certificate(choice.chosen.dump()))
        signers = signed["signer_infos"]
        if len(signers) != 1:
            raise OriginRejected(f"the attestation has {len(signers)} signers, not one")
        signer = signers[0]
        sid = signer["sid"]
        if sid.name != "issuer_and_serial_number":
            raise OriginRejected(
                "the attestation's signer is not named by issuer and serial number"
            )
        serial = sid.chosen["serial_number"].native
        digest_name = signer["digest_algorithm"]["algorithm"].native
        attributes = signer["signed_attrs"]
        digests: list[object] | None = None
        signed_bytes = content
        if len(attributes):
            digests = []
            for attribute in attributes:
                if attribute["type"].native == "message_digest":
                    digests.extend(value.native for value in attribute["values"])
            signed_bytes = attributes.untag().dump()
        signature = signer["signature"].native
    except OriginRejected:
        raise
    except (
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
        IndexError,
        x509.InvalidVersion,
    ) as exc:
        raise OriginRejected(f"the attestation is not readable PKCS#7: {exc}") from exc
    if not isinstance(content, bytes):
        raise OriginRejected("the attestation has no content")
    if not isinstance(signature, bytes):
        raise OriginRejected("the attestation has no signature")
    algorithm: hashes.HashAlgorithm
    if digest_name == "sha256":
        algorithm = hashes.SHA256()
    elif digest_name == "sha384":
        algorithm = hashes.SHA384()
    elif digest_name == "sha512":
        algorithm = hashes.SHA512()
    else:
        raise OriginRejected(f"the attestation's digest {digest_name} is not accepted")
    signer_cert = next((c for c in certificates if c.serial_number == serial), None)
    if signer_cert is None:
        raise OriginRejected("the attestation does not carry its signing certificate")
    if not (signer_cert.not_valid_before_utc <= now <= signer_cert.not_valid_after_utc):
        raise OriginRejected("the attestation's signing certificate is not valid now")
    _chains(signer_cert, certificates, trusted, now)
    if digests is not None:
        # RFC 5652: signed attributes hold exactly one messageDigest, of exactly one value.
        digest = hashes.Hash(algorithm)
        digest.update(content)
        if digests != [digest.finalize()]:
            raise OriginRejected("the attestation's content does not match its digest")
    try:
        key = signer_cert.public_key()
        if isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, signed_bytes, padding.PKCS1v15(), algorithm)
        elif isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, signed_bytes, ec.ECDSA(algorithm))
        else:
            raise OriginRejected("the attestation's key type is not accepted")
    except (InvalidSignature, ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise OriginRejected("the attestation's signature does not verify") from exc
    return content


def _chains(cert: Any, carried: list[Any], trusted: list[Any], now: datetime) -> None:
    """``cert`` is one of ``trusted`` or issued by one, directly or through carried or trusted
    intermediates (at most three steps)."""
    pool = [*carried, *trusted]
    current = cert
    for _ in range(4):
        if any(current == anchor for anchor in trusted):
            return
        for candidate in pool:
            if candidate == current:
                continue
            try:
                current.verify_directly_issued_by(candidate)
            except (ValueError, TypeError, Exception):
                continue
            if not (candidate.not_valid_before_utc <= now <= candidate.not_valid_after_utc):
                continue
            if any(candidate == anchor for anchor in trusted):
                return
            current = candidate
            break
        else:
            break
    raise OriginRejected("the attestation is not signed by a trusted certificate")


#: The most of an inventory file read (a fleet of 100,000 VMs is about 6 MiB).
_MAX_INVENTORY_BYTES = 64 << 20
#: The most of an attestation CA file read (a PEM bundle of a few certificates).
_MAX_CA_FILE = 1 << 20


def _name_like(text: str) -> bool:
    return bool(text) and text.isprintable()


class OriginVerifier:
    """Checks signed origins (see the module docstring). ``inventory``: ``name,vmId`` pairs
    that decide which vmId a VM name has (else the first one seen, for this process)."""

    def __init__(
        self,
        trusted: list[Any],
        *,
        inventory: Mapping[str, str] | None = None,
        subscriptions: Iterable[str] | None = None,
    ) -> None:
        self._trusted = trusted
        self._inventory = {k.casefold(): v.casefold() for k, v in (inventory or {}).items()}
        #: The names the inventory gives each vmId it names.
        self._inventory_names: dict[str, set[str]] = {}
        for name, vm_id in self._inventory.items():
            self._inventory_names.setdefault(vm_id, set()).add(name)
        self._subscriptions = (
            None if subscriptions is None else {s.casefold() for s in subscriptions}
        )
        #: name -> vmId and vmId -> name, bound by first use (names the inventory leaves out).
        self._pinned: dict[str, str] = {}
        self._pinned_names: dict[str, str] = {}
        self._attested: OrderedDict[str, Attested] = OrderedDict()

    @classmethod
    def from_files(cls, ca: Iterable[Path], inventory: Path | None = None) -> OriginVerifier:
        pairs = {} if inventory is None else cls.read_inventory(inventory)
        return cls(load_trusted_certificates(ca), inventory=pairs)

    @staticmethod
    def read_inventory(path: Path) -> dict[str, str]:
        """The ``name,vmId`` lines of an inventory file (UTF-8 CSV; ``#`` comments and blank
        lines aside; further columns ignored), case-folded. It decides which vmId a VM name
        has, so a line that says anything else is a :class:`ConfigError` naming the line,
        not a line left out (the VM it meant to pin would take the first vmId seen): so are
        a name given twice with two vmIds, and a file that is not UTF-8 CSV."""
        where = f"the VM inventory {path}"
        text = read_setting_text(
            path, _MAX_INVENTORY_BYTES, "the VM inventory", encoding="utf-8-sig"
        )
        pairs: dict[str, str] = {}
        named: dict[str, int] = {}
        reader = csv.reader(io.StringIO(text, newline=""), strict=True)
        try:
            for row in reader:
                line = reader.line_num
                fields = [field.strip() for field in row]
                if not any(fields) or fields[0].startswith("#"):
                    continue
                if len(fields) < 2 or not all(_name_like(f) for f in fields[:2]):
                    raise ConfigError(
                        f"{where}, line {line}: give name,vmId (printable, neither empty), "
                        f"not {','.join(row)[:120]!r}"
                    )
                name, vm_id = fields[0].casefold(), fields[1].casefold()
                if pairs.get(name, vm_id) != vm_id:
                    raise ConfigError(
                        f"{where}, line {line}: {fields[0]} is named on line {named[name]} "
                        f"already, with vmId {pairs[name]}"
                    )
                pairs[name] = vm_id
                named.setdefault(name, line)
        except csv.Error as exc:
            raise ConfigError(f"{where}, line {reader.line_num}: not CSV: {exc}") from exc
        return pairs

    def attested(self, attestation: str, now: datetime) -> Attested:
        """The verified content of an attestation (cached by its text); :class:`OriginRejected`
        for anything else, whatever its shape."""
        known = self._attested.get(attestation)
        if known is not None:
            self._attested.move_to_end(attestation)
            return known
        if len(attestation) > _MAX_ATTESTATION:
            raise OriginRejected(
                f"the attestation is {len(attestation)} characters long (at most "
                f"{_MAX_ATTESTATION} are taken)"
            )
        try:
            raw = base64.b64decode(attestation, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise OriginRejected("the attestation is not base64") from exc
        try:
            content = _verify_signed_data(raw, self._trusted, now)
        except OriginRejected:
            raise
        except Exception as exc:
            # What the parsers raise for the shapes read above is handled there. Whatever else
            # a crafted structure makes them raise is a refusal too: a check of hostile input
            # fails closed, and check() promises OriginRejected and nothing else (a consumer
            # turns only that into a dead letter).
            log.warning("an attestation could not be checked (%r): refused", exc)
            raise OriginRejected(
                f"the attestation cannot be checked: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            document = json.loads(content)
            stamp = document["timeStamp"]
            result = Attested(
                vm_id=str(document["vmId"]),
                subscription_id=str(document.get("subscriptionId", "")),
                nonce=str(document["nonce"]),
                created=_azure_time(stamp["createdOn"]),
                expires=_azure_time(stamp["expiresOn"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            why = "nested too deep" if isinstance(exc, RecursionError) else exc
            raise OriginRejected(f"the attested document is not what Azure signs: {why}") from exc
        self._attested[attestation] = result
        while len(self._attested) > _CACHE:
            self._attested.popitem(last=False)
        return result

    def check(
        self,
        body: bytes,
        properties: Mapping[str, object],
        *,
        vm_name: str,
        vm_id: str,
        written: datetime,
        now: datetime | None = None,
    ) -> None:
        """Raise :class:`OriginRejected` unless ``body`` is signed by a key attested for the
        VM ``vm_name`` with ``vm_id``, while the attestation was valid."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        key_text, signature_text, attestation = (
            properties.get(KEY),
            properties.get(SIGNATURE),
            properties.get(ATTESTATION),
        )
        if not (
            isinstance(key_text, str)
            and isinstance(signature_text, str)
            and isinstance(attestation, str)
        ):
            raise OriginRejected(
                "the message is not signed (no origin key, signature or attestation)"
            )
        try:
            key = base64.b64decode(key_text, validate=True)
            signature = base64.b64decode(signature_text, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise OriginRejected("the origin key or signature is not base64") from exc
        moment = now or datetime.now(UTC)
        attested = self.attested(attestation, moment)
        if attested.nonce != key_nonce(key):
            raise OriginRejected("the attestation was not made for this message's key")
        if not vm_id or attested.vm_id.casefold() != vm_id.casefold():
            raise OriginRejected(
                f"the attestation is for vmId {attested.vm_id}, the message claims {vm_id or '-'}"
            )
        if self._subscriptions is not None and (
            attested.subscription_id.casefold() not in self._subscriptions
        ):
            raise OriginRejected(f"subscription {attested.subscription_id} is not trusted")
        if not (attested.created - _SKEW <= written <= attested.expires + _SKEW):
            raise OriginRejected("the message was written outside its attestation's validity")
        name, claimed = vm_name.casefold(), vm_id.casefold()
        self._check_binding(name, claimed, vm_name, vm_id)
        try:
            Ed25519PublicKey.from_public_bytes(key).verify(signature, body)
        except (InvalidSignature, ValueError) as exc:
            raise OriginRejected(
                "the body's signature does not verify with the origin key"
            ) from exc
        # Bound only now, by a message that holds whole: a key and attestation copied from
        # another VM's message, without that key's signature, bind nothing.
        if name not in self._inventory and name not in self._pinned:
            self._pinned[name] = claimed
            self._pinned_names[claimed] = name

    def _check_binding(self, name: str, claimed: str, vm_name: str, vm_id: str) -> None:
        """Raise :class:`OriginRejected` unless the name ``vm_name`` and ``vm_id`` may go
        together: the name is bound to no other vmId, and the vmId to no other name (by the
        inventory, or by first use)."""
        expected = self._inventory.get(name)
        if expected is None:
            expected = self._pinned.get(name)
        if expected is not None and expected != claimed:
            raise OriginRejected(
                f"VM {vm_name} is vmId {expected}, not {vm_id}"
                + ("" if name in self._inventory else " (the first one seen by this process)")
            )
        listed = self._inventory_names.get(claimed)
        if listed is not None and name not in listed:
            raise OriginRejected(
                f"vmId {vm_id} is VM {', '.join(sorted(listed))} in the inventory, not {vm_name}"
            )
        if name in self._inventory:
            return
        own = self._pinned_names.get(claimed)
        if own is not None and own != name:
            raise OriginRejected(
                f"vmId {vm_id} is VM {own}, not {vm_name} (the name it first signed as in this "
                "process: a VM has one name)"
            )
        if expected is None and len(self._pinned) >= _MAX_PINNED:
            raise OriginRejected(
                f"VM {vm_name} is new, and {_MAX_PINNED} names are bound to a vmId by first use "
                "already, the most this process keeps: give the consumers an inventory "
                "(--vm-inventory) that names the fleet's VMs"
            )
