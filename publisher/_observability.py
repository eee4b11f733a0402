"""Metrics and health: a Prometheus registry per agent, served with ``/healthz`` on a local port.

Each :class:`Metrics` has its own ``CollectorRegistry`` (never the global one), so several agents
in one process (the demo) do not clash. The HTTP server is a few lines of asyncio: the agent does
not need a web framework.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["Metrics", "MetricsServer"]

log = logging.getLogger(__name__)


class Metrics:
    """Everything the agent counts."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.polls = Counter("agent_imds_polls", "Scheduled Events GETs answered", registry=r)
        self.imds_errors = Counter(
            "agent_imds_errors", "IMDS requests that failed, by kind", ["kind"], registry=r
        )
        self.transitions = Counter(
            "agent_transitions", "Transitions published, by kind", ["kind"], registry=r
        )
        self.published = Counter(
            "agent_messages_published", "Messages confirmed by the broker", ["kind"], registry=r
        )
        self.publish_failures = Counter(
            "agent_publish_failures", "Publish attempts the broker did not confirm", registry=r
        )
        self.publish_latency = Histogram(
            "agent_publish_latency_seconds",
            "From entering the outbox to the broker's confirm",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.outbox_depth = Gauge(
            "agent_outbox_depth", "Messages waiting for a confirm", registry=r
        )
        self.outbox_dropped = Counter(
            "agent_outbox_dropped", "Heartbeats dropped because the outbox was full", registry=r
        )
        self.approvals_applied = Counter(
            "agent_approvals_applied", "Approvals POSTed to IMDS", registry=r
        )
        self.approvals_rejected = Counter(
            "agent_approvals_rejected", "Approvals refused, by reason", ["reason"], registry=r
        )
        self.hooks = Counter("agent_hooks", "Hooks run, by result", ["result"], registry=r)
        self.last_poll = Gauge(
            "agent_last_successful_poll_timestamp", "Unix time of the last good poll", registry=r
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """``GET /metrics`` and ``GET /healthz`` on ``host:port`` (0: any free port).

    ``health()`` returns (healthy, details); ``/healthz`` answers 200 or 503 with the details.
    """

    def __init__(
        self,
        metrics: Metrics,
        health: Callable[[], tuple[bool, dict[str, object]]],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self._metrics = metrics
        self._health = health
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the metrics server is not running")
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
                status, ctype, body = 200, CONTENT_TYPE_LATEST, self._metrics.exposition()
            elif path == "/healthz":
                healthy, details = self._health()
                status, ctype = (200 if healthy else 503), "application/json"
                body = json.dumps({"healthy": healthy, **details}).encode()
            else:
                status, ctype, body = 404, "text/plain", b"not found\n"
            reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}.get(
                status, "Service Unavailable"
            )
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError) as exc:
            log.debug("metrics request dropped: %r", exc)
        finally:
            writer.close()
