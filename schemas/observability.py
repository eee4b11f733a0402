"""Metrics and health for every process: a small Prometheus registry and a ``/healthz`` +
``/metrics`` HTTP endpoint, shared by the agent and the central services.

Why not prometheus-client: on 10,000 VMs every MiB of the agent is 10 GiB of fleet memory, and
the agent needs a dozen counters, gauges and one histogram. This module writes the Prometheus
text exposition format (version 0.0.4) itself, in a few lines, and imports nothing heavy.

::

    registry = Registry()
    polls = registry.counter("agent_imds_polls", "Scheduled Events GETs answered")
    errors = registry.counter("agent_imds_errors", "IMDS requests that failed", ["kind"])
    polls.inc(); errors.labels("timeout").inc()
    server = HealthServer(registry, health=lambda: (True, {}), port=9464)
    await server.start()       # GET /metrics, GET /healthz (200 healthy, 503 not, JSON details)
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import math
import re
from collections.abc import Callable, Sequence

__all__ = ["Counter", "Gauge", "HealthServer", "Histogram", "LineFormatter", "Registry"]

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Health = Callable[[], tuple[bool, dict[str, object]]]


#: C0 and C1 control characters, DEL, and the two Unicode line separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


class LineFormatter(logging.Formatter):
    """A text log of one line per record: the agent's and the central services' own.

    Log messages quote what inputs say (message ids, VM names, event ids and descriptions from
    IMDS, header names): a newline in one of them began a line of its own, which a reader (or a
    log pipeline) took for a record the process never wrote, and an escape sequence moved the
    operator's terminal. Every control character of the message is written as ``\\xNN``; a
    traceback that follows is left as Python wrote it."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = _CONTROL.sub(_visible, record.message)
        return super().formatMessage(record)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value)) if value != int(value) else f"{int(value)}.0"


class _Metric:
    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _Metric] = {}
        self._labels: tuple[str, ...] = ()

    def labels(self, *values: str) -> _Metric:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._child()
            child._labels = key
        return child

    def _child(self) -> _Metric:
        return type(self)(self.name, self.documentation, self.labelnames)

    def _label_text(self, extra: Sequence[tuple[str, str]] = ()) -> str:
        pairs = [*zip(self.labelnames, self._labels, strict=False), *extra]
        if not pairs:
            return ""
        return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"

    def _samples(self) -> list[str]:
        raise NotImplementedError

    def exposition(self) -> list[str]:
        lines = [
            f"# HELP {self.name} {_escape(self.documentation)}",
            f"# TYPE {self.name} {self.kind}",
        ]
        if self.labelnames:
            for child in self._children.values():
                lines.extend(child._samples())
        else:
            lines.extend(self._samples())
        return lines


class Counter(_Metric):
    """Only goes up; exposed as ``<name>_total``."""

    kind = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames)
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        self.value += amount

    def labels(self, *values: str) -> Counter:
        child = super().labels(*values)
        assert isinstance(child, Counter)
        return child

    def _samples(self) -> list[str]:
        return [f"{self.name}_total{self._label_text()} {_number(self.value)}"]


class Gauge(_Metric):
    """Goes up and down."""

    kind = "gauge"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames)
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def labels(self, *values: str) -> Gauge:
        child = super().labels(*values)
        assert isinstance(child, Gauge)
        return child

    def _samples(self) -> list[str]:
        return [f"{self.name}{self._label_text()} {_number(self.value)}"]


class Histogram(_Metric):
    """Counts observations into cumulative buckets; ``_bucket``, ``_sum`` and ``_count``."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    ) -> None:
        super().__init__(name, documentation, labelnames)
        self.buckets = tuple(sorted(float(b) for b in buckets))
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0

    def _child(self) -> _Metric:
        return Histogram(self.name, self.documentation, self.labelnames, buckets=self.buckets)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def labels(self, *values: str) -> Histogram:
        child = super().labels(*values)
        assert isinstance(child, Histogram)
        return child

    def _samples(self) -> list[str]:
        lines = []
        total = 0
        for bound, count in zip((*self.buckets, math.inf), self.counts, strict=True):
            total += count
            labels = self._label_text([("le", _number(bound))])
            lines.append(f"{self.name}_bucket{labels} {total}")
        lines.append(f"{self.name}_sum{self._label_text()} {_number(self.sum)}")
        lines.append(f"{self.name}_count{self._label_text()} {total}")
        return lines


class Registry:
    """The metrics of one component (never global: several agents may share a process)."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric) -> None:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} registered twice")
        self._metrics[metric.name] = metric

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
        metric = Counter(name, documentation, labelnames)
        self._add(metric)
        return metric

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        metric = Gauge(name, documentation, labelnames)
        self._add(metric)
        return metric

    def histogram(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
    ) -> Histogram:
        metric = Histogram(name, documentation, labelnames, buckets=buckets)
        self._add(metric)
        return metric

    def exposition(self) -> bytes:
        lines: list[str] = []
        for metric in self._metrics.values():
            lines.extend(metric.exposition())
        return ("\n".join(lines) + "\n").encode()

    def get_sample_value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """The value of one exposed sample (``agent_imds_errors_total`` with
        ``{"kind": "server"}``), as prometheus-client's method of the same name; None when
        there is no such sample."""
        wanted = labels or {}
        for line in self.exposition().decode().splitlines():
            if line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            sample, _, label_text = head.partition("{")
            if sample != name:
                continue
            found = dict(
                pair.split("=", 1) for pair in label_text.rstrip("}").split(",") if "=" in pair
            )
            if {k: v.strip('"') for k, v in found.items()} == wanted:
                return float(value)
        return None


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


class HealthServer:
    """``GET /metrics`` and ``GET /healthz`` on ``host:port`` (0: any free port).

    ``health()`` returns (healthy, details); ``/healthz`` answers 200 or 503 with the details
    as JSON, so a probe and a person read the same reason."""

    def __init__(
        self, registry: Registry, health: Health, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self._registry = registry
        self._health = health
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the health server is not running")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self._host, self._port)
        log.info("metrics and health on http://%s:%d/", self._host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5):
                request_line = await reader.readline()
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
            parts = request_line.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) >= 2 else ""
            if len(parts) < 2 or parts[0] != "GET":
                status, ctype, body = 405, "text/plain", b"only GET\n"
            elif path == "/metrics":
                status, ctype, body = 200, CONTENT_TYPE, self._registry.exposition()
            elif path == "/healthz":
                healthy, details = self._health()
                status, ctype = (200 if healthy else 503), "application/json"
                body = json.dumps({"healthy": healthy, **details}, default=str).encode()
            else:
                status, ctype, body = 404, "text/plain", b"not found\n"
            writer.write(
                f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError, ValueError) as exc:
            log.debug("metrics request dropped: %r", exc)
        finally:
            writer.close()
