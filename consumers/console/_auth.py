"""Who is asking: a session from the sign-in form (users file or shared token), or the name a
trusted OIDC proxy put in a header.

Three ways in, any of which may be configured:

- ``--users FILE``: names, roles and PBKDF2 hashes (:mod:`._users`); the sign-in form checks
  them. Each operator signs as themselves: the audit names them.
- ``--token``/``--token-file``: one shared operator secret. The form asks for a name too, but
  a shared secret cannot vouch for it: the audit records ``NAME (shared token)``.
- ``--trust-proxy-header X-Forwarded-User``: an OIDC reverse proxy (oauth2-proxy) signs people
  in and passes the name in that header; the console then listens on loopback only, since
  anybody who could reach it directly could write the header, and answers only to its own
  host names (``--host-name``: a page DNS-rebound to loopback could write it too). The role
  comes from the users file (a ``-`` hash: no password), else ``viewer``.

Sessions are checked against what is configured now at every request (and at every batch of
the live stream): removed from the users file, given a new password there, or the file no
longer readable, a password session ends. Sign-ins are braked (:class:`SignInBrake`), and at
most ``MAX_CHECKS`` passwords are checked at once.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass

from ._sessions import Session, SessionCodec, SignInBrake
from ._users import Role, User, UsersFile, is_plain_text

__all__ = ["Authenticator", "SignInBusy"]

#: Password checks (PBKDF2, a thread each) at once; beyond that a sign-in is told to come back.
MAX_CHECKS = 8


class SignInBusy(Exception):
    """As many passwords are being checked as may be at once: try again shortly."""


@dataclass(frozen=True, slots=True)
class Current:
    """The session of a request, and the cookie to set when one was made for it."""

    session: Session | None
    set_cookie: str | None = None


class Authenticator:
    """Checks sign-ins and sessions (see the module docstring)."""

    def __init__(
        self,
        codec: SessionCodec,
        *,
        users: UsersFile | None = None,
        token: str | None = None,
        proxy_header: str | None = None,
        brake: SignInBrake | None = None,
    ) -> None:
        self.codec = codec
        self.users = users
        self.token = token
        self.proxy_header = proxy_header.lower() if proxy_header else None
        self.brake = brake or SignInBrake()
        self.max_checks = MAX_CHECKS
        self._checking = 0

    @property
    def by_proxy(self) -> bool:
        return self.proxy_header is not None

    @property
    def accepts_token(self) -> bool:
        return self.token is not None

    async def sign_in(self, name: str, secret: str) -> tuple[Session, str] | None:
        """A new session and its cookie value when ``secret`` is the user's password (or the
        shared token). :class:`SignInBusy` when ``max_checks`` passwords are being checked
        already: each is a thread's worth of PBKDF2, and guesses sent at once must not queue
        threads without bound."""
        name = name.strip()
        if not name or not secret or len(name) > 200 or len(secret) > 1024:
            return None
        if not is_plain_text(name):  # the name is logged, and recorded in the audit
            return None
        if self.users is not None:
            found = self.users.get(name)  # here, not in the thread: it may read the file again
            user = await self._check(found, secret)
            if user is not None:
                return self.codec.issue(
                    user.name, user.role, "password", bound_to=user.password_hash
                )
        if self.token is not None and hmac.compare_digest(secret.encode(), self.token.encode()):
            return self.codec.issue(name, Role.OPERATOR, "token")
        return None

    async def _check(self, user: User | None, secret: str) -> User | None:
        assert self.users is not None
        if self._checking >= self.max_checks:
            raise SignInBusy
        self._checking += 1
        check = asyncio.get_running_loop().run_in_executor(None, self.users.verify, user, secret)
        # Counted until the thread is done, even when the request is given up first.
        check.add_done_callback(self._checked)
        return await asyncio.shield(check)

    def _checked(self, _: object) -> None:
        self._checking -= 1

    def current(self, cookie: str | None, proxy_user: str | None) -> Current:
        """The request's session, checked against what is configured now (a user removed from
        the users file, or given a new password there, is signed out; a role changed there
        applies at once)."""
        session = self.codec.read(cookie)
        if self.by_proxy:
            who = (proxy_user or "").strip()
            if not who or len(who) > 200 or not is_plain_text(who):
                return Current(None)
            role = self._role_of(who)
            if session is not None and session.via == "proxy" and session.user == who:
                return Current(_with_role(session, role))
            fresh, value = self.codec.issue(who, role, "proxy")
            return Current(fresh, value)
        if session is None:
            return Current(None)
        if session.via == "password":
            user = None if self.users is None else self.users.get(session.user)
            if user is None or not self.codec.bound(session, user.password_hash):
                return Current(None)  # removed, or a new password since this sign-in
            return Current(_with_role(session, user.role))
        if session.via == "token" and self.token is not None:
            return Current(session)
        return Current(None)

    def still_holds(self, session: Session, cookie: str | None, proxy_user: str | None) -> bool:
        """Whether ``session``, made for a request with ``cookie`` and ``proxy_user``, still
        holds: not signed out or expired, and what is configured now (the users file, the
        proxy's header) still lets the same person in the same way. For what outlives its
        request: the live stream (which both roles may read: a new role does not end it)."""
        if session.expires < time.time() or self.codec.signed_out(session):
            return False
        now = self.current(cookie, proxy_user).session
        return now is not None and (now.user, now.via) == (session.user, session.via)

    def _role_of(self, name: str) -> Role:
        user = None if self.users is None else self.users.get(name)
        return Role.VIEWER if user is None else user.role

    def sign_out(self, session: Session) -> None:
        self.codec.revoke(session)


def _with_role(session: Session, role: Role) -> Session:
    if session.role is role:
        return session
    return Session(
        user=session.user,
        role=role,
        via=session.via,
        csrf=session.csrf,
        nonce=session.nonce,
        expires=session.expires,
        issued=session.issued,
        binding=session.binding,
    )
