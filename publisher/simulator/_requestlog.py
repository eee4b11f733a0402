"""The recent IMDS requests, for ``GET /admin/requests`` and for tests."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from ._events import iso_time

__all__ = ["RequestLog", "RequestRecord"]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One IMDS request as answered. ``vm`` is None when the path named no known VM."""

    vm: str | None
    method: str
    path: str
    status: int
    time: float

    def to_json(self) -> dict[str, Any]:
        return {
            "vm": self.vm,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "time": iso_time(self.time),
        }


class RequestLog:
    """A ring of the last ``size`` requests, oldest first."""

    def __init__(self, size: int) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=size)

    def add(self, record: RequestRecord) -> None:
        self._records.append(record)

    def recent(self, *, vm: str | None = None, limit: int | None = None) -> list[RequestRecord]:
        records = [r for r in self._records if vm is None or r.vm == vm]
        return records if limit is None else records[-limit:] if limit > 0 else []
