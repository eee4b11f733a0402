"""/healthz tells the truth: 503 with the reason once the broker has been unreachable (or IMDS
failing) for longer than the grace, the live outbox depth and the age of its oldest message in
every answer, healthy again on recovery. RabbitMQ behind a TCP proxy that cuts the link."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from publisher import Agent
from publisher.simulator import EventSpec, EventType, FaultSpec
from schemas import MessageType, TransportError
from schemas.channels import ChannelNames
from schemas.transport import MemoryTransport
from tests.transport.proxy import TcpProxy

from .conftest import delete_rabbitmq_entities
from .harness import eventually, recorder, running, settings_for, simulator_server

pytestmark = [pytest.mark.rabbitmq]


async def _health(port: int | None) -> tuple[int, dict[str, Any]]:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        answer = await client.get(f"http://127.0.0.1:{port}/healthz")
    return answer.status_code, answer.json()


async def test_a_broker_outage_longer_than_the_grace_is_unhealthy_and_recovery_is_healthy(
    amqp_url: str, unique: str, tmp_path: Path
) -> None:
    channels = ChannelNames().suffixed(unique)
    split = urlsplit(amqp_url)
    try:
        async with (
            TcpProxy(split.hostname or "127.0.0.1", split.port or 5672) as proxy,
            simulator_server("web-7") as server,
            recorder(amqp_url, channels) as rec,
        ):
            proxied = f"amqp://guest:guest@127.0.0.1:{proxy.port}/?reconnect_timeout=1"
            grace = 3.0
            settings = settings_for(
                server, "web-7", proxied, channels, tmp_path, metrics_port=0, health_grace=grace
            )
            sim = server.simulator
            async with running(settings) as agent:
                assert (await _health(agent.metrics_port))[0] == 200
                await proxy.cut()
                sim.add_event(EventSpec(event_type=EventType.FREEZE, not_before_seconds=900))
                cut_at = time.monotonic()
                # Within the grace a blip is not an outage; the new event waits in the outbox
                # and is counted as soon as the agent's next poll found it (a loaded machine
                # may take more than a second for that poll).
                async with asyncio.timeout(grace - 0.5):
                    while True:
                        status, early = await _health(agent.metrics_port)
                        assert status == 200, early
                        if early["outbox_depth"] == 1:
                            break
                        await asyncio.sleep(0.1)
                await asyncio.sleep(max(0.0, cut_at + grace + 1.5 - time.monotonic()))
                status, down = await _health(agent.metrics_port)
                assert status == 503, down
                assert any("broker unreachable" in str(r) for r in down["reasons"])
                assert down["outbox_depth"] >= 1  # live, not as of the last commit
                oldest = down["outbox_oldest_seconds"]
                assert isinstance(oldest, float)
                # Written when that poll found the event: at most grace - 0.5 s after the cut.
                assert oldest >= time.monotonic() - cut_at - (grace - 0.5)
                await proxy.restore()
                await rec.wait_kind(MessageType.SCHEDULED, within=15)

                async def healthy() -> bool:
                    return (await _health(agent.metrics_port))[0] == 200

                async with asyncio.timeout(10):
                    while not await healthy():  # noqa: ASYNC110 - polls another component
                        await asyncio.sleep(0.2)
                _, up = await _health(agent.metrics_port)
        assert up["outbox_depth"] == 0
        assert up["reasons"] == []
    finally:
        await delete_rabbitmq_entities(amqp_url, channels, ["web-7"])


async def test_imds_failing_longer_than_the_grace_is_unhealthy(tmp_path: Path) -> None:
    broker, channels = "memory://health-imds", ChannelNames().suffixed("health-imds")
    async with simulator_server("web-7") as server, recorder(broker, channels):
        sim = server.simulator
        settings = settings_for(
            server,
            "web-7",
            broker,
            channels,
            tmp_path,
            metrics_port=0,
            health_grace=1.5,
            poll_interval=0.2,
        )
        async with running(settings) as agent:
            sim.add_fault(FaultSpec(vm="web-7", endpoint="scheduledevents", status=500, times=1000))
            await asyncio.sleep(3.0)
            status, details = await _health(agent.metrics_port)
            sim.clear_faults()
            await eventually(lambda: agent.health()[0], 15)
            recovered, _ = await _health(agent.metrics_port)
    assert status == 503
    assert any("IMDS failing" in str(r) for r in details["reasons"])
    assert recovered == 200


class _CancelAsLinkError:
    """An approvals subscription that never opens and, when cancelled, raises a link error
    instead: what aiormq did when a cancel cut into a channel's opening."""

    async def __aenter__(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError as exc:
            raise TransportError("opening a consumer channel failed: CHANNEL_ERROR") from exc

    async def __aexit__(self, *exc: object) -> None:
        return None


async def test_a_stop_is_never_lost_in_a_library_that_disguises_its_cancel(
    tmp_path: Path,
) -> None:
    """A stop cancels the agent's parts; a cancel that comes back as a TransportError must not
    be taken for a lost link and retried for ever (the agent then never exits). Fault
    injection: the memory transport with a subscription that disguises its cancel (the real
    cause, on RabbitMQ, is tested in tests/transport/test_rabbitmq.py)."""
    unique = uuid.uuid4().hex[:8]

    class Disguising(MemoryTransport):
        def approvals(self, vm: str, *, prefetch: int = 8) -> Any:
            return _CancelAsLinkError()

    transport = Disguising(unique, ChannelNames().suffixed(unique))
    async with simulator_server("web-7") as server:
        settings = settings_for(
            server,
            "web-7",
            f"memory://{unique}",
            ChannelNames().suffixed(unique),
            tmp_path,
            approvals_listen="always",
            drain_timeout=2.0,
        )
        agent = Agent(settings, transport=transport)
        task = asyncio.create_task(agent.run())
        await asyncio.sleep(1.0)  # connected, opening its approvals consumer
        agent.stop("test over")
        async with asyncio.timeout(10):
            await task
