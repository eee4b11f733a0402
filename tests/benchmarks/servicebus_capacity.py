"""Service Bus capacity: the connections and receive links an idle and a busy agent hold,
measured with the real azure-servicebus SDK against the protocol double over loopback.

A namespace allows 5,000 concurrent AMQP connections and an entity 5,000 concurrent receive
requests; the double counts both (time-weighted means over each window, and peaks). Each
simulated agent is one :class:`ServiceBusTransport` used as the agent uses it:

- **idle**: ``connect()`` (the start-up check), ``agent.online``, then a heartbeat every
  ``--heartbeat`` seconds; agents start spread over two heartbeat periods, so their
  heartbeats are spread over the minute as a fleet's are;
- **busy** (``--busy`` of them, their events appearing within the first seconds of the busy
  window): it has an event to approve for the whole window: ``approvals(vm)`` open,
  ``scheduled`` published, the approval received and acked, ``approval.applied`` published,
  heartbeats as before.

One approver (in this process) reads the stream, the session-enabled ``approver``
subscription, and answers every ``scheduled`` at once; its connections are counted apart and
left out of the agents'. The agents run in ``--workers`` processes and the double in one of its
own (``python -m tests.servicebus_double --control``): the SDK spends about 25 ms of CPU to open
a connection and polls every 50 ms while it opens, so one interpreter cannot play a thousand
VMs at once. Every process follows one wall-clock schedule: start, idle window, busy window,
stop.

    python tests/benchmarks/servicebus_capacity.py [--agents 1000] [--busy 100]
        [--heartbeat 60] [--sender-idle-timeout 5] [--window 120] [--workers 2]
    python tests/benchmarks/servicebus_capacity.py --agents 200 --busy 100 \\
        --sender-idle-timeout 100000 --listen-always      # the agent before, for comparison

Prints a table, then every figure as one JSON line. Asserts nothing (a benchmark, not a test;
``tests/servicebus/test_capacity.py`` runs a short one with a bound).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import time
import uuid
from collections.abc import Awaitable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

sys.path.insert(0, str(Path(__file__).parents[2]))

from schemas import TransportError
from schemas._backoff import Backoff
from schemas.channels import ChannelNames
from schemas.transport import OutgoingMessage
from schemas.transport.servicebus import ServiceBusSettings, ServiceBusTransport
from tests.servicebus_double import Reading, Usage

__all__ = ["DoubleProcess", "Plan", "Result", "measure"]

log = logging.getLogger("servicebus_capacity")

REPO = Path(__file__).parents[2]
SCRIPT = str(Path(__file__).resolve())
APPROVER_GROUP = "approver"
BODY = b'{"specversion": "1.0", "data": "' + b"x" * 2000 + b'"}'  # an agent message is ~2 KB
#: Seconds between the workers' spec and the schedule's time zero.
STARTUP = 3.0
#: Seconds after the last agent started and beat once before the idle window opens.
SETTLE = 5.0


@dataclass(frozen=True)
class Plan:
    agents: int = 1000
    busy: int = 100
    heartbeat: float = 60.0
    sender_idle_timeout: float = ServiceBusSettings().sender_idle_timeout
    #: The approver sends all the time during a wave: it keeps its sender open longer.
    approver_sender_idle_timeout: float = 300.0
    #: Length of each measurement window (idle, then busy).
    window: float = 120.0
    #: Agents start spread over this many heartbeat periods (a gentler start for the SDK).
    ramp: float = 2.0
    #: Busy agents' events appear spread over this many seconds at the busy window's start.
    spread: float = 10.0
    #: The agent before this design, for comparison: every agent listens for approvals all the
    #: time (use with a sender_idle_timeout longer than the run: its sender never closed).
    listen_always: bool = False
    workers: int = 2
    seed: int = 7


@dataclass(frozen=True)
class Schedule:
    """Wall-clock times (``time.time()``) every process follows."""

    start: float
    idle_from: float
    busy_from: float
    stop_at: float

    @classmethod
    def of(cls, plan: Plan) -> Schedule:
        start = time.time() + STARTUP
        # Every agent has started, then beaten once at least.
        idle_from = start + plan.heartbeat * (plan.ramp + 1) + SETTLE
        busy_from = idle_from + plan.window
        return cls(start, idle_from, busy_from, busy_from + plan.window)


@dataclass
class Window:
    """One measurement window: the namespace's counts, and the agents' share of them."""

    seconds: float
    connections_mean: float
    connections_peak: int
    connections_opened: int
    receive_links_mean: float
    receive_links_peak: int
    approvals_receive_links_peak: int
    approver_connections_mean: float
    per_idle_agent_connections: float
    per_idle_agent_receive_links: float
    per_busy_agent_connections: float | None = None
    per_busy_agent_receive_links: float | None = None


@dataclass
class Result:
    plan: Plan
    idle: Window
    busy: Window
    #: Milliseconds, over every publish of the run (a publish after an idle close opens the
    #: sender first).
    publish_ms: dict[str, float] = field(default_factory=dict)
    #: Milliseconds from the moment a busy agent sees its event (it opens its approvals and
    #: publishes ``scheduled``) to the approval in its hands: the approval round trip.
    approval_round_trip_ms: dict[str, float] = field(default_factory=dict)
    approvals_received: int = 0
    errors: int = 0


def _message(kind: str, vm: str) -> OutgoingMessage:
    return OutgoingMessage(
        body=BODY,
        message_id=uuid.uuid4().hex,
        content_type="application/cloudevents+json",
        routing_key=f"{kind}.agent.{vm}",
        properties={"cloudEvents:type": kind, "vm": vm},
    )


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 1)

    return {"n": len(ordered), "p50": at(0.5), "p99": at(0.99), "max": round(ordered[-1], 1)}


async def _until(wall_time: float) -> None:
    await asyncio.sleep(max(0.0, wall_time - time.time()))


class DoubleProcess:
    """The Service Bus double in a process of its own, measured through its control lines."""

    def __init__(
        self,
        channels: ChannelNames,
        subscription: str,
        *,
        session: bool = True,
        plain: tuple[str, ...] = (),
    ) -> None:
        """``subscription`` on the events topic (session-enabled unless ``session=False``),
        and ``plain`` subscriptions beside it."""
        self._args = [
            "--session-queue",
            channels.approvals_queue,
            "--session-topic" if session else "--topic",
            f"{channels.events_topic}:{subscription}",
            *(["--topic", f"{channels.events_topic}:{','.join(plain)}"] if plain else []),
            "--lock-duration",
            "60",
            "--control",
        ]
        self._process: asyncio.subprocess.Process | None = None
        self.connection_string = ""

    async def __aenter__(self) -> Self:
        # proton logs every peer that hangs up first: the double's log is shown only when
        # asked for (SERVICEBUS_DOUBLE_STDERR=1: on this process's stderr)
        shown = bool(os.environ.get("SERVICEBUS_DOUBLE_STDERR"))
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.servicebus_double",
            *self._args,
            cwd=REPO,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=None if shown else asyncio.subprocess.DEVNULL,
        )
        await self._line()  # listening on HOST:PORT
        self.connection_string = await self._line()
        return self

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    async def _line(self) -> str:
        assert self._process is not None
        assert self._process.stdout is not None
        line = await asyncio.wait_for(self._process.stdout.readline(), 30)
        if not line:
            raise RuntimeError("the Service Bus double exited")
        return line.decode().strip()

    async def _ask(self, command: str) -> str:
        assert self._process is not None
        assert self._process.stdin is not None
        self._process.stdin.write(f"{command}\n".encode())
        await self._process.stdin.drain()
        return await self._line()

    async def restart_usage(self) -> None:
        await self._ask("restart-usage")

    async def usage(self) -> Usage:
        raw: dict[str, Any] = json.loads(await self._ask("usage"))

        def readings(values: Mapping[str, dict[str, Any]]) -> dict[str, Reading]:
            return {name: Reading(**value) for name, value in values.items()}

        return Usage(
            seconds=raw["seconds"],
            connections=Reading(**raw["connections"]),
            receive_links=Reading(**raw["receive_links"]),
            send_links=Reading(**raw["send_links"]),
            receive_links_by_entity=readings(raw["receive_links_by_entity"]),
            send_links_by_entity=readings(raw["send_links_by_entity"]),
        )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.stdin is not None:
            process.stdin.close()  # the end of its input stops it
        try:
            await asyncio.wait_for(process.wait(), 15)
        except TimeoutError:
            process.kill()
            await process.wait()


# ---- one worker process: a share of the agents ----------------------------------------------


class _Agents:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.plan = Plan(**spec["plan"])
        self.schedule = Schedule(**spec["schedule"])
        self.channels = ChannelNames(**spec["channels"])
        self.address: str = spec["address"]
        self.publish_ms: list[float] = []
        self.round_trip_ms: list[float] = []
        self.errors = 0

    def transport(self) -> ServiceBusTransport:
        settings = ServiceBusSettings(sender_idle_timeout=self.plan.sender_idle_timeout)
        return ServiceBusTransport(self.address, self.channels, settings=settings)

    async def _guard(self, what: str, work: Awaitable[object]) -> None:
        try:
            await work
        except Exception as exc:  # a benchmark counts failures and carries on
            self.errors += 1
            log.warning("%s failed: %r", what, exc)

    async def publish(self, transport: ServiceBusTransport, kind: str, vm: str) -> None:
        began = time.perf_counter()
        await self._guard(f"{vm} {kind}", transport.publish(_message(kind, vm)))
        self.publish_ms.append((time.perf_counter() - began) * 1000)

    async def _connect(self, vm: str) -> ServiceBusTransport:
        """As the agent does: try again (with backoff) until the broker answers."""
        backoff = Backoff(1.0, 30.0)
        while True:
            transport = self.transport()
            try:
                await transport.connect()
                return transport
            except TransportError as exc:
                self.errors += 1
                log.warning("%s could not connect: %r", vm, exc)
                await asyncio.sleep(backoff.next())

    async def agent(self, vm: str, start: float, event_at: float | None) -> None:
        await _until(start)
        async with await self._connect(vm) as transport:
            await self.publish(transport, "agent.online", vm)
            event = asyncio.ensure_future(self._event(transport, vm, event_at))
            next_beat = start + self.plan.heartbeat
            while next_beat < self.schedule.stop_at:
                await _until(next_beat)
                next_beat += self.plan.heartbeat
                await self.publish(transport, "agent.heartbeat", vm)
            await _until(self.schedule.stop_at)
            event.cancel()
            await asyncio.gather(event, return_exceptions=True)

    async def _event(self, transport: ServiceBusTransport, vm: str, at: float | None) -> None:
        if self.plan.listen_always:  # the agent before: listens all the time, events or not
            async with transport.approvals(vm) as inbox:
                first = asyncio.ensure_future(anext(inbox))  # its receiver opens now
                if at is None:
                    await first  # nothing comes: it listens until the run ends
                else:
                    await _until(at)
                    await self._approve(transport, vm, inbox, first)
        elif at is not None:  # listens for approvals only while it has an event to approve
            await _until(at)
            async with transport.approvals(vm) as inbox:
                await self._approve(transport, vm, inbox, asyncio.ensure_future(anext(inbox)))

    async def _approve(
        self, transport: ServiceBusTransport, vm: str, inbox: Any, first: asyncio.Future[Any]
    ) -> None:
        """The event appeared: publish ``scheduled`` (the approver answers it), take the
        approvals as they come."""
        began = time.perf_counter()
        publish = asyncio.ensure_future(self.publish(transport, "scheduled", vm))
        delivery = await first
        await publish  # done, since the approver answered it
        while True:  # until the run ends
            self.round_trip_ms.append((time.perf_counter() - began) * 1000)
            await self._guard(f"{vm} ack", delivery.ack())
            await self.publish(transport, "approval.applied", vm)
            delivery = await anext(inbox)

    async def run(self, agents: list[tuple[str, float, float | None]]) -> dict[str, Any]:
        running = asyncio.gather(*(self.agent(vm, start, at) for vm, start, at in agents))
        try:  # an agent stuck past the end must not keep the benchmark waiting
            await asyncio.wait_for(running, self.schedule.stop_at + 60 - time.time())
        except TimeoutError:
            self.errors += 1
            log.warning("agents still running 60 s after the end: cancelled")
        return {
            "publish_ms": self.publish_ms,
            "round_trip_ms": self.round_trip_ms,
            "errors": self.errors,
        }


def _worker() -> int:
    """``--worker``: says ``ready`` once imported, then takes a JSON spec on stdin and prints
    the agents' figures as JSON on stdout."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    print("ready", flush=True)
    spec = json.loads(sys.stdin.read())
    agents = [(vm, start, at) for vm, start, at in spec["agents"]]
    print(json.dumps(asyncio.run(_Agents(spec).run(agents))))
    return 0


# ---- the coordinator: double, approver, workers, measurements -------------------------------


async def _approver(address: str, channels: ChannelNames, plan: Plan, errors: list[str]) -> None:
    settings = ServiceBusSettings(sender_idle_timeout=plan.approver_sender_idle_timeout)
    async with (
        ServiceBusTransport(address, channels, settings=settings) as transport,
        transport.subscribe(APPROVER_GROUP, exclusive=True) as stream,
    ):
        async for delivery in stream:
            vm = str(delivery.properties.get("vm", ""))
            try:
                if delivery.properties.get("cloudEvents:type") == "scheduled":
                    approval = _message("approval", vm)
                    await transport.send_approval(transport.reply_address(vm), approval)
                await delivery.ack()
            except Exception as exc:  # a benchmark counts failures and carries on
                errors.append(repr(exc))
                log.warning("the approver failed on %s: %r", vm, exc)


def _approver_connections(usage: Usage, channels: ChannelNames) -> float:
    """The approver holds its stream receiver and its approvals sender: one link each."""
    stream = f"{channels.events_topic}/Subscriptions/{APPROVER_GROUP}"
    receiver = usage.receive_links_by_entity.get(stream)
    sender = usage.send_links_by_entity.get(channels.approvals_queue)
    return (receiver.mean if receiver else 0.0) + (sender.mean if sender else 0.0)


def _window(plan: Plan, usage: Usage, channels: ChannelNames, idle: Window | None) -> Window:
    """The window's figures; with ``idle`` (the idle window's), the busy agents' share too: what
    the window holds beyond what its idle agents hold at the idle rate."""
    approvals = usage.receive_links_by_entity.get(channels.approvals_queue)
    receive_mean = approvals.mean if approvals else 0.0
    approver = _approver_connections(usage, channels)
    agents_mean = usage.connections.mean - approver
    figures = Window(
        seconds=round(usage.seconds, 1),
        connections_mean=round(usage.connections.mean, 2),
        connections_peak=usage.connections.peak,
        connections_opened=usage.connections.opened,
        receive_links_mean=round(usage.receive_links.mean, 2),
        receive_links_peak=usage.receive_links.peak,
        approvals_receive_links_peak=approvals.peak if approvals else 0,
        approver_connections_mean=round(approver, 2),
        per_idle_agent_connections=round(agents_mean / plan.agents, 4),
        per_idle_agent_receive_links=round(receive_mean / plan.agents, 4),
    )
    if idle is not None and plan.busy:
        idle_agents = plan.agents - plan.busy
        figures.per_idle_agent_connections = idle.per_idle_agent_connections
        figures.per_idle_agent_receive_links = idle.per_idle_agent_receive_links
        busy_mean = agents_mean - idle.per_idle_agent_connections * idle_agents
        figures.per_busy_agent_connections = round(busy_mean / plan.busy, 3)
        busy_receive = receive_mean - idle.per_idle_agent_receive_links * idle_agents
        figures.per_busy_agent_receive_links = round(busy_receive / plan.busy, 3)
    return figures


async def _start_worker() -> asyncio.subprocess.Process:
    """A worker process, imported and waiting for its spec (so no agent starts late)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        SCRIPT,
        "--worker",
        cwd=REPO,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    if (await asyncio.wait_for(process.stdout.readline(), 60)).strip() != b"ready":
        raise RuntimeError("a worker did not start")
    return process


async def _run_worker(process: asyncio.subprocess.Process, spec: dict[str, Any]) -> dict[str, Any]:
    out, _ = await process.communicate(json.dumps(spec).encode())
    if process.returncode != 0 or not out.strip():
        raise RuntimeError(f"a worker failed (exit {process.returncode})")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def measure(plan: Plan) -> Result:
    """Start the double, the approver and the agents; measure an idle window, then a busy one."""
    rng = random.Random(plan.seed)
    channels = ChannelNames().suffixed(f"capacity-{uuid.uuid4().hex[:6]}")
    names = [f"vm-{n:05d}" for n in range(plan.agents)]
    busy = set(rng.sample(names, plan.busy))
    approver_errors: list[str] = []
    async with DoubleProcess(channels, APPROVER_GROUP) as double:
        processes = await asyncio.gather(*(_start_worker() for _ in range(plan.workers)))
        schedule = Schedule.of(plan)
        agents = [
            (
                vm,
                schedule.start + rng.uniform(0, plan.ramp * plan.heartbeat),
                schedule.busy_from + rng.uniform(0, plan.spread) if vm in busy else None,
            )
            for vm in names
        ]
        approver = asyncio.ensure_future(
            _approver(double.connection_string, channels, plan, approver_errors)
        )
        workers = [
            asyncio.ensure_future(
                _run_worker(
                    processes[n],
                    {
                        "plan": asdict(plan),
                        "schedule": asdict(schedule),
                        "channels": asdict(channels),
                        "address": double.connection_string,
                        "agents": agents[n :: plan.workers],
                    },
                )
            )
            for n in range(plan.workers)
        ]
        await _until(schedule.idle_from)
        await double.restart_usage()
        await _until(schedule.busy_from)
        idle = _window(plan, await double.usage(), channels, None)
        await double.restart_usage()
        await _until(schedule.stop_at)
        busy_window = _window(plan, await double.usage(), channels, idle)
        shares = await asyncio.gather(*workers)
        approver.cancel()
        await asyncio.gather(approver, return_exceptions=True)
    round_trips = [ms for share in shares for ms in share["round_trip_ms"]]
    return Result(
        plan=plan,
        idle=idle,
        busy=busy_window,
        publish_ms=_quantiles([ms for share in shares for ms in share["publish_ms"]]),
        approval_round_trip_ms=_quantiles(round_trips),
        approvals_received=len(round_trips),
        errors=sum(share["errors"] for share in shares) + len(approver_errors),
    )


def _table(result: Result) -> str:
    plan, idle, busy = result.plan, result.idle, result.busy
    rows = [
        ("window (s)", idle.seconds, busy.seconds),
        ("connections: mean", idle.connections_mean, busy.connections_mean),
        ("connections: peak", idle.connections_peak, busy.connections_peak),
        ("connections opened", idle.connections_opened, busy.connections_opened),
        ("receive links: mean", idle.receive_links_mean, busy.receive_links_mean),
        ("receive links: peak", idle.receive_links_peak, busy.receive_links_peak),
        ("approver's connections: mean", idle.approver_connections_mean,
         busy.approver_connections_mean),
        ("connections per idle agent", idle.per_idle_agent_connections,
         busy.per_idle_agent_connections),
        ("receive links per idle agent", idle.per_idle_agent_receive_links,
         busy.per_idle_agent_receive_links),
        ("connections per busy agent", "-", busy.per_busy_agent_connections),
        ("receive links per busy agent", "-", busy.per_busy_agent_receive_links),
    ]  # fmt: skip
    lines = [
        f"{plan.agents} agents ({plan.busy} busy in the second window), heartbeat "
        f"{plan.heartbeat:g} s, sender_idle_timeout {plan.sender_idle_timeout:g} s"
        + (", approvals open all the time (the agent before)" if plan.listen_always else ""),
        "",
        f"| {'':30} | {'idle window':>12} | {'busy window':>12} |",
        f"| {'-' * 30} | {'-' * 11}: | {'-' * 11}: |",
    ]
    lines += [f"| {name:30} | {a!s:>12} | {b!s:>12} |" for name, a, b in rows]
    lines += [
        "",
        f"publish (ms): {result.publish_ms}",
        f"approval round trip (ms): {result.approval_round_trip_ms}",
        f"approvals received: {result.approvals_received} of {plan.busy}; errors: {result.errors}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    if args_list == ["--worker"]:
        return _worker()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Plan()
    parser.add_argument("--agents", type=int, default=defaults.agents)
    parser.add_argument("--busy", type=int, default=defaults.busy)
    parser.add_argument("--heartbeat", type=float, default=defaults.heartbeat)
    parser.add_argument("--sender-idle-timeout", type=float, default=defaults.sender_idle_timeout)
    parser.add_argument(
        "--approver-sender-idle-timeout",
        type=float,
        default=defaults.approver_sender_idle_timeout,
    )
    parser.add_argument("--window", type=float, default=defaults.window)
    parser.add_argument("--ramp", type=float, default=defaults.ramp)
    parser.add_argument("--spread", type=float, default=defaults.spread)
    parser.add_argument(
        "--listen-always",
        action="store_true",
        help="the agent before this design: approvals open all the time (the baseline)",
    )
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(args_list)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    plan = Plan(
        agents=args.agents,
        busy=min(args.busy, args.agents),
        heartbeat=args.heartbeat,
        sender_idle_timeout=args.sender_idle_timeout,
        approver_sender_idle_timeout=args.approver_sender_idle_timeout,
        window=args.window,
        ramp=args.ramp,
        spread=args.spread,
        listen_always=args.listen_always,
        workers=max(1, args.workers),
        seed=args.seed,
    )
    began = time.monotonic()
    result = asyncio.run(measure(plan))
    print(_table(result))
    print(f"wall time: {time.monotonic() - began:.0f} s")
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
