"""Attested data: ``GET /metadata/attested/document``, signed by a TEST certificate authority.

Azure signs a small JSON document about the VM so that software can prove where it runs; the
relay uses it to authenticate an agent's origin. The simulator answers the same shape, signed by a
CA of its own (generated, derived from ``--seed``, or the caller's)::

    GET /metadata/attested/document?api-version=2020-09-01&nonce=abcde12345   (Metadata: true)
    200 {"encoding": "pkcs7", "signature": "<base64 of a DER PKCS#7 SignedData>"}

The SignedData (RFC 2315, ``signedData`` content type) *encapsulates* its content (it is not
detached), has one SignerInfo (SHA-256, with signed attributes: contentType, signingTime,
messageDigest) and carries the signing certificate only, as Azure does (a verifier trusts the CA
it was given: :attr:`publisher.simulator.Simulator.attestation_ca_pem`, or
``GET /admin/attestation/ca.pem``). The signing certificate is issued by that CA, its subject and
SAN name ``{location}.metadata.azure.com`` and ``metadata.azure.com`` (what Azure's guidance tells
verifiers to check). The content is compact JSON with sorted keys, as Azure writes it::

    {"licenseType": "",                                  (api-version >= 2020-09-01)
     "nonce": "abcde12345",           (the query's nonce; without one the UTC time, 20201130-211924)
     "plan": {"name": "", "product": "", "publisher": ""},
     "sku": "22_04-lts-gen2",                             (>= 2019-11-01; compute.sku)
     "subscriptionId": "...",                             (>= 2019-04-30; compute.subscriptionId)
     "timeStamp": {"createdOn": "11/30/20 21:19:19 -0000",  (the simulator's wall clock, UTC)
                   "expiresOn": "11/30/20 03:19:19 -0000"}, (six hours later)
     "vmId": "..."}                                       (compute.vmId)

A nonce is up to 32 letters and digits; anything else is 400. Keys are ECDSA P-256: fast, and
derived from the seed when there is one, so that every shard of a fleet signs under the same CA.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import pkcs7
from cryptography.x509.oid import NameOID

from ._errors import ConfigError
from ._identity import VmIdentity

__all__ = ["AttestationCa", "Attestor", "attested_content", "valid_nonce"]

_NONCE = re.compile(r"^[A-Za-z0-9]{1,32}$")
_VALID_FROM = datetime(2020, 1, 1, tzinfo=UTC)
_VALID_UNTIL = datetime(2070, 1, 1, tzinfo=UTC)
_LIFETIME = timedelta(hours=6)
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551

SigningKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def _derived(seed: int | None, label: str) -> tuple[ec.EllipticCurvePrivateKey, int]:
    """A P-256 key and a certificate serial: from ``seed`` when given, random otherwise."""
    if seed is None:
        return ec.generate_private_key(ec.SECP256R1()), x509.random_serial_number()
    digest = hashlib.sha256(f"relay-simulator/{seed}/{label}".encode()).digest()
    value = int.from_bytes(digest, "big")
    key = ec.derive_private_key(value % (_P256_ORDER - 1) + 1, ec.SECP256R1())
    return key, value >> 100  # positive, under 20 bytes


@dataclass(frozen=True, slots=True, eq=False)
class AttestationCa:
    """The CA whose certificate verifiers trust; it issues the simulator's signing certificate.

    >>> ca = AttestationCa.generate(seed=1)
    >>> ca.certificate_pem().startswith(b"-----BEGIN CERTIFICATE-----")
    True
    """

    certificate: x509.Certificate
    private_key: SigningKey

    @classmethod
    def generate(cls, *, seed: int | None = None) -> AttestationCa:
        """A new test CA (P-256); the same key and serial for the same ``seed``."""
        key, serial = _derived(seed, "ca")
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "scheduled-events-relay TEST ONLY"),
                x509.NameAttribute(NameOID.COMMON_NAME, "IMDS simulator attestation test CA"),
            ]
        )
        public = key.public_key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(public)
            .serial_number(serial)
            .not_valid_before(_VALID_FROM)
            .not_valid_after(_VALID_UNTIL)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        )
        return cls(_signed(builder, key), key)

    @classmethod
    def from_pem(
        cls, certificate: bytes, private_key: bytes, password: bytes | None = None
    ) -> AttestationCa:
        """A caller's CA, from PEM; ConfigError when either does not load or they do not match."""
        try:
            loaded = x509.load_pem_x509_certificate(certificate)
        except ValueError as exc:
            raise ConfigError(f"attestation CA certificate: not a PEM certificate: {exc}") from exc
        try:
            key = serialization.load_pem_private_key(private_key, password)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"attestation CA key: not a PEM private key: {exc}") from exc
        if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
            raise ConfigError("attestation CA key: use an RSA or EC key")
        spki = serialization.PublicFormat.SubjectPublicKeyInfo
        if key.public_key().public_bytes(
            serialization.Encoding.DER, spki
        ) != loaded.public_key().public_bytes(serialization.Encoding.DER, spki):
            raise ConfigError("attestation CA: the key does not match the certificate")
        return cls(loaded, key)

    def certificate_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)


class Attestor:
    """Signs attested documents with a certificate issued by ``ca`` (made on first use)."""

    def __init__(self, ca: AttestationCa, *, location: str, seed: int | None) -> None:
        self._ca = ca
        self._location = location
        self._seed = seed
        self._signer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None

    @property
    def ca(self) -> AttestationCa:
        return self._ca

    def _signing(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        if self._signer is None:
            self._signer = self._issue()
        return self._signer

    def _issue(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key, serial = _derived(self._seed, f"signer/{self._location}")
        host = f"{self._location}.metadata.azure.com"
        ca_public = self._ca.certificate.public_key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(self._ca.certificate.subject)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(_VALID_FROM)
            .not_valid_after(_VALID_UNTIL)
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName(host), x509.DNSName("metadata.azure.com")]
                ),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
        )
        if isinstance(ca_public, ec.EllipticCurvePublicKey | rsa.RSAPublicKey):
            builder = builder.add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_public), critical=False
            )
        return _signed(builder, self._ca.private_key), key

    def sign(self, content: bytes) -> str:
        """The base64 of a DER PKCS#7 SignedData encapsulating ``content``."""
        certificate, key = self._signing()
        der = (
            pkcs7.PKCS7SignatureBuilder()
            .set_data(content)
            .add_signer(certificate, key, hashes.SHA256())
            .sign(serialization.Encoding.DER, [pkcs7.PKCS7Options.Binary])
        )
        return base64.b64encode(der).decode("ascii")


def _signed(builder: x509.CertificateBuilder, key: SigningKey) -> x509.Certificate:
    """Sign with SHA-256; ECDSA deterministically (RFC 6979), so that shards built from the same
    seed hold byte-identical certificates (cryptography >= 44; randomized before)."""
    if isinstance(key, ec.EllipticCurvePrivateKey):
        try:
            return builder.sign(key, hashes.SHA256(), ecdsa_deterministic=True)
        except TypeError:  # an older cryptography: valid, but not byte-identical
            pass
    return builder.sign(key, hashes.SHA256())


def valid_nonce(nonce: str) -> bool:
    """Up to 32 letters and digits."""
    return _NONCE.match(nonce) is not None


def attested_content(
    identity: VmIdentity, *, nonce: str | None, api_version: str, now: float
) -> bytes:
    """The signed JSON for ``identity`` at wall time ``now`` (see the module docstring)."""
    created = datetime.fromtimestamp(now, UTC)
    stamp = "%m/%d/%y %H:%M:%S -0000"
    document: dict[str, Any] = {
        "nonce": nonce if nonce is not None else created.strftime("%Y%m%d-%H%M%S"),
        "plan": {"name": "", "product": "", "publisher": ""},
        "timeStamp": {
            "createdOn": created.strftime(stamp),
            "expiresOn": (created + _LIFETIME).strftime(stamp),
        },
        "vmId": identity.vm_id,
    }
    # ISO dates compare correctly as strings.
    if api_version >= "2019-04-30":
        document["subscriptionId"] = identity.subscription_id
    if api_version >= "2019-11-01":
        document["sku"] = identity.sku
    if api_version >= "2020-09-01":
        document["licenseType"] = identity.license_type
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
