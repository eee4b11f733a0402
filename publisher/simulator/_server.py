"""Run the simulator on a real socket, in the caller's event loop.

::

    async with serve(Simulator(vms=["vm0", "vm1"])) as server:
        url = server.vm_url("vm1") + "/metadata/scheduledevents?api-version=2020-07-01"
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import uvicorn

from ._app import create_app
from ._simulator import Simulator

__all__ = ["DEFAULT_KEEP_ALIVE_SECONDS", "SimulatorServer", "serve"]

log = logging.getLogger(__name__)

#: How long an idle connection is kept by default (uvicorn's own default).
DEFAULT_KEEP_ALIVE_SECONDS = 5


@dataclass(frozen=True, slots=True)
class SimulatorServer:
    """A running simulator: where to reach it."""

    simulator: Simulator
    host: str
    port: int

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:54321``: IMDS for the first VM, and ``/admin``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def vm_url(self, name: str) -> str:
        """``{base_url}/vm/{name}``: append ``/metadata/scheduledevents?api-version=...``."""
        return f"{self.base_url}/vm/{name}"


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers (the owner of the loop decides when to stop), and
    that notices :meth:`stop` at once rather than at its next 0.1 s tick."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self.should_exit = True
        self._stopping.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864_000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=0.1)
            should_exit = await self.on_tick(counter)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted sockets only then, and without it
    # every response waits ~40 ms for Nagle and delayed ACKs.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.asynccontextmanager
async def serve(
    simulator: Simulator,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    startup_timeout: float = 10.0,
    shutdown_timeout: float = 5.0,
    keep_alive_seconds: int = DEFAULT_KEEP_ALIVE_SECONDS,
) -> AsyncIterator[SimulatorServer]:
    """Serve ``simulator`` over HTTP (uvicorn, as a task in this loop) until the block exits.

    ``port`` 0 picks a free port; the yielded :class:`SimulatorServer` tells which. Raises
    OSError when the address cannot be bound, TimeoutError when the server does not start in
    ``startup_timeout`` seconds. On exit, open connections get ``shutdown_timeout`` seconds.
    ``keep_alive_seconds``: how long a connection may stay idle between two requests before
    the server closes it (uvicorn's 5 s by default; Azure does not document its IMDS's). A
    client polling less often than that opens a connection for every request: with many
    slow-polling VMs on one machine, set it above their poll interval.
    """
    if keep_alive_seconds < 1:
        raise ValueError(f"keep_alive_seconds must be at least 1, not {keep_alive_seconds}")
    sock = _bind(host, port)
    bound_port = int(sock.getsockname()[1])
    app = create_app(simulator)
    config = uvicorn.Config(
        app,
        lifespan="off",
        ws="none",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=max(1, round(shutdown_timeout)),
        timeout_keep_alive=keep_alive_seconds,
        backlog=2048,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"imds-simulator:{bound_port}")
    try:
        async with asyncio.timeout(startup_timeout):
            while not server.started:
                if task.done():
                    task.result()  # raises what stopped it
                    raise RuntimeError("the simulator's server stopped while starting")
                await asyncio.sleep(0.005)
        log.info("simulator listening on %s:%d", host, bound_port)
        yield SimulatorServer(simulator, host, bound_port)
    finally:
        app.state.imds.stopping.set()  # what a fault holds is answered now, not cancelled
        server.stop()
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=shutdown_timeout + 1)
        except TimeoutError:
            log.warning("simulator server did not stop in %.1f s: cancelling it", shutdown_timeout)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            sock.close()
