"""Console sessions: a signed cookie, its CSRF token, and the brake on guessing passwords
(:class:`SignInBrake`).

A session is the cookie ``v1.<payload>.<mac>``: the payload (who, role, how they signed in, the
CSRF token, a nonce, when it was issued, the expiry, for a password a fingerprint of the stored
hash) in base64url JSON, the MAC HMAC-SHA256 over it with the console's session key (random at
every start unless ``--session-key-file`` gives one, so a restart signs everybody out).
Nothing is stored server-side but the nonces of sessions signed out before their expiry, in
bounded memory (:class:`SessionCodec`). The cookie is HttpOnly and SameSite=Strict, Secure
over https.

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
import ipaddress
import json
import logging
import math
import secrets
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from schemas import ConfigError
from schemas._files import read_setting_file

from ._users import Role

__all__ = ["Attempt", "Session", "SessionCodec", "SignInBrake", "Throttle", "load_session_key"]

log = logging.getLogger("consumers.console")

#: The most of a session key file read (a key is 32 characters or so).
_MAX_SESSION_KEY_FILE = 64 * 1024
#: How long a session lasts by default.
DEFAULT_SESSION_SECONDS = 12 * 3600


def load_session_key(path: Path | None) -> bytes:
    """The key in ``path`` (at least 32 bytes of text, e.g. base64 of random bytes), or a
    random one when no file is given."""
    if path is None:
        return secrets.token_bytes(32)
    data = read_setting_file(path, _MAX_SESSION_KEY_FILE, "the session key")
    if len(data) > _MAX_SESSION_KEY_FILE:
        raise ConfigError(f"the session key {path} is larger than 64 KiB: not a key")
    text = data.strip()
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
    #: When it was issued (Unix time, to the millisecond).
    issued: float
    #: A password session: a fingerprint of the user's stored hash when they signed in (a new
    #: password ends the sessions of the old one). Empty for the others.
    binding: str = ""

    @property
    def operator_name(self) -> str:
        """The name recorded in the audit (a shared token cannot vouch for a name: it says so)."""
        return f"{self.user} (shared token)" if self.via == "token" else self.user


@dataclass(slots=True)
class _SignedOut:
    """The sessions of one user (by way of one sign-in) signed out before their expiry."""

    #: Nonce: (issued, expires).
    nonces: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: Every session of theirs issued at or before this is signed out too.
    before: float = -math.inf
    #: When the last of the sessions it speaks of expires (then it can go).
    until: float = -math.inf


class SessionCodec:
    """Issues and checks session cookies (see the module docstring).

    Sign-outs are remembered until the sessions would have expired, in bounded memory: at
    most ``max_per_user`` nonces per user (the oldest beyond that are signed out by time:
    every session of that user issued up to then), and ``max_users`` users (beyond that the
    user whose last sign-out is oldest is forgotten, and every session issued before it, of
    anybody, is signed out). Past a bound more sessions end, never one signed out comes back.
    """

    def __init__(
        self,
        key: bytes,
        *,
        lifetime: float = DEFAULT_SESSION_SECONDS,
        max_per_user: int = 32,
        max_users: int = 10_000,
    ) -> None:
        self._key = hashlib.sha256(b"scheduled-events console session\0" + key).digest()
        self.lifetime = lifetime
        self.max_per_user = max_per_user
        self.max_users = max_users
        #: (how they signed in, who): their sign-outs; the least recently signed out first.
        self._revoked: OrderedDict[tuple[str, str], _SignedOut] = OrderedDict()
        #: Every session issued at or before this is signed out (past ``max_users``).
        self._all_before = -math.inf
        self._warned = -math.inf

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
        now = time.time()
        session = Session(
            user=user,
            role=role,
            via=via,
            csrf=secrets.token_urlsafe(24),
            nonce=secrets.token_urlsafe(12),
            expires=float(int(now + self.lifetime)),
            issued=int(now * 1000) / 1000,
            binding="" if bound_to is None else self._fingerprint(bound_to),
        )
        body = {
            "u": session.user,
            "r": session.role.value,
            "v": session.via,
            "c": session.csrf,
            "n": session.nonce,
            "e": int(session.expires),
            "i": int(session.issued * 1000),
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
            expires = float(body["e"])
            session = Session(
                user=str(body["u"]),
                role=Role(body["r"]),
                via=str(body["v"]),
                csrf=str(body["c"]),
                nonce=str(body["n"]),
                expires=expires,
                # a cookie from before sessions said when they were issued
                issued=int(body["i"]) / 1000 if "i" in body else expires - self.lifetime,
                binding=str(body.get("b", "")),
            )
        except (ValueError, KeyError, TypeError, binascii.Error):
            return None
        if session.expires < time.time() or self.signed_out(session):
            return None
        return session

    def signed_out(self, session: Session) -> bool:
        """Whether ``session`` was signed out (or, past a bound, with older ones)."""
        if session.issued <= self._all_before:
            return True
        record = self._revoked.get((session.via, session.user))
        return record is not None and (
            session.nonce in record.nonces or session.issued <= record.before
        )

    def bound(self, session: Session, secret: str) -> bool:
        """Whether ``session`` was issued bound to ``secret`` (see :meth:`issue`)."""
        return bool(session.binding) and hmac.compare_digest(
            session.binding.encode(), self._fingerprint(secret).encode()
        )

    def revoke(self, session: Session) -> None:
        """Sign ``session`` out (see the class docstring for the bounds)."""
        now = time.time()
        while self._revoked:  # the least recently signed out, once all theirs expired
            oldest = next(iter(self._revoked.values()))
            if oldest.until >= now:
                break
            self._revoked.popitem(last=False)
        key = (session.via, session.user)
        record = self._revoked.setdefault(key, _SignedOut())
        self._revoked.move_to_end(key)
        for nonce, (_, expires) in list(record.nonces.items()):
            if expires < now:
                del record.nonces[nonce]
        record.nonces[session.nonce] = (session.issued, session.expires)
        record.until = max(record.until, session.expires)
        while len(record.nonces) > self.max_per_user:
            nonce = min(record.nonces, key=lambda n: record.nonces[n][0])
            issued, _ = record.nonces.pop(nonce)
            record.before = max(record.before, issued)
        while len(self._revoked) > self.max_users:
            (via, user), forgotten = self._revoked.popitem(last=False)
            newest = max((i for i, _ in forgotten.nonces.values()), default=-math.inf)
            self._all_before = max(self._all_before, newest, forgotten.before)
            if not math.isfinite(self._all_before) or now - self._warned < 60:
                continue
            self._warned = now  # once a minute at most: a flood of names is one line
            log.warning(
                "console: more than %d users signed out within a session's lifetime: every "
                "session issued before %s is signed out too (%s by %s was the oldest)",
                self.max_users,
                datetime.fromtimestamp(self._all_before, UTC).isoformat(),
                user,
                via,
            )

    def remembered(self) -> int:
        """How many sign-outs are remembered (bounded: see the class docstring)."""
        return sum(len(record.nonces) + 1 for record in self._revoked.values())

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

    def recent(self, key: str) -> int:
        """How many failures ``key`` has in the window."""
        failures = self._recent(key, time.monotonic())
        return 0 if failures is None else len(failures)

    def failed(self, *keys: str, at: float | None = None) -> float:
        """Count a failure (or an attempt not yet checked) for each key, ``at`` (monotonic
        time, default now); returns it, for :meth:`forget`."""
        now = time.monotonic() if at is None else at
        if len(self._failures) >= self.max_keys:  # an address sweep: forget the oldest keys
            for key in list(self._failures)[: self.max_keys // 10]:
                del self._failures[key]
        for key in keys:
            self._failures.setdefault(key, deque(maxlen=self.limit * 2)).append(now)
        return now

    def forget(self, at: float, *keys: str) -> None:
        """Take back the failure :meth:`failed` counted ``at``: the attempt was not checked."""
        for key in keys:
            failures = self._failures.get(key)
            if failures is not None and at in failures:
                failures.remove(at)

    def succeeded(self, *keys: str) -> None:
        for key in keys:
            self._failures.pop(key, None)


def _address(address: str) -> str:
    """The client address the brake counts by: an IPv6 client by its /64 (one site's share,
    which hands out addresses freely), else as given."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is None:
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


@dataclass(frozen=True, slots=True)
class Attempt:
    """A sign-in counted as failed before its password is checked."""

    address: str
    name: str
    at: float


class SignInBrake:
    """The brake on guessing passwords: failed sign-ins in ``window`` seconds, counted three
    ways.

    - Per client address and name: after ``per_name`` that address waits before trying that
      name again (429).
    - Per client address, whatever the names: after ``per_address`` it waits (429): a password
      sprayed over many names.
    - Per name, from any address: beyond ``per_name`` each sign-in of that name waits before
      its password is checked (1 s, doubling up to ``max_delay``), but is not refused. Whoever
      knows an operator's name cannot lock them out, and guesses spread over many addresses
      are slowed down.

    An attempt counts before its password is checked (guesses sent at once are braked like
    guesses sent one after the other); a success takes it back from the address and clears
    the name's counts."""

    def __init__(
        self,
        *,
        per_name: int = 5,
        per_address: int = 20,
        window: float = 300.0,
        max_delay: float = 10.0,
    ) -> None:
        self.per_name = per_name
        self.max_delay = max_delay
        self._pairs = Throttle(per_name, window)
        self._addresses = Throttle(per_address, window)
        self._names = Throttle(per_name, window)

    def retry_after(self, address: str, name: str) -> float:
        """Seconds before ``address`` may try ``name`` again (0: go ahead)."""
        address = _address(address)
        return max(
            self._pairs.retry_after(f"{address} {name.casefold()}"),
            self._addresses.retry_after(address),
        )

    def delay(self, name: str) -> float:
        """Seconds a sign-in of ``name`` waits before its password is checked."""
        beyond = self._names.recent(name.casefold()) - self.per_name
        return 0.0 if beyond < 0 else min(self.max_delay, 2.0**beyond)

    def attempt(self, address: str, name: str) -> Attempt:
        """Count a sign-in as failed, before its password is checked."""
        address, name = _address(address), name.casefold()
        at = self._pairs.failed(f"{address} {name}")
        self._addresses.failed(address, at=at)
        self._names.failed(name, at=at)
        return Attempt(address, name, at)

    def succeeded(self, attempt: Attempt) -> None:
        self._pairs.succeeded(f"{attempt.address} {attempt.name}")
        self._addresses.forget(attempt.at, attempt.address)
        self._names.succeeded(attempt.name)

    def withdraw(self, attempt: Attempt) -> None:
        """The attempt was not checked after all (too many checks at once): it does not count."""
        self._pairs.forget(attempt.at, f"{attempt.address} {attempt.name}")
        self._addresses.forget(attempt.at, attempt.address)
        self._names.forget(attempt.at, attempt.name)
