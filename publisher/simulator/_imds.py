"""The IMDS endpoints, failing the way IMDS fails.

For every request, in this order: an injected fault (status, delay or raw body), the per-VM rate
limit (429), the method (405), the ``Metadata: true`` header and the absence of
``X-Forwarded-For`` (400), the api-version (400, listing the valid ones), the first-call delay,
and then the answer. Every request lands in the request log with the status it got.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ._errors import UnknownEventError
from ._faults import Endpoint
from ._simulator import Simulator
from ._versions import INSTANCE_VERSIONS, SCHEDULED_EVENTS_VERSIONS

__all__ = ["ImdsEndpoints"]

log = logging.getLogger(__name__)

_FAULT_MESSAGES = {
    410: "Gone",
    429: "Too many requests",
    500: "Internal server error",
    503: "Service unavailable",
}
_NEWEST_SHOWN = 3


def error(status: int, message: str, **extra: Any) -> JSONResponse:
    """An IMDS-style error body: ``{"error": "..."}`` plus details."""
    return JSONResponse({"error": message, **extra}, status_code=status)


class ImdsEndpoints:
    """The request handlers, bound to one simulator."""

    def __init__(self, simulator: Simulator) -> None:
        self._sim = simulator

    async def default_scheduled_events(self, request: Request) -> Response:
        return await self._handle(request, self._sim.default_vm, "scheduledevents")

    async def default_instance(self, request: Request) -> Response:
        return await self._handle(request, self._sim.default_vm, "instance")

    async def vm_scheduled_events(self, request: Request) -> Response:
        return await self._handle(request, request.path_params["name"], "scheduledevents")

    async def vm_instance(self, request: Request) -> Response:
        return await self._handle(request, request.path_params["name"], "instance")

    async def _handle(self, request: Request, vm: str | None, endpoint: Endpoint) -> Response:
        sim = self._sim
        if vm is None or not sim.has_vm(vm):
            response: Response = error(404, f"Not found: no VM {vm!r} in this simulator")
            vm = None
        else:
            response = await self._answer(request, vm, endpoint)
        path = request.url.path
        if request.url.query:
            path = f"{path}?{request.url.query}"
        sim.record_request(vm, request.method, path, response.status_code)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s %s -> %d", vm, request.method, path, response.status_code)
        return response

    async def _answer(self, request: Request, vm: str, endpoint: Endpoint) -> Response:
        sim = self._sim
        fault = sim.take_fault(vm, endpoint)
        if fault is not None:
            if fault.status is not None:
                return error(fault.status, _FAULT_MESSAGES[fault.status])
            if fault.body is not None:
                return Response(fault.body, status_code=200, media_type="application/json")
            if fault.delay_seconds is not None:
                await asyncio.sleep(sim.to_real(fault.delay_seconds))
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
        versions = SCHEDULED_EVENTS_VERSIONS if endpoint == "scheduledevents" else INSTANCE_VERSIONS
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
        delay = sim.take_first_call_delay(vm)
        if delay > 0:
            log.info("first call of %s: answering in %.3f s", vm, delay)
            await asyncio.sleep(delay)
        if method == "POST":
            return await self._approve(request, vm)
        return JSONResponse(sim.scheduled_events_document(vm, version))

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
