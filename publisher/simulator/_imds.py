"""The IMDS endpoints, failing the way IMDS fails.

For every request, in this order: an injected fault (status, delay or raw body), the per-VM rate
limit (429), the method (405), the ``Metadata: true`` header and the absence of
``X-Forwarded-For`` (400), the api-version (400, listing the valid ones), the first-call delay,
and then the answer: stale or reset when a fault says so, dripped or padded when a fault says
so. Every request lands in the request log with the status it got, and in its VM's accounting
(counted when it arrives, its status when answered).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ._attestation import valid_nonce
from ._errors import UnknownEventError
from ._faults import Endpoint, FaultSpec
from ._simulator import Simulator
from ._versions import ATTESTED_VERSIONS, INSTANCE_VERSIONS, SCHEDULED_EVENTS_VERSIONS

__all__ = ["ImdsEndpoints"]

log = logging.getLogger(__name__)

_FAULT_MESSAGES = {
    410: "Gone",
    429: "Too many requests",
    500: "Internal server error",
    503: "Service unavailable",
}
_NEWEST_SHOWN = 3
_VERSIONS: dict[Endpoint, tuple[str, ...]] = {
    "scheduledevents": SCHEDULED_EVENTS_VERSIONS,
    "instance": INSTANCE_VERSIONS,
    "attested": ATTESTED_VERSIONS,
}
_PAD_CHUNK = b" " * 65536


def error(status: int, message: str, **extra: Any) -> JSONResponse:
    """An IMDS-style error body: ``{"error": "..."}`` plus details."""
    return JSONResponse({"error": message, **extra}, status_code=status)


def _stopping() -> JSONResponse:
    """The answer to a request held when the server stops."""
    return error(503, "Service unavailable: the simulator is stopping")


class ImdsEndpoints:
    """The request handlers, bound to one simulator."""

    def __init__(self, simulator: Simulator) -> None:
        self._sim = simulator
        #: Set when the server stops: a request a fault or a first-call delay holds is answered
        #: at once, not cancelled after the graceful-shutdown time (a 500 and a traceback).
        self.stopping = asyncio.Event()

    async def _held(self, seconds: float) -> bool:
        """Wait ``seconds`` (real) unless the server stops first; True: it is stopping."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.stopping.wait()
        return self.stopping.is_set()

    async def default_scheduled_events(self, request: Request) -> Response:
        return await self._handle(request, self._sim.default_vm, "scheduledevents")

    async def default_instance(self, request: Request) -> Response:
        return await self._handle(request, self._sim.default_vm, "instance")

    async def vm_scheduled_events(self, request: Request) -> Response:
        return await self._handle(request, request.path_params["name"], "scheduledevents")

    async def vm_instance(self, request: Request) -> Response:
        return await self._handle(request, request.path_params["name"], "instance")

    async def default_attested(self, request: Request) -> Response:
        return await self._handle(request, self._sim.default_vm, "attested")

    async def vm_attested(self, request: Request) -> Response:
        return await self._handle(request, request.path_params["name"], "attested")

    async def _handle(self, request: Request, vm: str | None, endpoint: Endpoint) -> Response:
        sim = self._sim
        if vm is None or not sim.serves(vm):
            response: Response = error(404, _not_here(sim, vm))
            vm = None
        else:
            sim.request_arrived(vm)
            response = await self._answer(request, vm, endpoint)
        # From the scope, not request.url: building a URL object costs a urlsplit per request.
        path = request.scope["path"]
        query = request.scope["query_string"]
        if query:
            path = f"{path}?{query.decode('latin-1')}"
        sim.record_request(vm, request.method, path, response.status_code, endpoint=endpoint)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s %s -> %d", vm, request.method, path, response.status_code)
        return response

    async def _answer(self, request: Request, vm: str, endpoint: Endpoint) -> Response:
        fault = self._sim.take_fault(vm, endpoint, request.method)
        if fault is not None:
            if fault.status is not None:
                return error(fault.status, _FAULT_MESSAGES[fault.status])
            if fault.body is not None:
                return Response(fault.body, status_code=200, media_type="application/json")
            if fault.delay_seconds is not None:
                # A late answer, not a late request: what the client sent has arrived (Starlette
                # keeps the body), and IMDS acts on it even if the client is gone by then.
                await request.body()
                if await self._held(self._sim.to_real(fault.delay_seconds)):
                    return _stopping()
        response = await self._serve(request, vm, endpoint, fault)
        if fault is not None and fault.drip_seconds is not None:
            log.info("%s: dripping %d bytes", vm, len(response.body))
            return _dripped(response, fault.drip_seconds, self._held)
        if fault is not None and fault.huge_mb is not None:
            log.info("%s: padding the answer to %g MiB", vm, fault.huge_mb)
            return _padded(response, int(fault.huge_mb * 2**20))
        return response

    async def _serve(
        self, request: Request, vm: str, endpoint: Endpoint, fault: FaultSpec | None
    ) -> Response:
        sim = self._sim
        if not sim.admit(vm):
            return error(429, "Too many requests")
        method = request.method
        allowed = ("GET", "POST") if endpoint == "scheduledevents" else ("GET",)
        if method not in allowed:
            return JSONResponse(
                {"error": "Method not allowed"},
                status_code=405,
                headers={"Allow": ", ".join(allowed)},
            )
        headers = request.headers
        if headers.get("metadata", "").lower() != "true":
            return error(400, "Bad request. Required metadata header not specified")
        if "x-forwarded-for" in headers:
            return error(400, "Bad request. Request contains the X-Forwarded-For header")
        versions = _VERSIONS[endpoint]
        version = request.query_params.get("api-version")
        if version not in versions:
            problem = "was not specified" if not version else f"{version!r} is invalid"
            newest_first = list(reversed(versions))
            return error(
                400,
                f"Bad request. api-version {problem}. For more information refer to"
                " aka.ms/azureimds",
                **{"newest-versions": newest_first[:_NEWEST_SHOWN], "valid-versions": newest_first},
            )
        if endpoint == "instance":
            return JSONResponse(sim.instance_document(vm))
        if endpoint == "attested":
            nonce = request.query_params.get("nonce")
            if nonce is not None and not valid_nonce(nonce):
                return error(400, "Bad request. The nonce must be up to 32 letters and digits")
            return JSONResponse(sim.attested_document(vm, nonce, version))
        delay = sim.take_first_call_delay(vm)
        if delay > 0:
            log.info("first call of %s: answering in %.3f s", vm, delay)
            if await self._held(delay):
                return _stopping()
        if method == "POST":
            return await self._approve(request, vm)
        if fault is not None and fault.reset is not None:
            return JSONResponse({"DocumentIncarnation": 0, "Events": []})
        if fault is not None and fault.stale is not None:
            return JSONResponse(sim.stale_document(vm, fault.stale, version))
        body = sim.scheduled_events_body(vm, version)
        return Response(body, status_code=200, media_type="application/json")

    async def _approve(self, request: Request, vm: str) -> Response:
        event_ids = parse_start_requests(await request.body())
        if event_ids is None:
            return error(
                400,
                'Bad request. Expected a body like {"StartRequests": [{"EventId": "..."}]}',
            )
        try:
            self._sim.approve(vm, event_ids)
        except UnknownEventError as exc:
            return error(400, f"Bad request. {exc}")
        return Response(status_code=200)


def _not_here(sim: Simulator, vm: str | None) -> str:
    shard = sim.config.shard
    if vm is not None and shard is not None and sim.has_vm(vm):
        return f"Not found: VM {vm!r} is served by shard {sim.shard_of(vm)}/{shard.count}"
    return f"Not found: no VM {vm!r} in this simulator"


def parse_start_requests(body: bytes) -> list[str] | None:
    """The EventIds of a ``StartRequests`` body, or None when the body is malformed."""
    try:
        document = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(document, dict):
        return None
    requests = document.get("StartRequests")
    if not isinstance(requests, list):
        return None
    event_ids: list[str] = []
    for item in requests:
        if not isinstance(item, dict):
            return None
        event_id = item.get("EventId")
        if not isinstance(event_id, str) or not event_id:
            return None
        event_ids.append(event_id)
    return event_ids


def _dripped(
    response: Response, interval: float, held: Callable[[float], Awaitable[bool]]
) -> Response:
    """``response`` with its body sent one byte every ``interval`` real seconds (the rest at
    once when ``held`` says the server is stopping)."""
    body = bytes(response.body)

    async def drip() -> AsyncIterator[bytes]:
        for i in range(len(body)):
            if i and await held(interval):
                yield body[i:]
                return
            yield body[i : i + 1]

    return _streamed(response, drip(), len(body))


def _padded(response: Response, size: int) -> Response:
    """``response`` with its body padded with JSON whitespace to ``size`` bytes."""
    body = bytes(response.body)
    size = max(size, len(body))

    async def pad() -> AsyncIterator[bytes]:
        yield body
        left = size - len(body)
        while left > 0:
            chunk = _PAD_CHUNK[: min(left, len(_PAD_CHUNK))]
            left -= len(chunk)
            yield chunk

    return _streamed(response, pad(), size)


def _streamed(response: Response, content: AsyncIterator[bytes], length: int) -> Response:
    headers = {k: v for k, v in response.headers.items() if k != "content-length"}
    headers["content-length"] = str(length)
    return StreamingResponse(content, status_code=response.status_code, headers=headers)
