"""Serve the console on a real socket (uvicorn, in the caller's event loop).

::

    async with serve_console(app, "127.0.0.1", 0) as server:
        print(f"listening on {server.url}")
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from starlette.types import ASGIApp

from schemas import ConfigError
from schemas.origin import OriginVerifier
from schemas.transport import Transport

from .._db import Database
from .._origin import Origin
from ._app import create_app
from ._auth import Authenticator
from ._service import ConsoleService, running

__all__ = [
    "ConsoleServer",
    "allowed_hosts",
    "check_host_name",
    "console_running",
    "is_loopback",
    "parse_listen",
    "serve_console",
]

log = logging.getLogger(__name__)


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8600`` for IPv6) as (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8600")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def allowed_hosts(listen: str, names: Sequence[str]) -> set[str]:
    """The host names a console listening on ``listen`` answers to: that address (on loopback,
    also ``localhost``, ``127.0.0.1`` and ``::1``) and ``names`` (its public names, as a
    reverse proxy passes them on in ``Host``)."""
    hosts = {listen, *names}
    if is_loopback(listen):
        hosts |= {"localhost", "127.0.0.1", "::1"}
    return hosts


def check_host_name(name: str) -> str:
    """``name`` when it is a host name or an IP address (``--host-name``), else ConfigError."""
    text = name.strip().rstrip(".")
    try:
        ipaddress.ip_address(text.strip("[]"))
        return text.strip("[]")
    except ValueError:
        pass
    labels = text.split(".")
    if not text or len(text) > 253 or not all(_LABEL.match(label) for label in labels):
        raise ConfigError(
            f"--host-name {name!r}: a host name (e.g. console.example.com) or an IP address, "
            "without scheme, port or path"
        )
    return text


@dataclass(frozen=True, slots=True)
class ConsoleServer:
    host: str
    port: int
    https: bool

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.https else 'http'}://{host}:{self.port}"


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the owner of the loop decides when it stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


@contextlib.asynccontextmanager
async def serve_console(
    app: ASGIApp,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    tls: tuple[Path, Path] | None = None,
    startup_timeout: float = 10.0,
) -> AsyncIterator[ConsoleServer]:
    """Serve ``app`` until the block exits; ``port`` 0 picks a free one. Behind a reverse
    proxy on loopback, ``X-Forwarded-Proto`` from 127.0.0.1 says whether the page is https."""
    sock = _bind(host, port)
    bound = int(sock.getsockname()[1])
    config = uvicorn.Config(
        app,
        lifespan="off",
        ws="none",
        log_config=None,
        access_log=False,
        proxy_headers=True,
        forwarded_allow_ips="127.0.0.1,::1",
        timeout_graceful_shutdown=1,
        ssl_certfile=None if tls is None else str(tls[0]),
        ssl_keyfile=None if tls is None else str(tls[1]),
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"console:{bound}")
    try:
        async with asyncio.timeout(startup_timeout):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError("the console's server stopped while starting")
                await asyncio.sleep(0.01)
        yield ConsoleServer(host, bound, tls is not None)
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=5)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            sock.close()


@contextlib.asynccontextmanager
async def console_running(
    transport: Transport,
    db: Database,
    auth: Authenticator,
    *,
    signing_key: Ed25519PrivateKey | None,
    host: str = "127.0.0.1",
    port: int = 0,
    tls: tuple[Path, Path] | None = None,
    group: str = "console",
    approver_group: str = "approver",
    origin: Origin | None = None,
    verifier: OriginVerifier | None = None,
    host_names: Sequence[str] = (),
) -> AsyncIterator[tuple[ConsoleService, ConsoleServer]]:
    """The console (its engine loaded and live, its page served) until the block exits.
    Behind the OIDC proxy, or when ``host_names`` are given, it answers only to those names
    and its listen address (see :func:`allowed_hosts`)."""
    service = ConsoleService(
        transport,
        db,
        signing_key=signing_key,
        group=group,
        approver_group=approver_group,
        origin=origin,
        verifier=verifier,
    )
    hosts = allowed_hosts(host, host_names) if auth.by_proxy or host_names else None
    app = create_app(service, auth, hosts=hosts)
    async with running(service), serve_console(app, host, port, tls=tls) as server:
        try:
            yield service, server
        finally:
            service.feed.close()  # open pages' streams end now, not at the server's timeout
