"""serve(): a real socket on a free port, several at once, a clean stop."""

from __future__ import annotations

import asyncio
import logging
import socket

import httpx
import pytest

from publisher.simulator import Simulator, create_app, serve

from .conftest import HEADERS, idle_then_ask_again

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


async def test_an_idle_connection_is_kept_for_keep_alive_seconds() -> None:
    """A VM polling less often than the server keeps its connection opens one per poll: the
    keep-alive is the server's to choose (an IMDS stand-in serving many slow pollers)."""
    async with serve(Simulator(vms=["a"]), keep_alive_seconds=1) as short:
        assert await idle_then_ask_again(short.port, 1.6) == b""
    async with serve(Simulator(vms=["a"]), keep_alive_seconds=4) as long:
        assert await idle_then_ask_again(long.port, 1.6) == b"HTTP/1.1 200"
    with pytest.raises(ValueError, match="keep_alive_seconds must be at least 1"):
        async with serve(Simulator(vms=["a"]), keep_alive_seconds=0):
            pass


async def test_create_app_works_without_a_socket() -> None:
    sim = Simulator(vms=["a"])
    transport = httpx.ASGITransport(app=create_app(sim))
    async with httpx.AsyncClient(transport=transport, base_url="http://imds") as client:
        response = await client.get(SE, headers=HEADERS)
    assert response.json() == {"DocumentIncarnation": 1, "Events": []}


async def test_a_stop_answers_the_requests_a_fault_holds_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request held by a hang (``delay_seconds``) or a drip when the simulator stopped: the
    stop waited out the graceful-shutdown time (5 s by default; here 60), then cancelled the
    request, which the client saw as a 500 and the log as a traceback ("Task cancelled,
    timeout graceful shutdown exceeded": the fault storm's end). Now a stop ends them at once:
    the hung request is answered 503 (the simulator is stopping), the dripping one gets the
    rest of its body, and nothing is logged as an error."""
    from publisher.simulator._faults import FaultSpec

    sim = Simulator(vms=["a", "b"])
    answers: dict[str, httpx.Response] = {}

    async def get(vm: str, client: httpx.AsyncClient, url: str) -> None:
        answers[vm] = await client.get(url + SE, headers=HEADERS)

    with caplog.at_level(logging.WARNING):
        async with (
            asyncio.timeout(30),
            httpx.AsyncClient(timeout=120) as client,
            asyncio.TaskGroup() as requests,
            serve(sim, shutdown_timeout=60) as server,
        ):
            sim.add_fault(FaultSpec(vm="a", delay_seconds=600))
            sim.add_fault(FaultSpec(vm="b", drip_seconds=5))
            for vm in ("a", "b"):
                requests.create_task(get(vm, client, server.vm_url(vm)))
            await asyncio.sleep(1)  # both held: a hung, b dripping
            assert not answers
    assert answers["a"].status_code == 503
    assert "stopping" in answers["a"].json()["error"]
    assert answers["b"].status_code == 200
    assert answers["b"].json()["DocumentIncarnation"] >= 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
