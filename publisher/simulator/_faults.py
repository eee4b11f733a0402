"""Injected failures: IMDS answering 500/503/410/429, late, garbage, stale, reset, slowly or
hugely.

Faults apply to the IMDS endpoints only (never to ``/admin``). Each fault counts down ``times``
requests, taken first-come first-served by the VMs it targets (``vm`` None: every VM) on the
endpoint it targets (``endpoint`` None: every one). A fault that does not apply to a request
(``stale`` and ``reset`` to anything but ``GET /metadata/scheduledevents``) lets it pass by and
stays pending.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Endpoint", "FaultBook", "FaultInfo", "FaultSpec"]

Endpoint = Literal["scheduledevents", "instance", "attested"]

_KINDS = ("status", "delay_seconds", "body", "stale", "reset", "drip_seconds", "huge_mb")
_MAX_HUGE_MB = 1024


class FaultSpec(BaseModel):
    """The body of ``POST /admin/faults``: whom (``vm``, ``endpoint``), how often (``times``)
    and exactly one kind:

    - ``status``: answer 500, 503, 410 or 429 at once.
    - ``delay_seconds``: wait that long (simulated: divided by ``--speed``), then answer normally
      (a long hang is a large delay).
    - ``body``: answer 200 with this raw text (garbage, truncated JSON...).
    - ``stale``: answer an *older* document of that VM, ``stale`` documents back among those
      IMDS produced for it (the oldest it has when there are fewer; the current one when it
      never had another), with its lower DocumentIncarnation and the events as they were then.
      ``GET /metadata/scheduledevents`` only.
    - ``reset``: (``true``) answer ``{"DocumentIncarnation": 0, "Events": []}``.
      ``GET /metadata/scheduledevents`` only.
    - ``drip_seconds``: answer normally, but send the body one byte every that many *real*
      seconds (a per-read timeout restarts with every byte: only an overall deadline stops it).
    - ``huge_mb``: answer normally, padded with JSON whitespace to that many MiB (2**20 bytes;
      at most 1024): still valid JSON, for a client without a size cap to choke on.

    >>> FaultSpec(status=503, times=3).times
    3
    >>> FaultSpec(vm="web_1", stale=1, times=5).stale
    1
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    vm: str | None = None
    times: int = Field(default=1, ge=1)
    endpoint: Endpoint | None = None
    #: Only requests with this method (``POST``: an approval); None: any.
    method: Literal["GET", "POST"] | None = None
    status: Literal[500, 503, 410, 429] | None = None
    delay_seconds: float | None = Field(default=None, ge=0)
    body: str | None = None
    stale: int | None = Field(default=None, ge=1)
    reset: Literal[True] | None = None
    drip_seconds: float | None = Field(default=None, gt=0, le=60)
    huge_mb: float | None = Field(default=None, gt=0, le=_MAX_HUGE_MB)

    @model_validator(mode="after")
    def _exactly_one_kind(self) -> Self:
        kinds = [k for k in _KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(
                f"give exactly one of {', '.join(_KINDS)}"
                + (f" (got {', '.join(kinds)})" if kinds else "")
            )
        return self

    def applies_to(self, endpoint: Endpoint, method: str) -> bool:
        """Whether this fault can shape a request to ``endpoint`` with ``method``."""
        if self.endpoint not in (None, endpoint) or self.method not in (None, method):
            return False
        if self.stale is not None or self.reset is not None:
            return endpoint == "scheduledevents" and method == "GET"
        return True


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

    def take(self, vm: str, endpoint: Endpoint, method: str = "GET") -> FaultSpec | None:
        """The first fault for this request, counted down; None when there is none."""
        if not self._pending:
            return None
        for fault_id, entry in self._pending.items():
            spec: FaultSpec = entry[0]
            if spec.vm not in (None, vm) or not spec.applies_to(endpoint, method):
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
