"""The agent's signed origin (see :mod:`schemas.origin`): where the broker names no sender
(Service Bus), every lifecycle message is signed with a key of this VM's, attested by Azure.

The key is created once in the state dir (``origin.key``, mode 0600) and kept across restarts;
the attestation (IMDS attested data with the key's nonce) is asked at start and again every
hour (Azure's is valid six hours), so a message is always written while its attestation holds.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from schemas import ConfigError, ImdsError
from schemas._backoff import Backoff
from schemas._files import NotARegularFile, read_regular_file
from schemas.origin import ATTESTATION, KEY, SIGNATURE, key_nonce

from ._imds import ImdsClient

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

__all__ = ["KEY_FILE", "OriginSigner", "load_origin_key"]

log = logging.getLogger(__name__)

KEY_FILE = "origin.key"
#: How often the attestation is asked again (Azure's lasts six hours).
REFRESH_SECONDS = 3600.0
#: The most of ``origin.key`` read, as of a trust key: a PEM Ed25519 key is 119 bytes, and a
#: larger file (or a device that never ends) is refused unread.
MAX_KEY_FILE = 64 * 1024


def load_origin_key(state_dir: Path | None) -> Ed25519PrivateKey:
    """The VM's origin key: read from the state dir, created there the first time (in memory
    only without a state dir). Only an agent that signs (Service Bus) loads cryptography."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if state_dir is None:
        return Ed25519PrivateKey.generate()
    path = state_dir / KEY_FILE
    # A new key is harmless: consumers take any key Azure attests for the VM.
    aside = "move it aside: the agent then makes a new key"
    if os.path.lexists(path):  # a link that leads nowhere is there too: read, and refused
        pem = _read_key_file(path, aside)
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(
                f"state_dir: {path} is not a usable origin key ({why}); {aside}"
            ) from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"state_dir: {path} is not an Ed25519 key; {aside}")
        return key
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(pem)
            handle.flush()
            os.fsync(handle.fileno())  # a key torn by a power loss stops every later start
    except OSError as exc:
        raise ConfigError(
            f"state_dir: cannot create the origin key {path}: {exc.strerror or exc}"
        ) from exc
    log.info("created the VM's origin key %s", path)
    return key


def _read_key_file(path: Path, aside: str) -> bytes:
    """The bytes of ``origin.key``: from a regular file only, read at most
    :data:`MAX_KEY_FILE` bytes (see :func:`read_regular_file`)."""
    try:
        data = read_regular_file(path, MAX_KEY_FILE)
    except NotARegularFile as exc:
        raise ConfigError(
            f"state_dir: {path} is not a regular file: no origin key; {aside}"
        ) from exc
    except OSError as exc:
        raise ConfigError(
            f"state_dir: {path}: cannot read the origin key ({exc.strerror or exc}); {aside}"
        ) from exc
    if len(data) > MAX_KEY_FILE:
        raise ConfigError(
            f"state_dir: {path} is larger than {MAX_KEY_FILE // 1024} KiB: no origin key (one is "
            f"119 bytes); {aside}"
        )
    return data


class OriginSigner:
    """Signs message bodies and carries the current attestation; :meth:`run` keeps the
    attestation fresh."""

    def __init__(self, key: Ed25519PrivateKey, imds: ImdsClient) -> None:
        from cryptography.hazmat.primitives import serialization

        self._key = key
        self._imds = imds
        raw = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.nonce = key_nonce(raw)
        self._public = base64.b64encode(raw).decode()
        self.attestation: str | None = None
        self.attested_at: float | None = None
        self.ready = asyncio.Event()

    def properties(self, body: bytes) -> dict[str, str]:
        """The application properties that prove ``body`` is this VM's."""
        if self.attestation is None:
            raise RuntimeError("no attestation yet: wait for ready")
        return {
            KEY: self._public,
            SIGNATURE: base64.b64encode(self._key.sign(body)).decode(),
            ATTESTATION: self.attestation,
        }

    async def refresh(self) -> None:
        self.attestation = await self._imds.attested(self.nonce)
        self.attested_at = time.monotonic()
        self.ready.set()

    async def run(self) -> None:
        """Attest now, then every :data:`REFRESH_SECONDS` (sooner after a failure)."""
        backoff = Backoff(1.0, 60.0)
        while True:
            try:
                await self.refresh()
            except ImdsError as exc:
                delay = backoff.next()
                log.warning(
                    "IMDS attested data failed (%s): messages wait for a signed origin; trying "
                    "again in %.1f s",
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
                continue
            backoff.reset()
            log.info("origin attested for key nonce %s", self.nonce)
            await asyncio.sleep(REFRESH_SECONDS)
