"""Console sessions: a signed cookie, its CSRF token, and the brake on guessing passwords.

A session is the cookie ``v1.<payload>.<mac>``: the payload (who, role, how they signed in, the
CSRF token, a nonce, the expiry) in base64url JSON, the MAC HMAC-SHA256 over it with the
console's session key (random at every start unless ``--session-key-file`` gives one, so a
restart signs everybody out). Nothing is stored server-side but the nonces of sessions signed
out before their expiry. The cookie is HttpOnly and SameSite=Strict, Secure over https.

Every request that changes something carries the session's CSRF token (header
``X-CSRF-Token`` or form field ``csrf``); the page reads it from ``/api/me``, which another
site cannot read (same-origin policy), and the SameSite cookie is not sent on another site's
request anyway. The sign-in form, before any session exists, is protected the same way by a
short-lived cookie of its own that the form must echo.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from schemas import ConfigError

from ._users import Role

__all__ = ["Session", "SessionCodec", "Throttle", "load_session_key"]

#: How long a session lasts by default.
DEFAULT_SESSION_SECONDS = 12 * 3600


def load_session_key(path: Path | None) -> bytes:
    """The key in ``path`` (at least 32 bytes of text, e.g. base64 of random bytes), or a
    random one when no file is given."""
    if path is None:
        return secrets.token_bytes(32)
    try:
        text = path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the session key {path}: {exc.strerror}") from exc
    if len(text) < 32:
        raise ConfigError(
            f"the session key in {path} is too short (at least 32 characters): make one with "
            f"`head -c 32 /dev/urandom | base64 > {path}`"
        )
    return text


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class Session:
    """One signed-in person."""

    user: str
    role: Role
    #: ``password``, ``token`` or ``proxy``.
    via: str
    csrf: str
    nonce: str
    expires: float
    #: A password session: a fingerprint of the user's stored hash when they signed in (a new
    #: password ends the sessions of the old one). Empty for the others.
    binding: str = ""

    @property
    def operator_name(self) -> str:
        """The name recorded in the audit (a shared token cannot vouch for a name: it says so)."""
        return f"{self.user} (shared token)" if self.via == "token" else self.user


class SessionCodec:
    """Issues and checks session cookies (see the module docstring)."""

    def __init__(self, key: bytes, *, lifetime: float = DEFAULT_SESSION_SECONDS) -> None:
        self._key = hashlib.sha256(b"scheduled-events console session\0" + key).digest()
        self.lifetime = lifetime
        #: Nonces of sessions signed out, with their expiry (dropped once expired).
        self._revoked: dict[str, float] = {}

    def _mac(self, payload: str) -> str:
        return _b64(hmac.new(self._key, payload.encode(), hashlib.sha256).digest()[:24])

    def _fingerprint(self, secret: str) -> str:
        """Keyed, so the cookie tells its holder nothing about the stored hash."""
        digest = hmac.new(self._key, b"binding\0" + secret.encode(), hashlib.sha256).digest()
        return _b64(digest[:12])

    def issue(
        self, user: str, role: Role, via: str, *, bound_to: str | None = None
    ) -> tuple[Session, str]:
        """A new session and its cookie; ``bound_to`` (the user's stored password hash): the
        session holds only while :meth:`bound` says that is still the hash."""
        session = Session(
            user=user,
            role=role,
            via=via,
            csrf=secrets.token_urlsafe(24),
            nonce=secrets.token_urlsafe(12),
            expires=float(int(time.time() + self.lifetime)),
            binding="" if bound_to is None else self._fingerprint(bound_to),
        )
        body = {
            "u": session.user,
            "r": session.role.value,
            "v": session.via,
            "c": session.csrf,
            "n": session.nonce,
            "e": int(session.expires),
            "b": session.binding,
        }
        payload = _b64(json.dumps(body, separators=(",", ":")).encode())
        return session, f"v1.{payload}.{self._mac(payload)}"

    def read(self, cookie: str | None) -> Session | None:
        """The session the cookie holds, or None (absent, forged, expired or signed out). A
        cookie is ASCII: anything else (a quoted value the server decoded as latin-1) is no
        session, not a comparison that raises."""
        if not cookie or len(cookie) > 4096 or not cookie.isascii():
            return None
        parts = cookie.split(".")
        if len(parts) != 3 or parts[0] != "v1":
            return None
        _, payload, mac = parts
        if not hmac.compare_digest(mac.encode(), self._mac(payload).encode()):
            return None
        try:
            body = json.loads(_unb64(payload))
            session = Session(
                user=str(body["u"]),
                role=Role(body["r"]),
                via=str(body["v"]),
                csrf=str(body["c"]),
                nonce=str(body["n"]),
                expires=float(body["e"]),
                binding=str(body.get("b", "")),
            )
        except (ValueError, KeyError, TypeError, binascii.Error):
            return None
        if session.expires < time.time() or session.nonce in self._revoked:
            return None
        return session

    def bound(self, session: Session, secret: str) -> bool:
        """Whether ``session`` was issued bound to ``secret`` (see :meth:`issue`)."""
        return bool(session.binding) and hmac.compare_digest(
            session.binding.encode(), self._fingerprint(secret).encode()
        )

    def revoke(self, session: Session) -> None:
        now = time.time()
        for nonce, expires in list(self._revoked.items()):
            if expires < now:
                del self._revoked[nonce]
        self._revoked[session.nonce] = session.expires

    def form_token(self) -> str:
        """A token for the sign-in form (its cookie and its hidden field carry it)."""
        return secrets.token_urlsafe(24)


def same_token(given: str | None, expected: str) -> bool:
    return bool(given) and hmac.compare_digest(str(given).encode(), expected.encode())


class Throttle:
    """At most ``limit`` failed sign-ins per key (a client address, a name) in ``window``
    seconds; then that key waits until the oldest failure leaves the window."""

    def __init__(self, limit: int = 5, window: float = 300.0, *, max_keys: int = 10_000) -> None:
        self.limit = limit
        self.window = window
        self.max_keys = max_keys
        self._failures: dict[str, deque[float]] = {}

    def _recent(self, key: str, now: float) -> deque[float] | None:
        failures = self._failures.get(key)
        if failures is None:
            return None
        while failures and failures[0] < now - self.window:
            failures.popleft()
        if not failures:
            del self._failures[key]
            return None
        return failures

    def retry_after(self, *keys: str) -> float:
        """Seconds to wait before trying again (0: go ahead)."""
        now = time.monotonic()
        wait = 0.0
        for key in keys:
            failures = self._recent(key, now)
            if failures is not None and len(failures) >= self.limit:
                wait = max(wait, failures[0] + self.window - now)
        return wait

    def failed(self, *keys: str) -> None:
        now = time.monotonic()
        if len(self._failures) >= self.max_keys:  # an address sweep: forget the oldest keys
            for key in list(self._failures)[: self.max_keys // 10]:
                del self._failures[key]
        for key in keys:
            self._failures.setdefault(key, deque(maxlen=self.limit * 2)).append(now)

    def succeeded(self, *keys: str) -> None:
        for key in keys:
            self._failures.pop(key, None)
