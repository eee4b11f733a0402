"""A TCP proxy a test puts between a client and a server, to cut the link and restore it.

::

    async with TcpProxy("127.0.0.1", 5672) as proxy:
        url = f"amqp://guest:guest@127.0.0.1:{proxy.port}/"
        ...
        await proxy.cut()      # open connections are reset, new ones refused
        await proxy.restore()  # the same port accepts again
        proxy.pause()          # bytes are held, both ways: a silent, stalled link
        proxy.resume()

While cut, the listening socket is closed, so a client sees "connection refused", as when a
broker host is down; the existing connections are aborted (RST), as when a link dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType
from typing import Any, Self

__all__ = ["TcpProxy"]

log = logging.getLogger(__name__)

_CHUNK = 65536


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target_host:target_port`` until cut."""

    def __init__(self, target_host: str, target_port: int, *, host: str = "127.0.0.1") -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.host = host
        self.port = 0
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()

    @property
    def is_up(self) -> bool:
        return self._server is not None

    async def __aenter__(self) -> Self:
        await self._listen()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.cut()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        """Refuse new connections and reset the open ones."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        tasks = list(self._tasks)
        if tasks:
            # Their links reset, the connections' tasks end by themselves; one still opening
            # its upstream is cancelled (a cancelled one makes asyncio's stream callback log an
            # "Exception in callback ... CancelledError" for every connection).
            _, pending = await asyncio.wait(tasks, timeout=1)
            for task in pending:
                task.cancel()
            async with asyncio.timeout(5):
                await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            async with asyncio.timeout(5):
                await server.wait_closed()
        log.info("proxy :%d cut", self.port)

    async def restore(self) -> None:
        """Accept connections again, on the same port."""
        if self._server is None:
            await self._listen()
            log.info("proxy :%d restored", self.port)

    def pause(self) -> None:
        """Hold every byte in both directions (the connections stay open): a stalled link."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._server is None or task is None:
            writer.transport.abort()
            return
        self._tasks.add(task)
        self.accepted += 1
        self._writers.add(writer)
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(5):
                upstream_reader, upstream_writer = await asyncio.open_connection(
                    self.target_host, self.target_port
                )
            self._writers.add(upstream_writer)
            async with asyncio.TaskGroup() as group:
                group.create_task(self._pump(reader, upstream_writer))
                group.create_task(self._pump(upstream_reader, writer))
        except* (OSError, TimeoutError) as errors:
            log.debug("proxy :%d connection ended: %r", self.port, errors.exceptions)
        finally:
            for end in (writer, upstream_writer):
                if end is not None:
                    self._writers.discard(end)
                    end.transport.abort()
            self._tasks.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(_CHUNK):
            await self._flowing.wait()
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()
