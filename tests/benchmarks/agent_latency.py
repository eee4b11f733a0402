"""The agent's detection latency, CPU and memory, with the documents' own sample loop as baseline.

Runs an IMDS simulator in this process, the agent (``python -m publisher``) as a subprocess on
the real RabbitMQ with names of its own, and the documents' sample loop (``requests``, one poll
a second, print the events) as a second subprocess watching the same VM. Then:

1. idle: both run for ``--idle-seconds`` (300 by default, as the issue asks) with no event;
   CPU share of one core and RSS of each process;
2. scenario: ``--events`` events, one at a time at random moments; for each, the time from its
   creation in the simulator to the moment the broker delivered the agent's ``scheduled``
   message to a consumer here (after the publisher confirm), and for the baseline to the moment
   it printed the event. CPU and peak RSS of both during the scenario.

The agent runs as deployed (a trust key given, a state dir) with ``--fast-poll-seconds 0`` so
every detection happens at the default 1 Hz polling (otherwise each event would speed up
polling for the next ones). ``--servicebus`` runs it on the Service Bus protocol double
(``tests/servicebus_double``, in a process of its own) instead of RabbitMQ: the agent then
signs every message (signed origins) and closes its idle sender.

    python tests/benchmarks/agent_latency.py                      # the issue's 5 idle minutes
    python tests/benchmarks/agent_latency.py --idle-seconds 60 --events 40
    python tests/benchmarks/agent_latency.py --servicebus --agent-python /tmp/agent-sb/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from publisher.simulator import EventSpec, EventType, Simulator, SimulatorConfig, serve  # noqa: E402
from schemas import MessageType, decode  # noqa: E402
from schemas.approvals import write_key_pair  # noqa: E402
from schemas.channels import ChannelNames  # noqa: E402
from schemas.transport import open_transport  # noqa: E402

SAMPLE_LOOP = r"""
import sys, time, requests
url = sys.argv[1] + "/metadata/scheduledevents?api-version=2020-07-01"
seen = set()
while True:
    try:
        document = requests.get(url, headers={"Metadata": "true"}, timeout=5,
                                proxies={"http": None, "https": None}).json()
        for event in document["Events"]:
            if event["EventId"] not in seen:
                seen.add(event["EventId"])
                print(time.time(), event["EventId"], event["EventStatus"], flush=True)
    except Exception as exc:
        print("error", exc, file=sys.stderr, flush=True)
    time.sleep(1)
"""


@dataclass
class Usage:
    cpu_percent: float
    rss_mib: float
    peak_rss_mib: float


class Meter:
    """CPU share of one core and RSS of a process over a window."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0

    def start(self) -> None:
        times = self.process.cpu_times()
        self._cpu = times.user + times.system
        self._wall = time.monotonic()
        self.peak = self.process.memory_info().rss

    def sample(self) -> None:
        self.peak = max(self.peak, self.process.memory_info().rss)

    def stop(self) -> Usage:
        times = self.process.cpu_times()
        cpu = times.user + times.system - self._cpu
        wall = time.monotonic() - self._wall
        rss = self.process.memory_info().rss
        self.peak = max(self.peak, rss)
        return Usage(100 * cpu / wall, rss / 2**20, self.peak / 2**20)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def sampled(meters: list[Meter], seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for meter in meters:
            meter.sample()
        await asyncio.sleep(min(1.0, max(0.0, end - time.monotonic())))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--amqp-url",
        default=os.environ.get("RELAY_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    )
    parser.add_argument("--idle-seconds", type=float, default=300.0)
    parser.add_argument(
        "--agent-python",
        default=sys.executable,
        help="the interpreter that runs the agent: for the RSS a VM sees, one of a venv with "
        "only the agent's backend installed (python3 -m venv /tmp/agent && /tmp/agent/bin/pip "
        "install '.[rabbitmq]'); default: this interpreter, whose dev extras add modules "
        "(click, pygments) that httpx imports when present",
    )
    parser.add_argument(
        "--servicebus",
        action="store_true",
        help="run the agent on the Service Bus double instead of RabbitMQ (its interpreter "
        "needs the [servicebus] extra)",
    )
    parser.add_argument("--events", type=int, default=40)
    parser.add_argument("--poll-interval", type=float, default=1.0)
    args = parser.parse_args()

    suffix = f"bench-{uuid.uuid4().hex[:8]}"
    channels = ChannelNames().suffixed(suffix)
    vm = "bench-0"
    sim = Simulator(SimulatorConfig(speed=1.0), vms=[vm])
    processes: list[asyncio.subprocess.Process] = []
    async with contextlib.AsyncExitStack() as double_stack:
        broker = args.amqp_url
        if args.servicebus:
            from tests.benchmarks.servicebus_capacity import DoubleProcess

            double = DoubleProcess(channels, "bench", session=False)
            broker = (await double_stack.enter_async_context(double)).connection_string
        await _measure(args, broker, suffix, channels, vm, sim, processes)


async def _measure(
    args: argparse.Namespace,
    broker: str,
    suffix: str,
    channels: ChannelNames,
    vm: str,
    sim: Simulator,
    processes: list[asyncio.subprocess.Process],
) -> None:
    async with serve(sim) as server:
        consumer = open_transport(broker, channels)
        async with consumer:
            await consumer.declare_group("bench")
            received: dict[str, float] = {}
            online = asyncio.Event()

            async def consume() -> None:
                async with consumer.subscribe("bench") as subscription:
                    async for delivery in subscription:
                        now = time.time()
                        message = decode(delivery.body)
                        if message.kind is MessageType.AGENT_ONLINE:
                            online.set()
                        elif message.kind is MessageType.SCHEDULED and message.subject:
                            received.setdefault(message.subject, now)
                        await delivery.ack()

            printed: dict[str, float] = {}

            async def read_baseline(stream: asyncio.StreamReader) -> None:
                while line := await stream.readline():
                    parts = line.decode().split()
                    if len(parts) == 3:
                        printed.setdefault(parts[1], float(parts[0]))

            with contextlib.ExitStack() as stack:
                state = stack.enter_context(_tempdir())
                _, trust_key = write_key_pair(Path(stack.enter_context(_tempdir())))
                consumer_task = asyncio.create_task(consume())
                agent = await asyncio.create_subprocess_exec(
                    args.agent_python, "-m", "publisher",
                    "--imds-url", server.vm_url(vm),
                    "--broker", broker,
                    "--channel-suffix", suffix,
                    "--state-dir", state,
                    "--trust-key", str(trust_key),
                    "--poll-interval", str(args.poll_interval),
                    "--fast-poll-seconds", "0",
                    "--log-level", "WARNING",
                    cwd=REPO,
                )  # fmt: skip
                processes.append(agent)
                baseline = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", SAMPLE_LOOP, server.vm_url(vm),
                    stdout=asyncio.subprocess.PIPE,
                )  # fmt: skip
                processes.append(baseline)
                assert baseline.stdout is not None
                reader = asyncio.create_task(read_baseline(baseline.stdout))
                try:
                    await asyncio.wait_for(online.wait(), 30)
                    await asyncio.sleep(2)  # past start-up
                    meters = [Meter(agent.pid), Meter(baseline.pid)]
                    loaded = _backends_loaded(broker, args.agent_python)
                    print(f"idle window: {args.idle_seconds:.0f} s ...", flush=True)
                    for meter in meters:
                        meter.start()
                    await sampled(meters, args.idle_seconds)
                    idle = [meter.stop() for meter in meters]

                    print(f"scenario: {args.events} events ...", flush=True)
                    for meter in meters:
                        meter.start()
                    created: dict[str, float] = {}
                    rng = random.Random()
                    began = time.monotonic()
                    for _ in range(args.events):
                        await sampled(meters, rng.uniform(0.5, 1.5))
                        at = time.time()
                        event = sim.add_event(
                            EventSpec(event_type=EventType.FREEZE, not_before_seconds=900)
                        )
                        created[event.event_id] = at
                        async with asyncio.timeout(10):
                            while event.event_id not in received or event.event_id not in printed:  # noqa: ASYNC110 (two readers fill these)
                                await asyncio.sleep(0.01)
                        sim.cancel_event(event.event_id)
                    await sampled(meters, 1.5)
                    scenario_seconds = time.monotonic() - began
                    busy = [meter.stop() for meter in meters]
                finally:
                    for process in processes:
                        if process.returncode is None:
                            process.send_signal(signal.SIGTERM)
                    for process in processes:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(process.wait(), 20)
                    reader.cancel()
                    consumer_task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await consumer_task
                    if not args.servicebus:
                        await _cleanup(broker, channels, vm)

    agent_ms = [1000 * (received[e] - t) for e, t in created.items()]
    base_ms = [1000 * (printed[e] - t) for e, t in created.items()]
    print()
    print(
        f"agent {sys.version.split()[0]}, poll interval {args.poll_interval} s, "
        f"{len(created)} events, "
        + ("the Service Bus double" if args.servicebus else f"RabbitMQ {broker.split('@')[-1]}")
    )
    print(f"optional packages the agent imports: {', '.join(loaded) or 'none'}")
    print(f"agent exit code after SIGTERM: {agent.returncode}")
    print()
    print("detection latency (event created -> ...)           p50 ms   p99 ms   max ms")
    print(
        f"  agent: broker-confirmed message delivered  {percentile(agent_ms, 50):8.1f} "
        f"{percentile(agent_ms, 99):8.1f} {max(agent_ms):8.1f}"
    )
    print(
        f"  baseline sample loop: event printed        {percentile(base_ms, 50):8.1f} "
        f"{percentile(base_ms, 99):8.1f} {max(base_ms):8.1f}"
    )
    print(
        f"  (mean agent {statistics.mean(agent_ms):.1f} ms,"
        f" baseline {statistics.mean(base_ms):.1f} ms)"
    )
    print()
    print(
        f"CPU (% of one core) and RSS            idle {args.idle_seconds:.0f} s"
        f"                scenario {scenario_seconds:.0f} s"
    )
    for name, i in (("agent", 0), ("baseline", 1)):
        print(
            f"  {name:9s} cpu {idle[i].cpu_percent:6.3f} %  rss {idle[i].rss_mib:6.1f} MiB"
            f"     cpu {busy[i].cpu_percent:6.3f} %  peak rss {busy[i].peak_rss_mib:6.1f} MiB"
        )


def _backends_loaded(url: str, python: str) -> list[str]:
    """Which optional packages the agent's code path imports for ``url`` (another process's
    modules cannot be listed, so this repeats the agent's imports in a fresh interpreter)."""
    import subprocess

    code = (
        "import sys, publisher.__main__; from schemas.transport import open_transport; "
        f"open_transport({url!r}); "
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'aio_pika', 'azure', 'starlette', 'uvicorn', 'asyncpg'})))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    return out.stdout.split()


@contextlib.contextmanager
def _tempdir():
    import tempfile

    with tempfile.TemporaryDirectory(prefix="agent-bench-") as path:
        yield path


async def _cleanup(url: str, channels: ChannelNames, vm: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        for queue in (
            f"{channels.group_prefix}bench",
            f"{channels.group_prefix}bench.dead-letter",
            f"{channels.vm_prefix}{vm}",
            channels.unrouted,
        ):
            channel = await connection.channel()
            with contextlib.suppress(aio_pika.exceptions.AMQPError):
                await channel.queue_delete(queue)
        for exchange in (
            channels.events_exchange,
            channels.approvals_exchange,
            f"{channels.group_prefix}bench.dead-letter",
            channels.unrouted,
        ):
            channel = await connection.channel()
            with contextlib.suppress(aio_pika.exceptions.AMQPError):
                await channel.exchange_delete(exchange)


if __name__ == "__main__":
    asyncio.run(main())
