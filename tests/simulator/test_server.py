"""serve(): a real socket on a free port, several at once, a clean stop."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from publisher.simulator import Simulator, create_app, serve

from .conftest import HEADERS

SE = "/metadata/scheduledevents?api-version=2020-07-01"


async def test_port_zero_gives_a_real_port_and_exit_closes_it() -> None:
    sim = Simulator(vms=["a", "b"])
    async with serve(sim) as server:
        assert server.port > 0
        assert server.base_url == f"http://127.0.0.1:{server.port}"
        assert server.vm_url("b") == f"{server.base_url}/vm/b"
        async with httpx.AsyncClient(timeout=5) as client:
            response = await client.get(server.vm_url("b") + SE, headers=HEADERS)
            assert response.status_code == 200
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()


async def test_two_simulators_side_by_side() -> None:
    async with serve(Simulator(vms=["x"])) as one, serve(Simulator(vms=["y"])) as two:
        assert one.port != two.port
        async with httpx.AsyncClient(timeout=5) as client:
            names = await asyncio.gather(
                *(
                    client.get(
                        f"{s.base_url}/metadata/instance?api-version=2021-02-01", headers=HEADERS
                    )
                    for s in (one, two)
                )
            )
        assert [r.json()["compute"]["name"] for r in names] == ["x", "y"]


async def test_a_taken_port_raises_oserror() -> None:
    async with serve(Simulator(vms=["a"])) as server:
        with pytest.raises(OSError, match="in use"):
            async with serve(Simulator(vms=["a"]), port=server.port):
                pass


async def test_exit_with_an_open_keep_alive_connection_is_prompt() -> None:
    async with serve(Simulator(vms=["a"])) as server:
        client = httpx.AsyncClient(base_url=server.base_url, timeout=5)
        await client.get(SE, headers=HEADERS)
        loop = asyncio.get_running_loop()
        started = loop.time()
    assert loop.time() - started < 3
    await client.aclose()


async def test_create_app_works_without_a_socket() -> None:
    sim = Simulator(vms=["a"])
    transport = httpx.ASGITransport(app=create_app(sim))
    async with httpx.AsyncClient(transport=transport, base_url="http://imds") as client:
        response = await client.get(SE, headers=HEADERS)
    assert response.json() == {"DocumentIncarnation": 1, "Events": []}
