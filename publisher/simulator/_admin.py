"""The admin API (JSON), for tests, scenarios and users: VMs and their topology, events, faults,
the request log.

Event bodies use IMDS's PascalCase names; VMs, faults and requests use lowercase ones. Errors
are ``{"error": "..."}``: 400 names the bad field, 404 an unknown VM or event, 409 a step the
event's state does not allow (or a VM that exists already).

``PATCH /admin/events/{id}`` updates a Scheduled event in place (``EventType``, ``Resources``,
``NotBeforeSeconds`` as a new notice from now, ``DurationInSeconds``, ``Description``).
``POST /admin/faults`` takes a :class:`FaultSpec`: whom (``vm``, ``endpoint``), how often
(``times``) and one kind: ``status``, ``delay_seconds``, ``body``, ``stale`` (an older document),
``reset`` (DocumentIncarnation 0), ``drip_seconds`` (a byte at a time), ``huge_mb``.
``GET /admin/attestation/ca.pem`` is the CA certificate that attested documents chain to.
``GET /admin/requests/stats[?vm=NAME]`` counts each VM's requests since the last
``DELETE /admin/requests/stats``: total, the most in any one-second window, and by endpoint,
method and status.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ._errors import (
    DuplicateVmError,
    EventStateError,
    InvalidEventError,
    InvalidVmNameError,
    UnknownEventError,
    UnknownVmError,
    describe_validation_error,
)
from ._events import EventSpec, EventState, EventUpdate
from ._faults import FaultSpec
from ._simulator import Simulator
from ._topology import Topology

__all__ = ["admin_routes"]

_Handler = Callable[[Request], Awaitable[Response]]
_M = TypeVar("_M", bound=BaseModel)


class _NewVms(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str | None = None
    names: list[str] | None = Field(default=None, min_length=1)

    def all_names(self) -> list[str]:
        return ([self.name] if self.name is not None else []) + (self.names or [])

    @model_validator(mode="after")
    def _some(self) -> _NewVms:
        if self.name is None and self.names is None:
            raise ValueError("give name or names")
        return self


class _Approve(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    vm: str


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class _BadBody(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


async def _body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw) if raw else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _BadBody(f"body is not JSON: {exc}") from exc


def _validate(model: type[_M], document: Any) -> _M:
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        raise _BadBody(describe_validation_error(exc)) from exc


def _int_param(request: Request, name: str) -> int | None:
    value = request.query_params.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise _BadBody(f"{name}: not an integer: {value!r}") from None


class _Admin:
    def __init__(self, simulator: Simulator) -> None:
        self._sim = simulator

    @staticmethod
    async def dispatch(handler: _Handler, request: Request) -> Response:
        """Run ``handler``, mapping the simulator's errors to statuses."""
        try:
            response: Response = await handler(request)
        except _BadBody as exc:
            return _error(400, exc.message)
        except (InvalidEventError, InvalidVmNameError) as exc:
            return _error(400, str(exc))
        except (UnknownEventError, UnknownVmError) as exc:
            return _error(404, str(exc))
        except (EventStateError, DuplicateVmError) as exc:
            return _error(409, str(exc))
        return response

    # -- VMs

    async def add_vms(self, request: Request) -> Response:
        spec = _validate(_NewVms, await _body(request))
        added = []
        for name in spec.all_names():
            self._sim.add_vm(name)
            added.append({"name": name, "path": f"/vm/{name}"})
        return JSONResponse({"vms": added}, status_code=201)

    async def list_vms(self, request: Request) -> Response:
        sim = self._sim
        vms = [{"name": n, "incarnation": sim.incarnation(n)} for n in sim.served_vm_names()]
        shard = sim.config.shard
        return JSONResponse(
            {"default": sim.default_vm, "shard": None if shard is None else str(shard), "vms": vms}
        )

    async def get_vm(self, request: Request) -> Response:
        sim = self._sim
        name = request.path_params["name"]
        document = sim.scheduled_events_document(name)
        membership = sim.membership(name)
        return JSONResponse(
            {
                "name": name,
                "incarnation": document["DocumentIncarnation"],
                "events": [e["EventId"] for e in document["Events"]],
                "compute": sim.identity(name).compute(),
                "availability_set": membership.availability_set,
                "sees_events_of": list(sim.group_of(name)),
            }
        )

    # -- topology

    async def add_topology(self, request: Request) -> Response:
        topology = _validate(Topology, await _body(request))
        names = self._sim.add_topology(topology)
        return JSONResponse({"vms": names}, status_code=201)

    async def describe_topology(self, request: Request) -> Response:
        return JSONResponse(self._sim.describe_topology())

    # -- attestation

    async def attestation_ca(self, request: Request) -> Response:
        return Response(self._sim.attestation_ca_pem, media_type="application/x-pem-file")

    # -- events

    async def add_event(self, request: Request) -> Response:
        spec = _validate(EventSpec, await _body(request))
        return JSONResponse(self._sim.add_event(spec).to_json(), status_code=201)

    async def list_events(self, request: Request) -> Response:
        raw_state = request.query_params.get("state")
        state = None
        if raw_state is not None:
            try:
                state = EventState(raw_state)
            except ValueError:
                valid = ", ".join(s.value for s in EventState)
                raise _BadBody(f"state: {raw_state!r} is not one of {valid}") from None
        return JSONResponse({"Events": [e.to_json() for e in self._sim.events(state)]})

    async def get_event(self, request: Request) -> Response:
        return JSONResponse(self._sim.get_event(request.path_params["event_id"]).to_json())

    async def update_event(self, request: Request) -> Response:
        update = _validate(EventUpdate, await _body(request))
        event_id = request.path_params["event_id"]
        return JSONResponse(self._sim.apply_update(event_id, update).to_json())

    async def cancel_event(self, request: Request) -> Response:
        return JSONResponse(self._sim.cancel_event(request.path_params["event_id"]).to_json())

    async def start_event(self, request: Request) -> Response:
        return JSONResponse(self._sim.start_event(request.path_params["event_id"]).to_json())

    async def complete_event(self, request: Request) -> Response:
        return JSONResponse(self._sim.complete_event(request.path_params["event_id"]).to_json())

    async def approve_event(self, request: Request) -> Response:
        body = _validate(_Approve, await _body(request))
        event_id = request.path_params["event_id"]
        self._sim.approve(body.vm, [event_id])
        return JSONResponse(self._sim.get_event(event_id).to_json())

    # -- faults and requests

    async def add_fault(self, request: Request) -> Response:
        spec = _validate(FaultSpec, await _body(request))
        if spec.vm is not None and not self._sim.has_vm(spec.vm):
            raise UnknownVmError(spec.vm)
        return JSONResponse(self._sim.add_fault(spec).to_json(), status_code=201)

    async def list_faults(self, request: Request) -> Response:
        return JSONResponse({"faults": [f.to_json() for f in self._sim.faults()]})

    async def clear_faults(self, request: Request) -> Response:
        return JSONResponse({"cleared": self._sim.clear_faults()})

    async def list_requests(self, request: Request) -> Response:
        vm = request.query_params.get("vm")
        limit = _int_param(request, "limit")
        records = self._sim.requests(vm=vm, limit=limit)
        return JSONResponse({"requests": [r.to_json() for r in records]})

    async def request_stats(self, request: Request) -> Response:
        vm = request.query_params.get("vm")
        sim = self._sim
        stats = sim.all_request_stats() if vm is None else [sim.request_stats(vm)]
        return JSONResponse({"vms": [s.to_json() for s in stats]})

    async def reset_request_stats(self, request: Request) -> Response:
        self._sim.reset_request_stats()
        return JSONResponse({"reset": True})


def admin_routes(simulator: Simulator) -> list[BaseRoute]:
    """The ``/admin`` routes for ``simulator``."""
    a = _Admin(simulator)
    table: list[tuple[str, str, _Handler]] = [
        ("/admin/vms", "POST", a.add_vms),
        ("/admin/vms", "GET", a.list_vms),
        ("/admin/vms/{name}", "GET", a.get_vm),
        ("/admin/topology", "POST", a.add_topology),
        ("/admin/topology", "GET", a.describe_topology),
        ("/admin/attestation/ca.pem", "GET", a.attestation_ca),
        ("/admin/events", "POST", a.add_event),
        ("/admin/events", "GET", a.list_events),
        ("/admin/events/{event_id}", "GET", a.get_event),
        ("/admin/events/{event_id}", "PATCH", a.update_event),
        ("/admin/events/{event_id}", "DELETE", a.cancel_event),
        ("/admin/events/{event_id}/start", "POST", a.start_event),
        ("/admin/events/{event_id}/complete", "POST", a.complete_event),
        ("/admin/events/{event_id}/approve", "POST", a.approve_event),
        ("/admin/faults", "POST", a.add_fault),
        ("/admin/faults", "GET", a.list_faults),
        ("/admin/faults", "DELETE", a.clear_faults),
        ("/admin/requests", "GET", a.list_requests),
        ("/admin/requests/stats", "GET", a.request_stats),
        ("/admin/requests/stats", "DELETE", a.reset_request_stats),
    ]
    return [_route(path, method, handler) for path, method, handler in table]


def _route(path: str, method: str, handler: _Handler) -> Route:
    async def endpoint(request: Request) -> Response:
        return await _Admin.dispatch(handler, request)

    return Route(path, endpoint, methods=[method], name=f"admin_{handler.__name__}")
