"""The smallest HTTP/1.1 client IMDS needs: asyncio streams, keep-alive, no proxy, no redirects.

IMDS is plain HTTP on a link-local address, asked one small thing at a time, once a second, on
every VM of a fleet; so the agent's client is this one rather than a general-purpose library.
Measured on one core (``tests/benchmarks/agent_latency.py`` and a GET loop against the
simulator): httpx cost about 1.3 ms of CPU per GET and about 5 MiB of RSS (httpx, httpcore,
anyio, h11); this costs about a tenth of the CPU and nothing to import beyond asyncio.

What it does: ``Content-Length``, ``chunked`` and read-to-close bodies; a body over
``max_body`` refused as it arrives (:class:`BodyTooLarge`); a connection kept for the next
request only after a complete answer that does not say ``Connection: close``, and thrown away
after any failure or cancellation (so a deadline that cuts a request off never leaves a
half-read answer for the next one). A request is sent once: a kept connection found closed
before anything is written is not used, but one that drops after the request went out fails
the request (:class:`HttpError`, not :class:`ConnectFailed`: it may have been taken;
:class:`KeptConnectionDropped` when a kept connection ended before a byte of the answer, most
likely let go by the server while idle), and the caller asks again through its limiter:
IMDS's 5 requests a second are shared by every client on the VM, and a POST that IMDS read
may have started an event (so the caller sends one on a kept connection only if it was idle a
moment, ``max_idle``: one idle longer may be let go by the server just as it goes). Deadlines
are the caller's (``asyncio.timeout`` around :meth:`HttpClient.request`).

>>> client = HttpClient("http://169.254.169.254", headers={"Metadata": "true"})
>>> response = await client.request("GET", "/metadata/scheduledevents?api-version=2020-07-01",
...                                 max_body=1 << 20)          # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = ["BodyTooLarge", "HttpClient", "HttpError", "KeptConnectionDropped", "Response"]

#: Idle keep-alive connections kept (the watcher, an approval and the attestation may overlap).
_MAX_IDLE = 2
#: The longest status line plus headers taken (asyncio's stream limit).
_HEAD_LIMIT = 64 * 1024
_NO_BODY = frozenset({204, 304})
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")


class HttpError(Exception):
    """The connection failed or the answer is not HTTP/1.x (refused, reset, malformed).

    ``status``: the answer's status code when its head was read and its body then failed (too
    large, malformed, cut off), None otherwise: a POST's 2xx says it was taken, whatever follows.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class KeptConnectionDropped(HttpError):
    """A kept connection ended before a byte of the answer came back: most likely the server
    let it go while it was idle (its keep-alive ran out) and never read the request, but it may
    have read it. Only a request that may be sent twice (a GET) is sent again, on a new
    connection (``request(..., max_idle=0)``)."""


class ConnectFailed(HttpError):
    """No connection could be opened: the request never went out. Any other HttpError may
    come after the request reached the server."""


class BodyTooLarge(HttpError):
    """The answer's body is larger than the caller takes."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message, status)


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    #: Header names in lower case (a repeated header keeps its last value).
    headers: Mapping[str, str]
    body: bytes


class _Connection:
    __slots__ = ("idle_since", "reader", "used", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.used = False
        #: When its last answer was read (monotonic): how long it has been idle in the pool.
        self.idle_since = 0.0

    @property
    def usable(self) -> bool:
        return not (self.writer.is_closing() or self.reader.at_eof())

    def close(self) -> None:
        self.writer.close()


class HttpClient:
    """Requests to one origin (``base_url``'s scheme, host and port); ``headers`` go with every
    request."""

    def __init__(self, base_url: str, *, headers: Mapping[str, str] | None = None) -> None:
        split = urlsplit(base_url)
        if split.scheme not in ("http", "https") or not split.hostname:
            raise ValueError(f"not an http:// URL: {base_url!r}")
        self.host = split.hostname
        self.tls = split.scheme == "https"
        self.port = split.port or (443 if self.tls else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        default_port = self.port == (443 if self.tls else 80)
        authority = host if default_port else f"{host}:{self.port}"
        fixed = {"Host": authority, **(headers or {})}
        self._fixed = "".join(f"{name}: {value}\r\n" for name, value in fixed.items())
        self._idle: list[_Connection] = []
        self._ssl: Any = None

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    async def _connect(self) -> _Connection:
        if self.tls and self._ssl is None:
            import ssl  # only for an https:// IMDS (never Azure's)

            self._ssl = ssl.create_default_context()
        try:
            reader, writer = await asyncio.open_connection(
                self.host, self.port, ssl=self._ssl if self.tls else None, limit=_HEAD_LIMIT
            )
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        return _Connection(reader, writer)

    def _take(self, max_idle: float | None) -> _Connection | None:
        """The kept connection used last, if it is still open and (``max_idle``) was idle at
        most that long (one idle longer stays kept, for a request that may take it)."""
        while self._idle:
            connection = self._idle[-1]
            if not connection.usable:
                self._idle.pop().close()
                continue
            if max_idle is not None and time.monotonic() - connection.idle_since > max_idle:
                return None
            return self._idle.pop()
        return None

    async def request(
        self,
        method: str,
        target: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        max_body: int,
        max_idle: float | None = None,
        sending: Callable[[], None] | None = None,
    ) -> Response:
        """Send one request (``target``: path and query) and read the whole answer, on the
        connection kept last, or a new one; ``max_idle``: on a kept one only if it was idle
        at most that many seconds (0: always a new one). ``sending`` is called as the request
        is written (once its connection is open)."""
        head = f"{method} {target} HTTP/1.1\r\n{self._fixed}"
        for name, value in (headers or {}).items():
            head += f"{name}: {value}\r\n"
        if body is not None or method in ("POST", "PUT"):
            head += f"Content-Length: {len(body or b'')}\r\n"
        raw = head.encode("latin-1") + b"\r\n" + (body or b"")
        # Never sent twice: the server may have read (and acted on) a request on a connection
        # it then dropped, and a second send would be a request its caller's limiter never
        # counted. Only a connection known closed before anything is written is passed over.
        connection = self._take(max_idle) or await self._connect()
        return await self._exchange(connection, raw, max_body, sending)

    async def _exchange(
        self,
        connection: _Connection,
        raw: bytes,
        max_body: int,
        sending: Callable[[], None] | None = None,
    ) -> Response:
        reused, connection.used = connection.used, True
        keep = False
        status: int | None = None
        try:
            try:
                if sending is not None:
                    sending()
                connection.writer.write(raw)
                head = await connection.reader.readuntil(b"\r\n\r\n")
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                if reused and not getattr(exc, "partial", b""):
                    raise KeptConnectionDropped(
                        "the connection dropped before an answer (a kept connection: the "
                        f"server may have let it go): {exc!r}"
                    ) from exc
                raise HttpError(f"the connection dropped before an answer: {exc!r}") from exc
            except asyncio.LimitOverrunError as exc:
                raise HttpError(f"the answer's headers exceed {_HEAD_LIMIT} bytes") from exc
            status, headers, keep = _parse_head(head)
            try:
                content = await _read_body(connection.reader, status, headers, max_body)
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                raise HttpError(f"the connection failed while reading: {exc!r}", status) from exc
            except (asyncio.LimitOverrunError, ValueError) as exc:
                raise HttpError(f"the answer's body is malformed: {exc}", status) from exc
            if keep and "content-length" not in headers and "chunked" not in _codings(headers):
                keep = False  # read to the close
            return Response(status, headers, content)
        except HttpError as exc:
            keep = False
            if exc.status is None:
                exc.status = status  # the head was read: its status goes with the failure
            raise
        except Exception as exc:
            # Anything else the answer's bytes make its parsing raise is that request failing
            # (the caller's HttpError), never an error its caller does not expect: one bad
            # answer from IMDS ended the agent (int("²00") raised ValueError).
            keep = False
            raise HttpError(f"the answer cannot be read: {exc!r}", status) from exc
        except BaseException:
            keep = False
            raise
        finally:
            if keep and len(self._idle) < _MAX_IDLE:
                connection.idle_since = time.monotonic()
                self._idle.append(connection)
            else:
                connection.close()


def _digits(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes "²" or "٣", which int() may refuse."""
    return text.isascii() and text.isdigit()


def _parse_head(head: bytes) -> tuple[int, dict[str, str], bool]:
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest.partition(" ")[0]
    if not version.startswith("HTTP/1.") or len(code) != 3 or not _digits(code):
        raise HttpError(f"not an HTTP/1.x answer: {lines[0][:100]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise HttpError(f"malformed header line {line[:100]!r}")
        headers[name.strip().lower()] = value.strip()
    connection = headers.get("connection", "").lower()
    keep = "close" not in connection and (version == "HTTP/1.1" or "keep-alive" in connection)
    return int(code), headers, keep


def _codings(headers: Mapping[str, str]) -> str:
    return headers.get("transfer-encoding", "").lower()


async def _read_body(
    reader: asyncio.StreamReader, status: int, headers: Mapping[str, str], max_body: int
) -> bytes:
    if status in _NO_BODY or 100 <= status < 200:
        return b""
    if "chunked" in _codings(headers):
        return await _read_chunked(reader, status, max_body)
    declared = headers.get("content-length")
    if declared is not None:
        if not _digits(declared):
            raise HttpError(f"Content-Length {declared[:40]!r} is not a number")
        size = int(declared)
        if size > max_body:
            raise BodyTooLarge(f"answered {size} bytes, more than the {max_body} taken", status)
        return await reader.readexactly(size)
    chunks: list[bytes] = []
    total = 0
    while chunk := await reader.read(65536):
        total += len(chunk)
        if total > max_body:
            raise BodyTooLarge(f"answered more than the {max_body} bytes taken", status)
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_chunked(reader: asyncio.StreamReader, status: int, max_body: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        line = await reader.readuntil(b"\r\n")
        declared = line.split(b";", 1)[0].strip()
        if _CHUNK_SIZE.fullmatch(declared) is None:  # int(, 16) also takes "+1_0" or "0x10"
            raise HttpError(f"chunk size {declared[:40]!r} is not a hexadecimal number")
        size = int(declared, 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                pass
            return b"".join(chunks)
        total += size
        if total > max_body:
            raise BodyTooLarge(f"answered more than the {max_body} bytes taken", status)
        chunks.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise ValueError("a chunk does not end with CRLF")
