"""Load test of the IMDS simulator in fleet mode: how many polls per second one process serves.

Starts ``python -m publisher.simulator`` as a subprocess with a fleet (10,000 VMs by default,
throttling off), optionally schedules some events so that part of the fleet gets non-empty
documents, then drives it over loopback with many keep-alive connections, each polling
``/vm/{name}/metadata/scheduledevents`` for VMs taken in turn across the fleet, for a bounded
time. Prints polls/s, latency percentiles, errors and the CPU each side used. Client and server
share the machine's cores, so on a small machine the figure is a floor, not a ceiling.

    python tests/benchmarks/simulator_load.py --vms 10000 --duration 20 --connections 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[2]
API = "api-version=2020-07-01"


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    errors: int = 0
    bytes: int = 0


@contextlib.asynccontextmanager
async def simulator(vms: int, startup_limit: float) -> AsyncIterator[tuple[str, int, float]]:
    """Start the simulator; yield (base URL, pid, seconds it took to print its first line)."""
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "publisher.simulator",
        "--port",
        "0",
        "--fleet",
        str(vms),
        "--rate-limit",
        "0",
        "--log-level",
        "warning",
        "--seed",
        "1",
        stdout=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), timeout=startup_limit)).decode()
        if not line.startswith("listening on "):
            raise RuntimeError(f"unexpected first line from the simulator: {line!r}")
        yield line.removeprefix("listening on ").strip(), process.pid, time.perf_counter() - started
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), timeout=10)
            except TimeoutError:
                process.kill()
                await process.wait()


async def schedule_events(base_url: str, names: list[str], count: int) -> None:
    """``count`` events, each for a slice of 1 to 4 VMs, spread over the fleet; far NotBefore."""
    if count == 0:
        return
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        step = max(1, len(names) // count)
        for i in range(count):
            first = (i * step) % len(names)
            resources = names[first : first + 1 + i % 4]
            body = {"EventType": "Freeze", "Resources": resources, "NotBeforeSeconds": 86_400}
            response = await client.post("/admin/events", json=body)
            response.raise_for_status()


def vm_cycle(names: list[str], offset: int) -> Iterator[str]:
    return itertools.islice(itertools.cycle(names), offset, None)


async def poller(
    host: str, port: int, names: Iterator[str], stop_at: float, tally: Tally, record: bool
) -> None:
    """One keep-alive connection polling until ``stop_at``; reconnects after an error."""
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    loop = asyncio.get_running_loop()
    try:
        while loop.time() < stop_at:
            if connection is None:
                connection = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
            reader, writer = connection
            name = next(names)
            request = (
                f"GET /vm/{name}/metadata/scheduledevents?{API} HTTP/1.1\r\n"
                f"Host: {host}:{port}\r\nMetadata: true\r\n\r\n"
            ).encode()
            sent = time.perf_counter()
            try:
                writer.write(request)
                status, body_length = await asyncio.wait_for(read_response(reader), timeout=10)
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
                tally.errors += 1
                writer.close()
                connection = None
                continue
            if record:
                tally.latencies.append(time.perf_counter() - sent)
                tally.statuses[status] = tally.statuses.get(status, 0) + 1
                tally.bytes += body_length
    finally:
        if connection is not None:
            connection[1].close()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, int]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length = 0
    for line in lines[1:]:
        if line[:15].lower() == "content-length:":
            length = int(line[15:].strip())
    body = await reader.readexactly(length)
    if status == 200:
        json.loads(body)  # the client checks what it gets, like an agent would
    return status, length


async def measure(args: argparse.Namespace) -> dict[str, object]:
    names = [f"fleet_{i}" for i in range(args.vms)]
    async with simulator(args.vms, startup_limit=60) as (base_url, pid, startup):
        host, port = base_url.removeprefix("http://").rsplit(":", 1)
        await schedule_events(base_url, names, args.events)
        loop = asyncio.get_running_loop()
        server, me = psutil.Process(pid), psutil.Process(os.getpid())

        # Warm up (connections, caches), then measure on fresh counters.
        warm = Tally()
        warm_until = loop.time() + args.warmup
        await asyncio.gather(
            *(
                poller(host, int(port), vm_cycle(names, i * 97), warm_until, warm, False)
                for i in range(args.connections)
            )
        )
        tally = Tally()
        server_cpu0, my_cpu0 = server.cpu_times(), me.cpu_times()
        began = time.perf_counter()
        stop_at = loop.time() + args.duration
        await asyncio.gather(
            *(
                poller(host, int(port), vm_cycle(names, i * 131), stop_at, tally, True)
                for i in range(args.connections)
            )
        )
        elapsed = time.perf_counter() - began
        server_cpu1, my_cpu1 = server.cpu_times(), me.cpu_times()
        rss = server.memory_info().rss

    latencies = sorted(tally.latencies)
    polls = len(latencies)

    def percentile(p: float) -> float:
        return latencies[min(polls - 1, int(p * polls))] * 1000 if polls else float("nan")

    return {
        "vms": args.vms,
        "events": args.events,
        "connections": args.connections,
        "duration_s": round(elapsed, 2),
        "startup_s": round(startup, 2),
        "polls": polls,
        "polls_per_s": round(polls / elapsed, 1),
        "p50_ms": round(percentile(0.50), 2),
        "p99_ms": round(percentile(0.99), 2),
        "mean_ms": round(statistics.fmean(latencies) * 1000, 2) if polls else None,
        "statuses": tally.statuses,
        "errors": tally.errors,
        "server_cpu_pct": round(100 * (sum(server_cpu1[:2]) - sum(server_cpu0[:2])) / elapsed, 1),
        "client_cpu_pct": round(100 * (sum(my_cpu1[:2]) - sum(my_cpu0[:2])) / elapsed, 1),
        "server_rss_mb": round(rss / 2**20, 1),
        "cores": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--vms", type=int, default=10_000, help="fleet size (default 10000)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds measured (20)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before measuring (2)")
    parser.add_argument("--connections", type=int, default=64, help="concurrent clients (64)")
    parser.add_argument(
        "--events", type=int, default=200, help="events scheduled across the fleet first (200)"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON only")
    args = parser.parse_args(argv)
    if min(args.vms, args.connections) < 1 or args.duration <= 0 or args.events < 0:
        parser.error("--vms and --connections must be >= 1, --duration > 0, --events >= 0")
    result = asyncio.run(measure(args))
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{result['polls_per_s']} polls/s over {result['duration_s']} s"
        f" ({result['polls']} polls, {result['connections']} connections,"
        f" {result['vms']} VMs, {result['events']} events)"
    )
    print(
        f"latency p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms,"
        f" mean {result['mean_ms']} ms; statuses {result['statuses']}, errors {result['errors']}"
    )
    print(
        f"server: started in {result['startup_s']} s, CPU {result['server_cpu_pct']} %,"
        f" RSS {result['server_rss_mb']} MB; client CPU {result['client_cpu_pct']} %;"
        f" {result['cores']} cores shared"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
