"""Injected failures: IMDS answering 500/503/410/429, answering late, or answering garbage.

Faults apply to the IMDS endpoints only (never to ``/admin``). Each fault counts down ``times``
requests, taken first-come first-served by the VMs it targets (``vm`` None: every VM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Endpoint", "FaultBook", "FaultInfo", "FaultSpec"]

Endpoint = Literal["scheduledevents", "instance"]


class FaultSpec(BaseModel):
    """The body of ``POST /admin/faults``: exactly one of status, delay_seconds, body.

    ``delay_seconds`` is simulated (divided by ``--speed``); the request is then served normally.
    ``body`` is served as-is with status 200.

    >>> FaultSpec(status=503, times=3).times
    3
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    vm: str | None = None
    times: int = Field(default=1, ge=1)
    endpoint: Endpoint | None = None
    status: Literal[500, 503, 410, 429] | None = None
    delay_seconds: float | None = Field(default=None, ge=0)
    body: str | None = None

    @model_validator(mode="after")
    def _exactly_one_kind(self) -> Self:
        kinds = [k for k in ("status", "delay_seconds", "body") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(
                "give exactly one of status, delay_seconds, body"
                + (f" (got {', '.join(kinds)})" if kinds else "")
            )
        return self


@dataclass(frozen=True, slots=True)
class FaultInfo:
    """A fault as listed by ``GET /admin/faults``."""

    fault_id: int
    spec: FaultSpec
    remaining: int

    def to_json(self) -> dict[str, Any]:
        return {"id": self.fault_id, "remaining": self.remaining, **self.spec.model_dump()}


class FaultBook:
    """The pending faults, in the order they were added."""

    def __init__(self) -> None:
        self._next_id = 1
        self._pending: dict[int, list[Any]] = {}  # id -> [spec, remaining]

    def add(self, spec: FaultSpec) -> FaultInfo:
        fault_id = self._next_id
        self._next_id += 1
        self._pending[fault_id] = [spec, spec.times]
        return FaultInfo(fault_id, spec, spec.times)

    def take(self, vm: str, endpoint: Endpoint) -> FaultSpec | None:
        """The first fault for this request, counted down; None when there is none."""
        if not self._pending:
            return None
        for fault_id, entry in self._pending.items():
            spec: FaultSpec = entry[0]
            if spec.vm not in (None, vm) or spec.endpoint not in (None, endpoint):
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                del self._pending[fault_id]
            return spec
        return None

    def list(self) -> list[FaultInfo]:
        return [FaultInfo(i, e[0], e[1]) for i, e in self._pending.items()]

    def clear(self) -> int:
        """Drop every pending fault; how many there were."""
        count = len(self._pending)
        self._pending.clear()
        return count
