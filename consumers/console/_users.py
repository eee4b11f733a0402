"""Who may sign in to the console, and with which role: the users file.

One user a line, ``NAME:ROLE:HASH``; blank lines and lines starting with ``#`` are ignored::

    # scheduled-events console users
    alice:operator:pbkdf2_sha256$600000$q8Xo3vJ0aN1dTqZ2WmRk9A$3Qk...=
    bob:viewer:pbkdf2_sha256$600000$...$...
    carol@example.com:operator:-

``ROLE`` is ``operator`` (may approve, hold and release) or ``viewer`` (reads only). ``HASH`` is
PBKDF2-HMAC-SHA256 in Django's format, ``pbkdf2_sha256$ITERATIONS$SALT$BASE64(32-byte key)``
(the salt is taken as its ASCII bytes), so any tool that writes Django password hashes writes
these; ``-`` means no password: the user signs in only through a trusted proxy
(``--trust-proxy-header``), and the line gives that user's role. ``scheduled-events
console-user FILE NAME --role ROLE`` adds or replaces a line. Passwords are compared in
constant time, and an unknown name costs the same work as a wrong password.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import tempfile
import unicodedata
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from schemas import ConfigError
from schemas._files import read_setting_text

__all__ = [
    "DEFAULT_ITERATIONS",
    "MAX_ITERATIONS",
    "Role",
    "User",
    "UsersFile",
    "hash_password",
    "is_plain_text",
    "verify_password",
    "write_user",
]

log = logging.getLogger("consumers.console")

#: OWASP's 2023 figure for PBKDF2-HMAC-SHA256 (about 0.3 s on one core here).
DEFAULT_ITERATIONS = 600_000
#: The most a stored hash may ask for (about 5 s here): every sign-in of an unknown name costs
#: as many rounds as the costliest user, so one absurd count (a typo, a hostile file) would
#: pin a thread per anonymous attempt for as long as it says.
MAX_ITERATIONS = 10_000_000
_ALGORITHM = "pbkdf2_sha256"
NO_PASSWORD = "-"


class Role(StrEnum):
    """What a signed-in person may do."""

    OPERATOR = "operator"
    VIEWER = "viewer"

    @property
    def may_act(self) -> bool:
        return self is Role.OPERATOR


@dataclass(frozen=True, slots=True)
class User:
    name: str
    role: Role
    #: The stored hash, or ``-`` (proxy sign-in only).
    password_hash: str


def hash_password(password: str, *, iterations: int = DEFAULT_ITERATIONS) -> str:
    """``pbkdf2_sha256$ITERATIONS$SALT$HASH`` for ``password``, with a new random salt."""
    if not 1 <= iterations <= MAX_ITERATIONS:
        raise ValueError(f"iterations: from 1 to {MAX_ITERATIONS:,}")
    salt = secrets.token_urlsafe(16)
    key = hashlib.pbkdf2_hmac("sha256", password.encode(), salt.encode(), iterations)
    return f"{_ALGORITHM}${iterations}${salt}${base64.b64encode(key).decode()}"


def _parse_hash(stored: str, *, most: int | None = MAX_ITERATIONS) -> tuple[int, str, bytes] | None:
    """(iterations, salt, key), or None when ``stored`` is no hash of ours or asks for more
    than ``most`` iterations."""
    parts = stored.split("$")
    if len(parts) != 4 or parts[0] != _ALGORITHM:
        return None
    try:
        iterations = int(parts[1])
        key = base64.b64decode(parts[3], validate=True)
    except ValueError:
        return None
    if iterations < 1 or not parts[2] or len(key) < 16:
        return None
    if most is not None and iterations > most:
        return None
    return iterations, parts[2], key


def verify_password(password: str, stored: str, *, dummy_iterations: int = 0) -> bool:
    """Whether ``password`` matches ``stored`` (constant-time compare of the derived keys).
    A ``stored`` that is no hash (``-``, an unknown user) does ``dummy_iterations`` rounds of
    the same work first, so a wrong name takes as long as a wrong password."""
    parsed = _parse_hash(stored)
    if parsed is None:
        if dummy_iterations > 0:
            hashlib.pbkdf2_hmac("sha256", password.encode(), b"dummy-salt", dummy_iterations)
        return False
    iterations, salt, expected = parsed
    derived = hashlib.pbkdf2_hmac("sha256", password.encode(), salt.encode(), iterations)
    return hmac.compare_digest(derived, expected)


#: Control characters, line and paragraph separators, lone surrogates.
_NOT_TEXT = frozenset({"Cc", "Cs", "Zl", "Zp"})


def is_plain_text(text: str) -> bool:
    """No control character, line break or lone surrogate: names and reasons end up in log
    lines (a line break in one would forge a line) and in the database (which refuses a lone
    surrogate, and PostgreSQL a NUL)."""
    return text.isprintable() or not any(unicodedata.category(c) in _NOT_TEXT for c in text)


def _check_name(name: str) -> str:
    if (
        not name
        or len(name) > 200
        or ":" in name
        or name != name.strip()
        or not is_plain_text(name)
    ):
        raise ConfigError(
            f"user name {name!r}: 1 to 200 characters, no colon, tab, line break, control "
            "character or leading/trailing space"
        )
    return name


def _parse_line(path: Path, number: int, line: str) -> User:
    name, sep, rest = line.partition(":")
    role_text, sep2, password_hash = rest.partition(":")
    if not sep or not sep2:
        raise ConfigError(f"{path}:{number}: expected NAME:ROLE:HASH")
    try:
        role = Role(role_text)
    except ValueError:
        raise ConfigError(
            f"{path}:{number}: role {role_text!r} is not operator or viewer"
        ) from None
    if password_hash != NO_PASSWORD:
        parsed = _parse_hash(password_hash, most=None)
        if parsed is None:
            raise ConfigError(
                f"{path}:{number}: the hash of {name!r} is not "
                "pbkdf2_sha256$ITERATIONS$SALT$HASH (write it with `scheduled-events console-user`)"
            )
        if parsed[0] > MAX_ITERATIONS:
            raise ConfigError(
                f"{path}:{number}: the hash of {name!r} asks for {parsed[0]:,} PBKDF2 "
                f"iterations: at most {MAX_ITERATIONS:,} (write it again with `scheduled-events "
                "console-user`)"
            )
    try:
        return User(_check_name(name), role, password_hash)
    except ConfigError as exc:
        raise ConfigError(f"{path}:{number}: {exc}") from None


#: The most of a users file read (a line of about 150 bytes a user).
_MAX_USERS_FILE = 16 << 20


def _read(path: Path) -> dict[str, User]:
    """The users of the file ``path``: a regular UTF-8 file of at most :data:`_MAX_USERS_FILE`
    bytes, each line a user, else :class:`ConfigError` saying which and why."""
    return _parse(path, read_setting_text(path, _MAX_USERS_FILE, "the users file"))


def _parse(path: Path, text: str) -> dict[str, User]:
    users: dict[str, User] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        user = _parse_line(path, number, line)
        users[user.name.casefold()] = user
    return users


class UsersFile:
    """The users file, read again whenever it changes on disk (a role taken away applies to
    sessions already open, at their next request).

    A file that was good at start and then cannot be read (a mistyped line, deleted) fails
    closed: no user until it is fixed, so nobody signs in by password and no password session
    holds (a user just removed stays out), and the error is logged once per bad version."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._users: dict[str, User] = {}
        self._typical_iterations = DEFAULT_ITERATIONS
        self._failure: str | None = None
        #: Why the file on disk cannot be used now (None: it can).
        self.problem: str | None = None
        self.reload()

    def reload(self) -> None:
        """Read the file again when it changed; :class:`ConfigError` when it cannot be read."""
        try:
            stat = self.path.stat()
        except OSError as exc:
            raise ConfigError(f"cannot read the users file {self.path}: {exc.strerror}") from exc
        stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            if self._failure is not None:  # a bad version is read once, not at every request
                raise ConfigError(self._failure)
            return
        self._stamp = stamp
        self._users = {}
        try:
            self._users = _read(self.path)
        except ConfigError as exc:
            self._failure = str(exc)
            raise
        self._failure = None
        counts = [p[0] for u in self._users.values() if (p := _parse_hash(u.password_hash))]
        self._typical_iterations = max(counts, default=DEFAULT_ITERATIONS)

    def _refresh(self) -> None:
        try:
            self.reload()
        except ConfigError as exc:
            self._users = {}
            if str(exc) != self.problem:
                self.problem = str(exc)
                log.error(
                    "console: %s: password sign-ins are refused and password sessions do not "
                    "hold until the users file is fixed (its roles do not apply meanwhile: "
                    "proxy users are viewers)",
                    exc,
                )
            return
        if self.problem is not None:
            self.problem = None
            log.warning(
                "console: the users file %s is usable again (%d users): password sign-ins resume",
                self.path,
                len(self._users),
            )

    def get(self, name: str) -> User | None:
        self._refresh()
        return self._users.get(name.casefold())

    def __len__(self) -> int:
        return len(self._users)

    def check(self, name: str, password: str) -> User | None:
        """The user when ``password`` is theirs (a ``-`` user never matches)."""
        return self.verify(self.get(name), password)

    def verify(self, user: User | None, password: str) -> User | None:
        """``user`` when ``password`` is theirs; None (after the same work) when no user."""
        stored = user.password_hash if user is not None else NO_PASSWORD
        matched = verify_password(password, stored, dummy_iterations=self._typical_iterations)
        return user if matched else None


def write_user(
    path: Path,
    name: str,
    role: Role,
    password: str | None,
    *,
    iterations: int = DEFAULT_ITERATIONS,
) -> bool:
    """Add or replace ``name`` in the users file (created mode 0600 when absent), written
    atomically; ``password`` None writes ``-`` (proxy sign-in only). True when it replaced."""
    _check_name(name)
    lines: list[str] = []
    replaced = False
    if path.exists():
        text = read_setting_text(path, _MAX_USERS_FILE, "the users file")
        _parse(path, text)  # refuse to rewrite a file we cannot read as a users file
        for raw in text.splitlines():
            existing = raw.strip()
            is_user = existing and not existing.startswith("#")
            if is_user and existing.partition(":")[0].casefold() == name.casefold():
                replaced = True
                continue
            lines.append(raw)
    else:
        lines.append("# scheduled-events console users: NAME:ROLE:HASH (see console-user --help)")
    stored = NO_PASSWORD if password is None else hash_password(password, iterations=iterations)
    lines.append(f"{name}:{role.value}:{stored}")
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write("\n".join(lines) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return replaced
