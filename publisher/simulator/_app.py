"""The ASGI app: IMDS under ``/metadata`` (first VM) and ``/vm/{name}/metadata`` (Scheduled
Events, instance metadata, attested data), admin under ``/admin``."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ._admin import admin_routes
from ._imds import ImdsEndpoints
from ._simulator import Simulator

__all__ = ["create_app"]

_ANY_METHOD = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "Internal server error"
    return JSONResponse({"error": detail}, status_code=status)


def create_app(simulator: Simulator) -> Starlette:
    """An ASGI app serving ``simulator``; run it with :func:`serve` or any ASGI server.

    >>> app = create_app(Simulator(vms=["vm0"]))
    """
    imds = ImdsEndpoints(simulator)
    routes: list[BaseRoute] = [
        # The IMDS routes take every method so that a wrong one gets IMDS's JSON 405, is
        # throttled and logged like the rest.
        Route("/metadata/scheduledevents", imds.default_scheduled_events, methods=_ANY_METHOD),
        Route("/metadata/instance", imds.default_instance, methods=_ANY_METHOD),
        Route("/metadata/attested/document", imds.default_attested, methods=_ANY_METHOD),
        Route("/vm/{name}/metadata/scheduledevents", imds.vm_scheduled_events, methods=_ANY_METHOD),
        Route("/vm/{name}/metadata/instance", imds.vm_instance, methods=_ANY_METHOD),
        Route("/vm/{name}/metadata/attested/document", imds.vm_attested, methods=_ANY_METHOD),
        *admin_routes(simulator),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.imds = imds  # serve() tells it the server is stopping
    return app
