"""Service Bus under a storm of connections: N transports in one process (the real SDK) start
at once, each doing what an agent does when a wave reaches a fleet: ``connect()`` (the start-up
check), then one publish, each step under the outbox's own deadline (``--deadline``, the
agent's ``--publish-timeout``), tried again 0.3 s after a failure, until it goes through.

In one interpreter the SDK's openings take turns on one core, so N openings at once take far
longer than one: this is how a slow namespace looks to every agent. It prints when each publish
went through and how many tries it took; with a deadline that threw away every opening half
done, the last one took minutes (or never came).

    python tests/benchmarks/servicebus_burst.py --transports 500

Prints a table, then its figures as one JSON line. The double runs in a process of its own
(``tests/benchmarks/servicebus_capacity.py``'s ``DoubleProcess``); loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from schemas import ChannelNames, RelayError
from schemas.transport.servicebus import ServiceBusTransport
from tests.benchmarks.servicebus_capacity import DoubleProcess
from tests.transport._helpers import outgoing


async def _agent(
    address: str, channels: ChannelNames, n: int, deadline: float, began: float
) -> tuple[float, int]:
    transport = ServiceBusTransport(address, channels)
    tries = 0
    try:
        while True:
            tries += 1
            try:
                await asyncio.wait_for(transport.connect(), deadline)
                await asyncio.wait_for(transport.publish(outgoing(f"agent {n}")), deadline)
                return time.monotonic() - began, tries
            except (RelayError, TimeoutError):
                await asyncio.sleep(0.3)
    finally:
        await transport.close()


async def measure(transports: int, deadline: float, limit: float) -> dict[str, object]:
    channels = ChannelNames().suffixed(f"burst-{uuid.uuid4().hex[:6]}")
    async with DoubleProcess(channels, "approver", plain=("audit",)) as double:
        began = time.monotonic()
        tasks = [
            asyncio.ensure_future(_agent(double.connection_string, channels, n, deadline, began))
            for n in range(transports)
        ]
        done, pending = await asyncio.wait(tasks, timeout=limit)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    results = sorted(task.result() for task in done if task.exception() is None)
    seconds = [r[0] for r in results]

    def at(q: float) -> float | None:
        return round(seconds[min(len(seconds) - 1, int(q * len(seconds)))], 1) if seconds else None

    return {
        "transports": transports,
        "deadline_s": deadline,
        "published": len(results),
        "p50_s": at(0.5),
        "last_s": round(seconds[-1], 1) if seconds else None,
        "max_tries": max((r[1] for r in results), default=None),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", type=int, default=500)
    parser.add_argument("--deadline", type=float, default=10.0, help="seconds per attempt")
    parser.add_argument("--limit", type=float, default=180.0, help="give up after (seconds)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    figures = asyncio.run(measure(args.transports, args.deadline, args.limit))
    print(
        f"{figures['published']}/{args.transports} published within {args.limit:g} s "
        f"(each attempt under {args.deadline:g} s): half by {figures['p50_s']} s, the last at "
        f"{figures['last_s']} s, after at most {figures['max_tries']} tries"
    )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
