"""``scheduled-events console`` and ``scheduled-events console-user``.

Registered by :func:`add_console_commands` on the central CLI's subcommands; the web stack
(Starlette, uvicorn: the ``[console]`` extra) is imported only when ``console`` runs, so the
rest of the CLI works without it, and without it ``console`` says what to install and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import logging
import sys
from pathlib import Path
from typing import Any

from schemas import ConfigError, load_signing_key
from schemas.transport import redact

from .._origin import Origin
from ._users import DEFAULT_ITERATIONS, MAX_ITERATIONS, Role, UsersFile, write_user

__all__ = ["add_console_commands"]

log = logging.getLogger("consumers.console")

EXTRA_HINT = "pip install 'scheduled-events-relay[console]'"
#: How long a sign-in may last (``inf``, ``nan`` and 1e300 parse as floats: each sign-in failed).
MIN_SESSION_HOURS = 0.1
MAX_SESSION_HOURS = 720.0


def add_console_commands(commands: Any) -> None:
    """Add ``console`` and ``console-user`` to the central CLI's subparsers."""
    from .._cli import _broker_options, _db_options

    console = commands.add_parser(
        "console",
        help="the operator console: a web page of the fleet, its decisions and the audit",
        description="Serve the operator console: every open event and agent, live; approve "
        "now (signed with --signing-key, bound to the version on screen), hold an event so the "
        "approver leaves it to NotBefore, release it; search the audit. Operators sign in "
        "(--users, --token, or --trust-proxy-header behind an OIDC proxy); viewers read only. "
        "It reads a transient copy of the stream (Service Bus: the subscription --group) and "
        "the approver's database (--db). Prints 'listening on URL' first.",
    )
    _broker_options(console)
    _db_options(
        console,
        "the approver's and the audit's database (SQLite file, sqlite:///PATH or "
        "postgresql://...): the fleet at start, the decisions, the holds, the history",
    )
    console.add_argument(
        "--signing-key",
        metavar="FILE",
        help="approver.key, to sign operators' approvals (without it the console cannot "
        "approve; hold and release still work)",
    )
    console.add_argument(
        "--listen",
        default="127.0.0.1:8600",
        metavar="HOST:PORT",
        help="where to serve the page (default 127.0.0.1:8600; port 0 picks one)",
    )
    console.add_argument(
        "--users",
        metavar="FILE",
        help="the users file: NAME:ROLE:HASH lines (see console-user); read again when it changes",
    )
    console.add_argument(
        "--token",
        metavar="TOKEN",
        help="a shared operator token for the sign-in form (the audit records the name given "
        "with it as 'NAME (shared token)')",
    )
    console.add_argument("--token-file", metavar="FILE", help="read the token from FILE")
    console.add_argument(
        "--trust-proxy-header",
        metavar="HEADER",
        help="take the user's name from HEADER (e.g. X-Forwarded-User), set by an OIDC "
        "reverse proxy such as oauth2-proxy; only with a loopback --listen (anyone reaching "
        "the port directly could set it); roles from --users, others are viewers",
    )
    console.add_argument(
        "--host-name",
        action="append",
        default=[],
        metavar="NAME",
        help="a name this console is reached by, as the reverse proxy passes it on in the Host "
        "header (e.g. console.example.com; repeat for more). With --trust-proxy-header the "
        "console answers only to these and its --listen address (a request naming another "
        "host, e.g. by DNS rebinding, gets a 400); without it, giving any turns the same "
        "check on",
    )
    console.add_argument(
        "--session-key-file",
        metavar="FILE",
        help="the key sessions are signed with (at least 32 characters), so sessions survive "
        "a restart and several consoles share them (default: a new random key at each start)",
    )
    console.add_argument(
        "--session-hours",
        type=float,
        default=12.0,
        metavar="HOURS",
        help="how long a sign-in lasts, from 0.1 to 720 (default 12)",
    )
    console.add_argument("--tls-cert", metavar="FILE", help="serve https with this certificate")
    console.add_argument("--tls-key", metavar="FILE", help="... and this key")
    console.add_argument(
        "--group",
        default="console",
        metavar="NAME",
        help="names the transient copy of the stream (Service Bus: the subscription to read; "
        "default console)",
    )
    console.add_argument(
        "--approver-group",
        default="approver",
        metavar="NAME",
        help="the approver group whose state and holds to use (default approver)",
    )
    console.add_argument(
        "--origin",
        choices=[origin.value for origin in Origin],
        help="who may speak for a VM, as for the approver (default vm-user on RabbitMQ, "
        "signed on Service Bus, any on memory://); a message that fails is not shown",
    )
    console.add_argument(
        "--attestation-ca",
        action="append",
        metavar="FILE",
        help="with --origin signed: the CA certificate(s) Azure's attested data chains to",
    )
    console.add_argument(
        "--vm-inventory",
        metavar="FILE",
        help="with --origin signed: 'name,vmId' lines deciding which vmId each VM name has",
    )
    console.set_defaults(run=_console)

    user = commands.add_parser(
        "console-user",
        help="add or replace a user of the console in its users file",
        description="Add NAME to FILE (created mode 0600) with ROLE, or replace their line. "
        "The password is read from standard input (its first line) or asked twice on a "
        "terminal, and stored as PBKDF2-HMAC-SHA256 (Django's pbkdf2_sha256$ITERATIONS$SALT$"
        "HASH). Lines are NAME:ROLE:HASH; a hash '-' (--no-password) signs in only through "
        "--trust-proxy-header.",
    )
    user.add_argument("file", metavar="FILE")
    user.add_argument("name", metavar="NAME")
    user.add_argument(
        "--role",
        choices=[role.value for role in Role],
        default=Role.VIEWER.value,
        help="operator (approve, hold, release) or viewer (read only; the default)",
    )
    user.add_argument(
        "--no-password",
        action="store_true",
        help="no password: the user signs in through the OIDC proxy only",
    )
    user.add_argument(
        "--iterations",
        type=int,
        default=DEFAULT_ITERATIONS,
        help=f"PBKDF2 iterations, at most {MAX_ITERATIONS:,} (default {DEFAULT_ITERATIONS:,})",
    )
    user.set_defaults(run=_console_user)


def _require_web_stack() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"the console needs the [console] extra ({exc.name} is missing): {EXTRA_HINT}"
        ) from exc


async def _console(args: argparse.Namespace) -> int:
    _require_web_stack()
    from .._cli import (
        _broker,
        _db,
        _open_transport,
        _origin_and_verifier,
        _secret,
        _until_signalled,
    )
    from .._db import open_database
    from .._schema import ensure_schema
    from ._auth import Authenticator
    from ._server import check_host_name, console_running, is_loopback, parse_listen
    from ._sessions import SessionCodec, load_session_key

    host, port = parse_listen(args.listen)
    token = _secret(args.token, args.token_file, "token")
    users = UsersFile(Path(args.users)) if args.users else None
    if args.trust_proxy_header:
        if not is_loopback(host):
            raise ConfigError(
                f"--trust-proxy-header: listen on loopback only (--listen 127.0.0.1:{port}), "
                f"behind the proxy: anyone who reaches {host}:{port} directly could send "
                f"{args.trust_proxy_header} with any name"
            )
        if token:
            raise ConfigError("--trust-proxy-header: the proxy signs people in; drop --token")
    elif users is None and not token:
        raise ConfigError(
            "the console needs a way to sign in: --users FILE (see `scheduled-events "
            "console-user`), --token/--token-file, or --trust-proxy-header behind an OIDC proxy"
        )
    host_names = [check_host_name(name) for name in args.host_name]
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("give both --tls-cert and --tls-key, or neither")
    tls = (Path(args.tls_cert), Path(args.tls_key)) if args.tls_cert else None
    if not MIN_SESSION_HOURS <= args.session_hours <= MAX_SESSION_HOURS:  # nan: False too
        raise ConfigError(
            f"--session-hours {args.session_hours:g}: a number of hours from "
            f"{MIN_SESSION_HOURS:g} (6 minutes) to {MAX_SESSION_HOURS:g} (30 days)"
        )
    key = load_signing_key(Path(args.signing_key)) if args.signing_key else None
    url = _broker(args)
    db_url = _db(args)
    if not db_url:
        raise ConfigError(
            "the console needs the approver's database: give --db URL (or --db-file FILE)"
        )
    codec = SessionCodec(
        load_session_key(Path(args.session_key_file) if args.session_key_file else None),
        lifetime=args.session_hours * 3600,
    )
    auth = Authenticator(codec, users=users, token=token, proxy_header=args.trust_proxy_header)
    origin, verifier = _origin_and_verifier(args, url)
    if not is_loopback(host) and tls is None:
        log.warning(
            "console: plain http on %s: passwords and session cookies cross the network in the "
            "clear; give --tls-cert/--tls-key or put an https reverse proxy in front",
            host,
        )
    if key is None:
        log.warning("console: no --signing-key: operators can hold and release, not approve")
    async with _open_transport(args, "console") as transport, open_database(db_url) as db:
        await ensure_schema(db)
        async with console_running(
            transport,
            db,
            auth,
            signing_key=key,
            host=host,
            port=port,
            tls=tls,
            group=args.group,
            approver_group=args.approver_group,
            origin=origin,
            verifier=verifier,
            host_names=host_names,
        ) as (_, server):
            print(f"listening on {server.url}", flush=True)
            log.info(
                "console on %s: broker %s, database %s, sign-in by %s",
                server.url,
                redact(url),
                db.display,
                ", ".join(
                    what
                    for what, given in (
                        ("users file", users is not None),
                        ("token", bool(token)),
                        (f"proxy header {args.trust_proxy_header}", args.trust_proxy_header),
                    )
                    if given
                ),
            )
            if args.trust_proxy_header or host_names:
                log.info(
                    "console: answers only to the host names %s (give others with --host-name)",
                    ", ".join(sorted({host, *host_names})),
                )
            stop = asyncio.Event()

            async def until_stopped() -> None:
                await stop.wait()

            await _until_signalled(until_stopped(), stop.set)
    return 0


def _read_password() -> str:
    if sys.stdin.isatty():
        first = getpass.getpass("password: ")
        if getpass.getpass("again: ") != first:
            raise ConfigError("console-user: the two passwords differ")
        password = first
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    if len(password) < 8:
        raise ConfigError("console-user: the password needs at least 8 characters")
    return password


async def _console_user(args: argparse.Namespace) -> int:
    role = Role(args.role)
    if not 1 <= args.iterations <= MAX_ITERATIONS:
        raise ConfigError(
            f"console-user: --iterations {args.iterations}: from 1 to {MAX_ITERATIONS:,} "
            f"(default {DEFAULT_ITERATIONS:,})"
        )
    if args.iterations < 100_000:
        log.warning(
            "console-user: %d PBKDF2 iterations is weak (default %d)",
            args.iterations,
            DEFAULT_ITERATIONS,
        )
    password = None if args.no_password else _read_password()
    try:
        replaced = write_user(
            Path(args.file), args.name, role, password, iterations=args.iterations
        )
    except OSError as exc:
        raise ConfigError(f"console-user: cannot write {args.file}: {exc.strerror or exc}") from exc
    how = "no password: through the proxy only" if password is None else "password set"
    print(f"{'replaced' if replaced else 'added'} {args.name} ({role.value}, {how}) in {args.file}")
    return 0
