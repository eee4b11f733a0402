"""The console's web application (Starlette): the page, its live feed, its API.

================================  ==========================================================
``GET  /login``, ``POST /login``  the sign-in page (the only thing an anonymous client gets)
``POST /logout``                  sign out
``GET  /``                        the page (``static/index.html``, ``console.js``, ``.css``)
``GET  /api/me``                  who is signed in, the role, the CSRF token
``GET  /api/stream``              server-sent events: a snapshot, then batches of changed rows
``POST /api/events/ID/approve``   ``{"version": V, "reason": R}`` (operators)
``POST /api/events/ID/hold``      ``{"reason": R}`` (operators)
``POST /api/events/ID/release``   ``{"reason": R}`` (operators)
``GET  /api/events/ID/timeline``  the event's timeline, as ``audit history`` prints it
``GET  /api/history?...``         the audit searched by ``event_id``, ``vm``, ``type``,
                                  ``since``, ``until`` (UTC), ``limit``
================================  ==========================================================

:class:`_Guard` sits in front of every route: behind the OIDC proxy (or given ``--host-name``)
a ``Host`` that is not one of the console's names gets a 400 and nothing else; no session, no
response but a redirect to the sign-in page (or 401); every POST carries the session's CSRF
token and, when the browser sends one, an ``Origin`` of this very site; every response carries
a strict Content-Security-Policy.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import html
import json
import logging
import re
import time
from collections.abc import Collection
from datetime import UTC, datetime
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request, cookie_parser
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._timeline import entry_line
from ._auth import Authenticator, SignInBusy
from ._service import ActionRefused, ConsoleService
from ._sessions import Session, same_token
from ._users import is_plain_text

__all__ = ["create_app", "host_name"]

log = logging.getLogger("consumers.console")

SESSION_COOKIE = "se_console"
SECURE_SESSION_COOKIE = "__Host-se_console"
FORM_COOKIE = "se_console_signin"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
_EVENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$")
_MAX_BODY = 16 * 1024
_SAFE = frozenset({"GET", "HEAD"})


def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


class _Assets:
    """The page's files, read once."""

    def __init__(self) -> None:
        self.index = _static("index.html")
        self.js = _static("console.js")
        self.css = _static("console.css")
        self.login = _static("login.html").decode()
        style = re.search(r"<style>(.*?)</style>", self.login, re.S)
        digest = hashlib.sha256((style.group(1) if style else "").encode()).digest()
        self.login_csp = CSP.replace(
            "style-src 'self'", f"style-src 'sha256-{base64.b64encode(digest).decode()}'"
        )


def _cookie(name: str, value: str, *, secure: bool, max_age: int, path: str = "/") -> str:
    parts = [f"{name}={value}", f"Path={path}", "HttpOnly", "SameSite=Strict", f"Max-Age={max_age}"]
    if secure:
        parts.append("Secure")
    return "; ".join(parts)


def _cookies(headers: Headers) -> dict[str, str]:
    """The request's cookies, read as browsers write them. Other applications on this host name
    (cookies ignore ports) or a parent domain set cookies too, and ``SimpleCookie`` drops every
    cookie after one it finds malformed (JSON, a space, a stray quote): the session with them."""
    return cookie_parser("; ".join(headers.getlist("cookie")))


def host_name(value: str | None) -> str:
    """The name in a ``Host`` header (or a ``--host-name``), as compared: lower case, without
    port, brackets or final dot (``[::1]:8600`` is ``::1``); empty when there is none."""
    text = (value or "").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else ""
    name, colon, port = text.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        text = name
    return text.rstrip(".")


def _same_origin(headers: Headers, scheme: str) -> bool:
    """The browser's ``Origin`` (when it sends one) is this site."""
    origin = headers.get("origin")
    if origin is None:
        fetch_site = headers.get("sec-fetch-site")
        return fetch_site in (None, "same-origin", "none")
    return origin == f"{scheme}://{headers.get('host', '')}"


class _Guard:
    """The host name, authentication, CSRF and security headers in front of the whole
    application. ``hosts``: the names the console answers to (None: any)."""

    def __init__(self, app: ASGIApp, auth: Authenticator, hosts: frozenset[str] | None) -> None:
        self.app = app
        self.auth = auth
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.hosts is not None:
            # Before anything else: a page whose DNS name was rebound to this address is
            # "same origin" with itself, and could set the proxy's header on its requests.
            name = host_name(headers.get("host"))
            if name not in self.hosts:
                log.warning(
                    "refused %s %r from %s: the Host %r is not a name of this console (if it "
                    "is, start the console with --host-name %s)",
                    scope["method"],
                    scope["path"],
                    _client(scope),
                    headers.get("host", ""),
                    name or "NAME",
                )
                await _error(
                    400,
                    f"this console does not answer to the name {name!r} (the Host header); "
                    f"if it is its name, start the console with --host-name {name or 'NAME'}",
                )(scope, receive, send)
                return
        secure = scope.get("scheme") == "https"
        # Over https only the __Host- cookie counts: a plain one may have been planted by a
        # sibling subdomain or over plain http, and would sign this browser in as its maker.
        cookie = _cookies(headers).get(SECURE_SESSION_COOKIE if secure else SESSION_COOKIE)
        proxy_user = headers.get(self.auth.proxy_header) if self.auth.proxy_header else None
        current = self.auth.current(cookie, proxy_user)
        session = current.session
        state = scope.setdefault("state", {})
        state["session"] = session
        state["credentials"] = (cookie, proxy_user)  # to check the session again later
        extra: list[str] = []
        if current.set_cookie is not None and session is not None:
            name = SECURE_SESSION_COOKIE if secure else SESSION_COOKIE
            lifetime = max(1, int(session.expires - time.time()))
            extra.append(_cookie(name, current.set_cookie, secure=secure, max_age=lifetime))
            log.info(
                "sign-in: %s (%s) through the proxy from %s",
                session.user,
                session.role.value,
                _client(scope),
            )

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                out = MutableHeaders(scope=message)
                if "content-security-policy" not in out:
                    out["Content-Security-Policy"] = CSP
                out["X-Content-Type-Options"] = "nosniff"
                out["X-Frame-Options"] = "DENY"
                out["Referrer-Policy"] = "same-origin"  # "no-referrer" would make Origin "null"
                out["Cross-Origin-Opener-Policy"] = "same-origin"
                if "cache-control" not in out:
                    out["Cache-Control"] = "no-store"
                if secure:
                    out["Strict-Transport-Security"] = "max-age=31536000"
                for value in extra:
                    out.append("Set-Cookie", value)
            await send(message)

        path: str = scope["path"]
        method: str = scope["method"]
        if path == "/login":
            await self.app(scope, receive, send_with_headers)
            return
        if session is None:
            await self._refuse(scope, headers, receive, send_with_headers)
            return
        if method not in _SAFE:
            if not _same_origin(headers, scope.get("scheme", "http")):
                log.warning(
                    "refused %s %r by %s: another site's request", method, path, session.user
                )
                await _error(403, "refused: this request comes from another site")(
                    scope, receive, send_with_headers
                )
                return
            if not same_token(headers.get("x-csrf-token"), session.csrf):
                log.warning("refused %s %r by %s: no valid CSRF token", method, path, session.user)
                await _error(403, "refused: the request has no valid CSRF token; reload the page")(
                    scope, receive, send_with_headers
                )
                return
        await self.app(scope, receive, send_with_headers)

    async def _refuse(self, scope: Scope, headers: Headers, receive: Receive, send: Send) -> None:
        if self.auth.by_proxy:
            header = self.auth.proxy_header
            response: Response = _error(
                401, f"sign in through the proxy: it did not say who you are ({header})"
            )
        elif scope["method"] in _SAFE and "text/html" in headers.get("accept", ""):
            response = RedirectResponse("/login", status_code=303)
        else:
            response = _error(401, "sign in first")
        await response(scope, receive, send)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _retry_later(response: Response, seconds: float) -> Response:
    response.headers["Retry-After"] = str(max(1, int(seconds) + 1))
    return response


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "?"


def _session(request: Request) -> Session:
    session: Session | None = request.state.session
    assert session is not None  # the guard let only signed-in requests through
    return session


async def _body(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > _MAX_BODY):
        raise ActionRefused(413, "the request body is too large")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > _MAX_BODY:
            raise ActionRefused(413, "the request body is too large")
    return body


async def _json(request: Request) -> dict[str, Any]:
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise ActionRefused(415, "send JSON (Content-Type: application/json)")
    try:
        data = json.loads(await _body(request) or b"{}")
    except ValueError as exc:
        raise ActionRefused(400, f"the body is not JSON: {exc}") from exc
    except RecursionError:  # 16 KiB hold 8,000 nested arrays: the parser runs out of stack
        raise ActionRefused(400, "the body is nested too deeply") from None
    if not isinstance(data, dict):
        raise ActionRefused(400, "the body must be a JSON object")
    return data


def _text(data: dict[str, Any], key: str, *, limit: int = 500) -> str:
    value = data.get(key, "")
    if not isinstance(value, str):
        raise ActionRefused(400, f"{key} must be a string")
    if len(value) > limit:
        raise ActionRefused(400, f"{key} is longer than {limit} characters")
    if not is_plain_text(value):  # logged, and stored: no line break, no lone surrogate
        raise ActionRefused(
            400, f"{key} holds a control character, a line break or a lone surrogate"
        )
    return value


def _time(value: str | None, name: str) -> datetime | None:
    """A search bound in UTC (a time without an offset is UTC, as the page sends it)."""
    if not value:
        return None
    try:
        moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError as exc:
        raise ActionRefused(400, f"{name}: not a date and time ({value!r})") from exc
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    try:  # 0001-01-01T00:00+01:00 is a valid time whose UTC is before year 1
        return moment.astimezone(UTC)
    except OverflowError:
        raise ActionRefused(
            400, f"{name}: {value!r} is outside the years 1 to 9999 in UTC"
        ) from None


def _term(value: str | None, name: str) -> str | None:
    """A search term: at most 200 characters of text (the database refuses a NUL)."""
    term = (value or "").strip()
    if len(term) > 200:
        raise ActionRefused(400, f"{name}: longer than 200 characters")
    if not is_plain_text(term):
        raise ActionRefused(400, f"{name}: holds a control character")
    return term or None


def create_app(
    console: ConsoleService, auth: Authenticator, *, hosts: Collection[str] | None = None
) -> ASGIApp:
    """The application: see the module docstring. ``hosts``: the only names it answers to
    (see :func:`host_name`; None: any)."""
    assets = _Assets()

    def login_page(request: Request, *, error: str = "", status: int = 200) -> Response:
        token = auth.codec.form_token()
        secret_label = (
            "Password or token"
            if auth.users and auth.accepts_token
            else ("Token" if auth.accepts_token and not auth.users else "Password")
        )
        page = (
            assets.login.replace("{{csrf}}", html.escape(token))
            .replace("{{secret_label}}", html.escape(secret_label))
            .replace("{{error}}", html.escape(error))
            .replace("{{error_hidden}}", "" if error else "hidden")
        )
        response = HTMLResponse(page, status_code=status)
        response.headers["Content-Security-Policy"] = assets.login_csp
        response.headers.append(
            "Set-Cookie",
            _cookie(
                FORM_COOKIE,
                token,
                secure=request.url.scheme == "https",
                max_age=900,
                path="/login",
            ),
        )
        return response

    async def login(request: Request) -> Response:
        if request.state.session is not None:
            return RedirectResponse("/", status_code=303)
        if auth.by_proxy:
            return _error(401, f"sign in through the proxy ({auth.proxy_header} missing)")
        if request.method == "GET":
            return login_page(request)
        client = _client(request.scope)
        if not _same_origin(request.headers, request.url.scheme):
            return login_page(
                request, error="Refused: the form came from another site.", status=403
            )
        try:
            form = parse_qs((await _body(request)).decode("utf-8", "replace"))
        except ActionRefused as exc:
            return login_page(request, error=exc.message, status=exc.status)
        name = (form.get("name") or [""])[0].strip()
        secret = (form.get("password") or [""])[0]
        if not same_token((form.get("csrf") or [""])[0], request.cookies.get(FORM_COOKIE, "")):
            return login_page(
                request, error="The sign-in form expired: please try again.", status=400
            )
        wait = auth.brake.retry_after(client, name)
        if wait > 0:
            log.warning("sign-in of %r from %s refused: too many failures", name, client)
            return _retry_later(
                login_page(
                    request,
                    error=f"Too many failed sign-ins: try again in {int(wait) + 1} s.",
                    status=429,
                ),
                wait,
            )
        # Counted before the password is checked (a success takes it back): guesses sent at
        # once are braked like guesses sent one after the other.
        delay = auth.brake.delay(name)
        attempt = auth.brake.attempt(client, name)
        if delay > 0:
            log.warning(
                "sign-in of %r from %s held %.0f s before its check: that name failed to sign "
                "in too often lately (from anywhere)",
                name,
                client,
                delay,
            )
            await asyncio.sleep(delay)
        try:
            signed = await auth.sign_in(name, secret)
        except SignInBusy:
            auth.brake.withdraw(attempt)
            log.warning(
                "sign-in of %r from %s refused: %d passwords are being checked already; "
                "it may try again in a few seconds",
                name,
                client,
                auth.max_checks,
            )
            return _retry_later(
                login_page(
                    request,
                    error="Too many sign-ins at once: try again in a few seconds.",
                    status=503,
                ),
                2,
            )
        if signed is None:
            log.warning("sign-in refused: %r from %s (wrong name or password)", name, client)
            return login_page(request, error="Wrong name or password.", status=401)
        auth.brake.succeeded(attempt)
        session, value = signed
        log.info(
            "sign-in: %s (%s, by %s) from %s", session.user, session.role.value, session.via, client
        )
        secure = request.url.scheme == "https"
        response = RedirectResponse("/", status_code=303)
        response.headers.append(
            "Set-Cookie",
            _cookie(
                SECURE_SESSION_COOKIE if secure else SESSION_COOKIE,
                value,
                secure=secure,
                max_age=int(auth.codec.lifetime),
            ),
        )
        response.headers.append(
            "Set-Cookie", _cookie(FORM_COOKIE, "", secure=secure, max_age=0, path="/login")
        )
        return response

    async def logout(request: Request) -> Response:
        session = _session(request)
        auth.sign_out(session)
        log.info("sign-out: %s from %s", session.user, _client(request.scope))
        secure = request.url.scheme == "https"
        response = JSONResponse({"location": "/login"})
        name = SECURE_SESSION_COOKIE if secure else SESSION_COOKIE
        response.headers.append("Set-Cookie", _cookie(name, "", secure=secure, max_age=0))
        return response

    def asset(body: bytes, media_type: str) -> Response:
        return Response(body, media_type=media_type, headers={"Cache-Control": "no-cache"})

    async def index(request: Request) -> Response:
        return asset(assets.index, "text/html; charset=utf-8")

    async def script(request: Request) -> Response:
        return asset(assets.js, "text/javascript; charset=utf-8")

    async def style(request: Request) -> Response:
        return asset(assets.css, "text/css; charset=utf-8")

    async def favicon(request: Request) -> Response:
        return Response(status_code=204)

    async def me(request: Request) -> Response:
        session = _session(request)
        return JSONResponse(
            {
                "user": session.user,
                "operator_name": session.operator_name,
                "role": session.role.value,
                "via": session.via,
                "csrf": session.csrf,
                "may_act": session.role.may_act,
                "can_approve": session.role.may_act and console.can_approve,
                "liveness": console.feed.liveness,
                "expires": datetime.fromtimestamp(session.expires, UTC).isoformat(),
            }
        )

    async def stream(request: Request) -> Response:
        session = _session(request)
        cookie, proxy_user = request.state.credentials
        loop = asyncio.get_running_loop()
        until = loop.time() + max(0.0, session.expires - time.time())

        def holds() -> bool:  # signed out elsewhere, removed, a new password: the stream ends
            return auth.still_holds(session, cookie, proxy_user)

        return StreamingResponse(
            console.feed.stream(until=until, holds=holds),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    async def act(request: Request) -> Response:
        session = _session(request)
        event_id = request.path_params["event_id"]
        action = request.path_params["action"]
        if action not in ("approve", "hold", "release"):
            return _error(404, f"no action {action!r}: approve, hold or release")
        try:
            if not _EVENT_ID.match(event_id):
                raise ActionRefused(400, f"{event_id!r} is not an event id")
            if not session.role.may_act:
                log.warning(
                    "refused %s of %s by %s: role %s",
                    action,
                    event_id,
                    session.user,
                    session.role.value,
                )
                raise ActionRefused(403, f"your role ({session.role.value}) may not {action}")
            data = await _json(request)
            reason = _text(data, "reason")
            if action == "approve":
                version = _text(data, "version", limit=64)
                if not version:
                    raise ActionRefused(400, "give the version of the event you saw")
                vm = _text(data, "vm", limit=200) or None
                result = await console.approve(
                    session, event_id, version=version, reason=reason, vm=vm
                )
            elif action == "hold":
                result = await console.hold(session, event_id, reason=reason)
            else:
                result = await console.release(session, event_id, reason=reason)
        except ActionRefused as exc:
            return _error(exc.status, exc.message)
        return JSONResponse(
            {"message": result.message, "approval_id": result.approval_id, "target": result.target}
        )

    async def timeline(request: Request) -> Response:
        event_id = request.path_params["event_id"]
        if not _EVENT_ID.match(event_id):
            return _error(400, f"{event_id!r} is not an event id")
        entries = await console.timeline(event_id)
        header = (
            f"timeline of event {event_id} ({len(entries)} entries, UTC):"
            if entries
            else f"nothing recorded for event {event_id}"
        )
        return JSONResponse(
            {"event_id": event_id, "header": header, "lines": [entry_line(e) for e in entries]}
        )

    async def history(request: Request) -> Response:
        query = request.query_params
        try:
            limit = int(query.get("limit") or 500)
            event_id = (query.get("event_id") or "").strip() or None
            if event_id is not None and not _EVENT_ID.match(event_id):
                raise ActionRefused(400, f"{event_id!r} is not an event id")
            entries = await console.search(
                vm=_term(query.get("vm"), "vm"),
                event_id=event_id,
                event_type=_term(query.get("type"), "type"),
                since=_time(query.get("since"), "since"),
                until=_time(query.get("until"), "until"),
                limit=max(1, min(limit, 5000)),
            )
        except ValueError:
            return _error(400, "limit must be a number")
        except ActionRefused as exc:
            return _error(exc.status, exc.message)
        return JSONResponse(
            {
                "count": len(entries),
                "limit": limit,
                "entries": [
                    {
                        "line": entry_line(entry),
                        "event_id": entry.event_id,
                        "kind": entry.kind,
                        "time": entry.time.isoformat(),
                        "vm": entry.vm,
                    }
                    for entry in entries
                ],
            }
        )

    app = Starlette(
        routes=[
            Route("/login", login, methods=["GET", "POST"]),
            Route("/logout", logout, methods=["POST"]),
            Route("/", index),
            Route("/static/console.js", script),
            Route("/static/console.css", style),
            Route("/favicon.ico", favicon),
            Route("/api/me", me),
            Route("/api/stream", stream),
            Route("/api/history", history),
            Route("/api/events/{event_id}/timeline", timeline),
            Route(
                "/api/events/{event_id}/{action:str}",
                act,
                methods=["POST"],
            ),
        ]
    )
    allowed = None if hosts is None else frozenset(host_name(h) for h in hosts)
    return _Guard(app, auth, allowed)
