"""A fleet's broker links cut together, then restored: how often the transports try the broker
while it is away, and how their comeback spreads.

``--agents`` RabbitMQ transports (the code every agent runs, one connection each) connect to
the real RabbitMQ through one TCP proxy. The proxy cuts every link and, for ``--outage``
seconds, takes each new connection and resets it at once (the broker's host up, the broker
not), counting the attempts; then it forwards again, and every transport publishes one message.
The run measures the attempts a second during the outage, and from the restore to each
transport's publish confirmed.

    python tests/benchmarks/reconnect_storm.py [--agents 300] [--outage 60] [--broker URL]

Prints figures; asserts nothing (a benchmark, not a test). Loopback only; bounded by the
outage and the transports' ``reconnect_timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).parents[2]))

from schemas.channels import ChannelNames
from schemas.transport.rabbitmq import RabbitMQTransport
from tests.transport._helpers import outgoing, via_proxy
from tests.transport.proxy import TcpProxy

URL = os.environ.get("RELAY_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


async def _connect_all(url: str, channels: ChannelNames, count: int) -> list[RabbitMQTransport]:
    transports = [RabbitMQTransport(url, channels) for _ in range(count)]
    for offset in range(0, count, 50):  # a fleet does not start in one second either
        await asyncio.gather(*(t.connect() for t in transports[offset : offset + 50]))
    return transports


async def measure(broker: str, agents: int, outage: float) -> None:
    split = urlsplit(broker)
    channels = ChannelNames().suffixed(f"storm-{uuid.uuid4().hex[:8]}")
    loop = asyncio.get_running_loop()
    async with TcpProxy(split.hostname or "127.0.0.1", split.port or 5672) as proxy:
        url = via_proxy(broker, proxy.port)
        started = time.perf_counter()
        transports = await _connect_all(url, channels, agents)
        print(f"{agents} transports connected in {time.perf_counter() - started:.1f} s")
        try:
            await proxy.cut()
            attempts: list[float] = []

            async def reset(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                attempts.append(loop.time())
                writer.transport.abort()

            cut_at = loop.time()
            refuser = await asyncio.start_server(reset, "127.0.0.1", proxy.port)
            await asyncio.sleep(outage)
            refuser.close()
            await refuser.wait_closed()
            await proxy.restore()
            restored_at = loop.time()
            accepted_before = proxy.accepted

            async def back(transport: RabbitMQTransport) -> float:
                await transport.publish(outgoing("back"))
                return loop.time() - restored_at

            comeback = sorted(await asyncio.gather(*(back(t) for t in transports)))
            reconnected = proxy.accepted - accepted_before
        finally:
            await transports[0].delete_topology(exchanges=True)
            await asyncio.gather(*(t.close() for t in transports), return_exceptions=True)
    first = sum(1 for t in attempts if t - cut_at < 10)
    last = sum(1 for t in attempts if t - cut_at >= outage - 10)
    per_agent = len(attempts) / agents
    print(
        f"outage {outage:g} s: {len(attempts)} connection attempts ({per_agent:.1f} per agent, "
        f"{len(attempts) / outage:.0f} a second); first 10 s {first / 10:.0f}/s, last 10 s "
        f"{last / 10:.0f}/s"
    )
    print(
        f"restore -> publish confirmed, {agents} transports: p50 {statistics.median(comeback):.2f}"
        f" s, p99 {comeback[int(0.99 * (len(comeback) - 1))]:.2f} s, max {comeback[-1]:.2f} s "
        f"({reconnected} connections through the proxy after the restore)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=300)
    parser.add_argument("--outage", type=float, default=60.0, help="seconds (default 60)")
    parser.add_argument("--broker", default=URL)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # each transport says its lost link: 300 times
    if args.agents < 1 or not 0 < args.outage <= 3600:
        parser.error("--agents must be at least 1 and --outage within (0, 3600] seconds")
    asyncio.run(measure(args.broker, args.agents, args.outage))


if __name__ == "__main__":
    main()
