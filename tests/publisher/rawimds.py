"""A raw HTTP/1.1 server on loopback whose handler scripts every byte of each answer: for what
the simulator will not say (a garbled status line, a connection dropped after a request was
read, a 200 with a huge body)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[int]:
    """Serve ``handler`` (one call per connection) on 127.0.0.1; yields the port."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port: int = server.sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request: its head and its body (``Content-Length`` bytes)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    body = await reader.readexactly(length) if length else b""
    return head, body


async def requests(reader: asyncio.StreamReader) -> AsyncIterator[tuple[bytes, bytes]]:
    """Each request on a connection (head, body) until the client closes or drops it."""
    while True:
        try:
            yield await read_request(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            return


def ok(body: bytes, extra: bytes = b"") -> bytes:
    """A ``200 OK`` answer with ``body`` (and the header lines ``extra``, each CRLF-ended)."""
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
        % (len(body), extra, body)
    )
