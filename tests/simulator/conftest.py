"""Fixtures for the simulator tests: a simulator served on 127.0.0.1:0 and an httpx client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from publisher.simulator import (
    LATEST_SCHEDULED_EVENTS_VERSION,
    Clock,
    ManualClock,
    Simulator,
    SimulatorConfig,
    SimulatorServer,
    serve,
)

HEADERS = {"Metadata": "true"}


async def idle_then_ask_again(port: int, idle: float) -> bytes:
    """One GET on a new connection, ``idle`` seconds of quiet, then a second GET on the same
    connection: what the server answers it (b"" when it closed the connection meanwhile)."""
    request = (
        b"GET /metadata/scheduledevents?api-version=2020-07-01 HTTP/1.1\r\n"
        b"Host: imds\r\nMetadata: true\r\n\r\n"
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
        assert head.startswith(b"HTTP/1.1 200"), head
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        await asyncio.sleep(idle)
        try:
            writer.write(request)
            return await asyncio.wait_for(reader.read(12), timeout=5)
        except ConnectionError:
            return b""
    finally:
        writer.close()


@dataclass
class Harness:
    """A served simulator and a client for it."""

    sim: Simulator
    server: SimulatorServer
    client: httpx.AsyncClient

    def se_path(self, vm: str | None, version: str = LATEST_SCHEDULED_EVENTS_VERSION) -> str:
        prefix = "" if vm is None else f"/vm/{vm}"
        return f"{prefix}/metadata/scheduledevents?api-version={version}"

    async def document(
        self, vm: str | None = None, version: str = LATEST_SCHEDULED_EVENTS_VERSION
    ) -> dict[str, Any]:
        response = await self.client.get(self.se_path(vm, version), headers=HEADERS)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    async def approve(self, vm: str | None, *event_ids: str) -> httpx.Response:
        body = {"StartRequests": [{"EventId": e} for e in event_ids]}
        return await self.client.post(self.se_path(vm), headers=HEADERS, json=body)


HarnessFactory = Callable[..., contextlib.AbstractAsyncContextManager[Harness]]


@contextlib.asynccontextmanager
async def running(
    vms: Iterable[str] = ("vm0", "vm1", "vm2"),
    *,
    clock: Clock | None = None,
    **config: Any,
) -> AsyncIterator[Harness]:
    """Serve a new simulator (rate limit off unless given) and yield it with a client."""
    config.setdefault("rate_limit", 0)
    sim = Simulator(SimulatorConfig(**config), clock=clock, vms=vms)
    async with (
        serve(sim) as server,
        httpx.AsyncClient(base_url=server.base_url, timeout=10.0) as client,
    ):
        yield Harness(sim, server, client)


@pytest.fixture
def make_harness() -> HarnessFactory:
    """``async with make_harness(vms=[...], speed=60, clock=...) as h:``."""
    return running


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def harness(clock: ManualClock) -> AsyncIterator[Harness]:
    """Three VMs (vm0 first), speed 1, rate limit off, time moved by hand with ``clock``."""
    async with running(clock=clock) as h:
        yield h
