"""A lost RabbitMQ link is tried again less often the longer it stays down, and a new outage
starts again at the first interval.

Every agent of a fleet loses its link when the broker restarts. Tried again every 0.5 s for as
long as it is down, 10,000 agents would try 20,000 times a second, against a node that is
starting up; the transport waits ``reconnect_interval`` at first, then an eighth of the time
the link has been down, at most ``reconnect_max_interval``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator

import pytest

from schemas.transport.rabbitmq import AmqpSettings

from ._helpers import outgoing, proxied_rabbitmq


@contextlib.asynccontextmanager
async def attempts_on(port: int) -> AsyncIterator[list[float]]:
    """While the proxy is cut, a listener on its port that ends every connection at once,
    resetting one and closing the next (a load balancer before a broker that is down), noting
    when each came (the event loop's clock)."""
    loop = asyncio.get_running_loop()
    times: list[float] = []

    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        times.append(loop.time())
        if len(times) % 2:
            writer.transport.abort()
        else:  # the client's protocol header read, then closed: an end, not a reset
            await reader.read(8)
            writer.close()

    server = await asyncio.start_server(reset, "127.0.0.1", port)
    try:
        yield times
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.rabbitmq
@pytest.mark.slow
async def test_a_long_outage_is_tried_less_and_less_often_and_the_next_one_afresh(
    amqp_url: str, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="schemas.transport.rabbitmq")
    caplog.set_level(logging.WARNING, logger="aio_pika.robust_connection")
    settings = AmqpSettings(
        reconnect_interval=0.2, reconnect_max_interval=1.0, connect_timeout=2, reconnect_timeout=30
    )
    loop = asyncio.get_running_loop()
    async with proxied_rabbitmq(amqp_url, unique, settings) as (proxy, transport):
        await transport.declare_group("g")
        await transport.publish(outgoing("before"))
        await proxy.cut()
        async with attempts_on(proxy.port) as long_outage:
            await asyncio.sleep(10)
        await proxy.restore()
        came_back = loop.time()
        await transport.publish(outgoing("after the long outage"))
        back_after = loop.time() - came_back
        await proxy.cut()
        async with attempts_on(proxy.port) as short_outage:
            await asyncio.sleep(1.5)
        await proxy.restore()
        await transport.publish(outgoing("after the short outage"))
    gaps = [later - earlier for earlier, later in itertools.pairwise(long_outage)]
    print(
        f"\n10 s down: {len(long_outage)} attempts, waits {gaps[0]:.2f} s growing to "
        f"{gaps[-1]:.2f} s; published {back_after:.2f} s after the link came back; 1.5 s down "
        f"next: {len(short_outage)} attempts"
    )
    # Every ~0.2 s for 10 s would be about 50 attempts; growing to 1 s, about 24.
    assert len(long_outage) <= 32, gaps
    assert gaps[0] < 0.4, gaps
    assert max(gaps[-3:]) >= 0.75, gaps  # ten seconds down: the longest wait, 1 s +/-20 %
    assert max(gaps) <= 1.5, gaps  # never past it
    assert back_after < 3.5  # one wait at most (1.2 s), then the connect and the publish
    assert len(short_outage) >= 4, short_outage  # afresh: every ~0.2 s again
    assert "reconnecting every ~0.2 s at first, less often the longer it is down (at most " in (
        caplog.text
    )
    # Each reason a reconnect failed for is said once an outage, though they alternate here (a
    # reset, or a connection closed before the broker's first byte): two outages, two reasons
    # (the code before said one at each change of reason: 30 lines).
    failed = [r for r in caplog.records if "cannot connect to RabbitMQ" in r.getMessage()]
    assert 1 <= len(failed) <= 4, [r.getMessage() for r in failed]
