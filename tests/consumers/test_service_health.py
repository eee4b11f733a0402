"""The central services' ``/healthz`` tells the truth: 503 with the reason once the broker has
been unreachable for longer than ``--health-grace``, healthy again on recovery. The audit
service as an operator runs it (a subprocess), its broker link through a TCP proxy that the
test cuts, on the real RabbitMQ."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from schemas import ChannelNames
from schemas.transport.rabbitmq import RabbitMQTransport
from tests.transport.proxy import TcpProxy

pytestmark = [pytest.mark.rabbitmq]

ROOT = Path(__file__).parents[2]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def _health(port: int) -> tuple[int, dict[str, Any]] | None:
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=3) as client:
            answer = await client.get(f"http://127.0.0.1:{port}/healthz")
    except httpx.HTTPError:
        return None
    return answer.status_code, answer.json()


async def _until_status(port: int, status: int, within: float, **details: object) -> dict[str, Any]:
    """The health answer once it has ``status`` and the ``details`` given (a service is
    healthy while it starts, within its grace, before it has subscribed)."""
    async with asyncio.timeout(within):
        while True:
            answer = await _health(port)
            if (
                answer is not None
                and answer[0] == status
                and all(answer[1].get(k) == v for k, v in details.items())
            ):
                return answer[1]
            await asyncio.sleep(0.2)


async def test_the_audit_health_turns_503_during_an_outage_and_back(
    amqp_url: str, unique: str, tmp_path: Path
) -> None:
    split = urlsplit(amqp_url)
    port = _free_port()
    log = tmp_path / "audit.log"
    async with TcpProxy(split.hostname or "127.0.0.1", split.port or 5672) as proxy:
        proxied = f"amqp://guest:guest@127.0.0.1:{proxy.port}/"
        with log.open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "consumers", "audit",
                "--broker", proxied, "--channel-suffix", unique, "--origin", "any",
                "--db", str(tmp_path / "audit.db"),
                "--health-port", str(port), "--health-grace", "2",
                cwd=ROOT, stderr=stderr, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
        try:
            healthy = await _until_status(port, 200, within=30, subscribed=True)
            assert healthy["subscribed"] is True

            await proxy.cut()
            started = asyncio.get_running_loop().time()
            down = await _until_status(port, 503, within=20)
            took = asyncio.get_running_loop().time() - started
            assert "broker" in down["reason"], down
            assert took >= 1.5, f"503 after {took:.1f} s: before the 2 s grace"

            await proxy.restore()
            again = await _until_status(port, 200, within=30)
            assert "reason" not in again
        finally:
            process.terminate()
            async with asyncio.timeout(20):
                await process.wait()
            channels = ChannelNames().suffixed(unique)
            async with RabbitMQTransport(amqp_url, channels) as transport:
                await transport.delete_topology(groups=["audit"], exchanges=True)
    assert process.returncode == 0, log.read_text()
