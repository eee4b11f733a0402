"""A fleet on one machine: N real agents, the IMDS simulator in fleet mode, the approver and the
audit, over RabbitMQ; every VM gets a Freeze in the same second, and the run measures how long
each event takes to be decided and approved (POST StartRequests), and that nothing is lost,
repeated or approved wrongly.

How (see ``_fleet_workers.py`` for each process):

- the simulator serves the fleet (scale sets over 3 zones, placement groups of
  ``--placement-group-size``: every VM of a group sees its neighbours' events) from
  ``--sim-shards`` processes, each answering for its shard of the VMs;
- the agents are the real :class:`publisher.Agent` (IMDS client, state store, outbox,
  transport; state in memory), ``--agent-workers`` processes of many agents each, one broker
  connection per ``--agents-per-connection`` agents (each agent its own channel for its
  approvals), started spread over ``--ramp`` seconds, polling every ``--poll-interval``
  (every ``--fast-poll-interval`` while polling fast, for at most ``--fast-poll-seconds``; a
  heartbeat after ``--heartbeat-interval`` without another message);
- the approver (:class:`ApproverService`, SQLite state, ``--policy``, default the documents'
  sample policy) and the audit (:class:`AuditService`, SQLite ledger) run in processes of
  their own, as their CLI runs them, with one more handler on each stream recording what it
  is given; origin checks are off (every agent logs in as the same broker user);
- at one wall-clock second every VM gets a Freeze of its own (Resources: that VM): of
  DurationInSeconds 5 (the sample policy approves it), or 30 for ``--long-share`` of them
  (no policy rule approves it: it must never be POSTed); NotBefore 15 minutes away (10 minutes
  past the time limit when that is later: none starts by itself within a run).

The run ends when every approved event completed and both handlers saw every transition, or at
``--timeout``. Measured, per event: appeared (created in the simulator) -> decided (the
approver's first decision, committed) and -> posted (the simulator received POST
StartRequests), and the same from detection (the ``time`` of the agent's ``scheduled``
message: when it committed the transition). Counted: transitions lost (a scheduled, started
or completed the simulator went through that a handler never got; of them, those no agent
published: a state no poll of the VM saw), duplicates that reached a
handler, wrong POSTs (an event no policy rule approves, or a second VM's POST of one event).

    python tests/benchmarks/fleet.py --vms 2000
    python tests/benchmarks/fleet.py --vms 10000 --poll-interval 60 --sim-shards 2
    python tests/benchmarks/fleet.py --vms 10000 --poll-interval 60 --sim-shards 2 \\
        --heartbeat-interval 600
    python tests/benchmarks/fleet.py --vms 10000 --poll-interval 120 --fast-poll-interval 1 \\
        --sim-shards 2 --timeout 600
    python tests/benchmarks/fleet.py --vms 200 --png /tmp/fleet.png
    python tests/benchmarks/fleet.py --vms 1000 --servicebus

``--servicebus`` runs the same over the Service Bus protocol double (``tests/servicebus_double``,
a process of its own) instead of RabbitMQ: every agent has a transport of its own (the real
SDK: a sender opened while publishing, a session receiver while it has an event to approve)
and signs its messages; the approver reads the session-enabled ``approver`` subscription.

``FLEET_TRACE=1`` in the environment makes each agent process print where the time goes on the
agent's side (detection -> publish -> confirm; approval issued -> handled -> fresh IMDS
document -> POST); ``FLEET_PROFILE=PATH`` writes a cProfile of each process
(``FLEET_PROFILE_ROLES=approver``: of the approver alone; roles: agents, sim, approver, audit).

Prints a table, then as its last line one JSON object. Entities on the broker are named for
the run and deleted afterwards. Asserts nothing (``tests/scale`` runs a short one that does).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from publisher import AgentSettings  # noqa: E402
from publisher._settings import MIN_HEARTBEAT_INTERVAL  # noqa: E402
from schemas import LIVENESS_PER_HEARTBEAT, MAX_HEARTBEAT_INTERVAL, ConfigError  # noqa: E402
from tests.benchmarks._fleet_workers import worker  # noqa: E402

SCRIPT = str(Path(__file__).resolve())
#: The agent's own defaults (its settings' numbers), which a run keeps unless told otherwise.
AGENT_DEFAULTS = {
    f.name: f.default for f in fields(AgentSettings) if isinstance(f.default, (int, float))
}
AMQP_URL = os.environ.get("RELAY_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
#: Polls one simulator process serves beside everything else on this machine (with httptools).
POLLS_PER_SHARD = 1500.0
#: Agents one worker process runs (their polls, diffs, publishes: about a core at 1 Hz).
AGENTS_PER_WORKER = 1250
SHORT, LONG = 5, 30


#: The longest time limit, ramp or settle a run takes (seconds): a day.
MAX_RUN_SECONDS = 86_400.0


@dataclass(frozen=True)
class Plan:
    vms: int = 2000
    broker: str = AMQP_URL
    policy: str | None = None
    poll_interval: float = 1.0
    #: How long the agent polls fast after a change (its default: 10 s); 0 turns it off.
    fast_poll_seconds: float = AGENT_DEFAULTS["fast_poll_seconds"]
    #: The agent's interval while polling fast (its default: 0.5 s).
    fast_poll_interval: float = AGENT_DEFAULTS["fast_poll_interval"]
    #: A heartbeat after this long without another message (the agent's default: 60 s).
    heartbeat_interval: float = AGENT_DEFAULTS["heartbeat_interval"]
    sim_shards: int = 0
    agent_workers: int = 0
    agents_per_connection: int = 500
    placement_group_size: int = 5
    long_share: float = 0.1
    ramp: float = 0.0
    settle: float = 5.0
    timeout: float = 300.0
    approver_db: str = "sqlite"
    rate_limit: int = 5
    seed: int = 7
    servicebus: bool = False
    #: Niceness of the agent processes (the stand-ins for the fleet's VMs); 0: none.
    agents_nice: int = 0
    #: Niceness of the approver and the audit (negative: before everything else; needs root).
    central_nice: int = 0

    @property
    def shards(self) -> int:
        return self.sim_shards or max(1, math.ceil(self.vms / self.poll_interval / POLLS_PER_SHARD))

    @property
    def workers(self) -> int:
        return self.agent_workers or max(1, math.ceil(self.vms / AGENTS_PER_WORKER))

    @property
    def keep_alive_seconds(self) -> int:
        """How long the simulator keeps an idle connection: past two poll intervals, so a VM
        polling slowly reuses its connection as it does at 1 Hz, instead of the simulator
        accepting one for every poll (Azure's IMDS is not on this machine; here its CPU is
        taken from what is measured)."""
        return max(5, math.ceil(2 * self.poll_interval) + 1)

    @property
    def not_before_seconds(self) -> int:
        """How far after the burst each Freeze's NotBefore lies: 15 minutes, as on Azure, or
        10 minutes past the time limit when that is later. An event no policy approves starts
        at its NotBefore; within the run its agent reports that, but one starting as the run
        ends (the agents stopped, the simulator not yet) was counted lost: 1,879 "lost" of a
        10,000-VM run with ``--timeout 900`` were such starts and ends, none a transition the
        system lost."""
        return max(900, math.ceil(self.timeout) + 600)

    @property
    def ramp_seconds(self) -> float:
        return self.ramp or max(5.0, self.vms / 100)


@dataclass
class Quantiles:
    n: int = 0
    p50: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: list[float]) -> Quantiles:
        if not values:
            return cls()
        ordered = sorted(values)

        def at(q: float) -> float:
            return round(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)], 3)

        return cls(len(ordered), at(0.50), at(0.99), round(ordered[-1], 3))


@dataclass
class Result:
    plan: Plan
    events: int = 0
    approvable: int = 0
    published: int = 0
    published_by_kind: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    lost_by_kind: dict[str, int] = field(default_factory=dict)
    #: Of ``lost``, how many no agent published (no poll of the VM saw that state: a Started
    #: shorter than the gap between two polls; or its agent still held it when the run
    #: stopped); None where the agents' transports are their own and what they published is
    #: not recorded.
    lost_unpublished: int | None = None
    duplicates_to_handlers: int = 0
    wrong_posts: int = 0
    posts: int = 0
    detection: Quantiles = field(default_factory=Quantiles)
    delivered: Quantiles = field(default_factory=Quantiles)
    #: The approver's own part: its handler got the ``scheduled`` -> its decision committed
    #: (the recording handler runs after the service's: with ``--approver-db memory``, whose
    #: decisions are made inside its handler, this is about 0).
    judged: Quantiles = field(default_factory=Quantiles)
    decided: Quantiles = field(default_factory=Quantiles)
    posted: Quantiles = field(default_factory=Quantiles)
    detected_to_decided: Quantiles = field(default_factory=Quantiles)
    detected_to_posted: Quantiles = field(default_factory=Quantiles)
    completed: int = 0
    finished_in: float = 0.0
    startup_seconds: float = 0.0
    imds_errors: dict[str, int] = field(default_factory=dict)
    busiest_vm_per_second: int = 0
    #: The most requests one agent wrote within one second (its limiter's count).
    agent_peak_per_second: int = 0
    #: VMs from which the simulator received more than 2 requests within one second.
    vms_over_two_per_second: int = 0
    #: Per simulator shard, how late its event loop ran a 0.1 s timer over the run (p99, max):
    #: it stamps each request's arrival, so its lag moves arrivals together or apart.
    sim_loop_lag: list[dict[str, float]] = field(default_factory=list)
    #: IMDS requests by method from the burst to the end (every VM's, the simulator's count).
    imds_requests: dict[str, int] = field(default_factory=dict)
    #: Per agent process, how late its event loop ran a 0.1 s timer over the run (p99, max).
    loop_lag: list[dict[str, float]] = field(default_factory=list)
    cpu_percent: dict[str, float] = field(default_factory=dict)
    runqueue_percent: dict[str, float] = field(default_factory=dict)
    dead_lettered: int = 0
    samples: dict[str, list[float]] = field(default_factory=dict)

    def line(self) -> dict[str, Any]:
        """The issue's JSON line."""
        return {
            "vms": self.plan.vms,
            "events": self.events,
            "published": self.published,
            "lost": self.lost,
            "lost_unpublished": self.lost_unpublished,
            "duplicates_to_handlers": self.duplicates_to_handlers,
            "wrong_posts": self.wrong_posts,
            "decided_p50_s": self.decided.p50,
            "decided_p99_s": self.decided.p99,
            "posted_p50_s": self.posted.p50,
            "posted_p99_s": self.posted.p99,
            "detected_to_decided_p99_s": self.detected_to_decided.p99,
            "detected_to_posted_p99_s": self.detected_to_posted.p99,
            "poll_interval_s": self.plan.poll_interval,
            "transport": "servicebus" if self.plan.servicebus else "rabbitmq",
            "finished": self.finished,
        }

    @property
    def finished(self) -> bool:
        """Whether every approvable event completed before the run's time limit: if not, what
        ``lost`` counts may have been still under way when the run stopped."""
        return self.completed >= self.approvable


class _Process:
    """One worker process: a spec and commands in, JSON lines out."""

    def __init__(self, role: str, name: str) -> None:
        self.role = role
        self.name = name
        self.process: asyncio.subprocess.Process | None = None

    async def start(self, spec: dict[str, Any]) -> None:
        script = os.environ.get(f"FLEET_{self.role.upper()}_SCRIPT", SCRIPT)  # diagnostics
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, script, "--worker", self.role,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=REPO,
            limit=256 * 1024 * 1024,
        )  # fmt: skip
        await self.send(spec)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def send(self, command: dict[str, Any]) -> None:
        assert self.process is not None
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        await self.process.stdin.drain()

    async def recv(self, timeout: float) -> dict[str, Any]:  # noqa: ASYNC109
        assert self.process is not None
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(f"{self.name} exited ({await self.process.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def ask(self, command: dict[str, Any], timeout: float = 60) -> dict[str, Any]:  # noqa: ASYNC109
        await self.send(command)
        return await self.recv(timeout)

    async def close(self) -> None:
        process, self.process = self.process, None
        if process is None or process.returncode is not None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 20)
        except TimeoutError:
            process.kill()
            await process.wait()


@contextlib.asynccontextmanager
async def _processes() -> AsyncIterator[list[_Process]]:
    started: list[_Process] = []
    try:
        yield started
    finally:
        await asyncio.gather(*(p.close() for p in started), return_exceptions=True)


def _topology(plan: Plan) -> dict[str, Any]:
    return {
        "scale_set_vms": plan.vms,
        "scale_sets": max(1, plan.vms // 1000),
        "zones": 3,
        "prefix": "fleet",
        "placement_group_size": plan.placement_group_size,
    }


def _approvable(plan: Plan, events: dict[str, dict[str, Any]]) -> set[str]:
    """The events a policy rule approves (guards left out: they only delay)."""
    from consumers._fleet import EventPhase, EventState, FleetView
    from consumers._policies import Action, PolicySet, load_policy_file
    from schemas import ScheduledEvent

    policies = load_policy_file(Path(plan.policy)) if plan.policy else PolicySet.default()
    view = FleetView()
    chosen = set()
    for event_id, event in events.items():
        scheduled = ScheduledEvent.from_imds(
            {
                "EventId": event_id,
                "EventStatus": "Scheduled",
                "EventType": "Freeze",
                "ResourceType": "VirtualMachine",
                "Resources": [event["vm"]],
                "NotBefore": "Mon, 01 Jan 2035 00:00:00 GMT",
                "EventSource": "Platform",
                "DurationInSeconds": event["duration"],
            }
        )
        state = EventState(event_id, scheduled, EventPhase.SCHEDULED, view.clock(), view.clock())
        if policies.decide(state, view, view.clock()).action is Action.APPROVE:
            chosen.add(event_id)
    return chosen


async def measure(plan: Plan) -> Result:
    from publisher.simulator import Shard, Simulator, SimulatorConfig, Topology
    from schemas.approvals import write_key_pair
    from schemas.channels import ChannelNames
    from schemas.transport import open_transport

    result = Result(plan)
    channels = ChannelNames().suffixed(f"fleet-{uuid.uuid4().hex[:8]}")
    topology = _topology(plan)
    local = Simulator(
        SimulatorConfig(seed=plan.seed, shard=Shard(0, plan.shards)),
        topology=Topology.fleet(**topology),
    )
    names = local.vm_names()
    with tempfile.TemporaryDirectory(prefix="fleet-") as scratch:
        key, public = write_key_pair(Path(scratch))
        setup = (topology, names, local, scratch, key, public)
        if plan.servicebus:
            from tests.benchmarks.servicebus_capacity import DoubleProcess

            async with (
                DoubleProcess(channels, "approver", plain=("audit",)) as double,
                _processes() as procs,
            ):
                plan = replace(plan, broker=double.connection_string, agents_per_connection=0)
                result.plan = plan
                await _run(
                    plan, result, procs, channels, *setup, broker=("Service Bus double", double.pid)
                )
            return result
        coordinator = open_transport(plan.broker, channels, name="fleet coordinator")
        async with coordinator, _processes() as procs:
            await coordinator.declare_group("approver", exclusive=True)
            await coordinator.declare_group("audit")
            try:
                await _run(
                    plan, result, procs, channels, *setup, broker=("RabbitMQ", _rabbitmq_pid())
                )
            finally:
                # Agents still running (one that did not stop in time) would declare their
                # queues again as they are deleted: every process is gone first.
                await asyncio.gather(*(p.close() for p in procs), return_exceptions=True)
                await _delete_entities(coordinator, names)
    return result


#: VM queues deleted per call: one call runs on one channel within the transport's timeout,
#: which 10,000 deletes one after the other exceeded (the rest were left on the broker, and
#: slowed every later run down).
_DELETES_PER_CALL = 250


async def _delete_entities(coordinator: Any, names: list[str]) -> None:
    print("deleting the run's broker entities ...", flush=True)
    steps: list[dict[str, Any]] = [
        {"vms": names[i : i + _DELETES_PER_CALL]} for i in range(0, len(names), _DELETES_PER_CALL)
    ]
    steps.append({"groups": ["approver", "audit"], "exchanges": True})
    failed = 0
    for step in steps:
        try:
            await coordinator.delete_topology(**step)
        except Exception as exc:  # reported, and the other steps still run
            failed += 1
            print(f"  deleting {', '.join(step)} failed: {exc!r}", flush=True)
    if failed:
        print(f"  {failed} of {len(steps)} deletion steps failed: some of this run's queues "
              "are left on the broker", flush=True)  # fmt: skip


async def _run(
    plan: Plan,
    result: Result,
    procs: list[_Process],
    channels: Any,
    topology: dict[str, Any],
    names: list[str],
    local: Any,
    scratch: str,
    key: Path,
    public: Path,
    *,
    broker: tuple[str, int | None],
) -> None:
    spec_channels = asdict(channels)
    shards = [_Process("sim", f"simulator {k}") for k in range(plan.shards)]
    procs += shards
    for k, shard in enumerate(shards):
        await shard.start(
            {"shard": k, "shards": plan.shards, "seed": plan.seed, "rate_limit": plan.rate_limit,
             "topology": topology, "keep_alive": plan.keep_alive_seconds}
        )  # fmt: skip
    urls = [(await shard.recv(120))["url"] for shard in shards]
    print(f"{plan.shards} simulator shard(s) serving {plan.vms} VMs", flush=True)

    central = {role: _Process(role, role) for role in ("approver", "audit")}
    procs += central.values()
    await central["approver"].start(
        {"broker": plan.broker, "channels": spec_channels, "signing_key": str(key),
         "policy": plan.policy, "nice": plan.central_nice,
         "db": f"sqlite:///{scratch}/approver.db" if plan.approver_db == "sqlite" else None}
    )  # fmt: skip
    await central["audit"].start(
        {"broker": plan.broker, "channels": spec_channels, "nice": plan.central_nice,
         "db": f"sqlite:///{scratch}/audit.db"}
    )  # fmt: skip
    for proc in central.values():
        await proc.recv(120)

    agents = [_Process("agents", f"agents {w}") for w in range(plan.workers)]
    procs += agents
    start_at = time.time() + 3
    for w, proc in enumerate(agents):
        vms = [[n, f"{urls[local.shard_of(n)]}/vm/{n}"] for n in names[w :: plan.workers]]
        await proc.start(
            {"broker": plan.broker, "channels": spec_channels, "vms": vms,
             "agents_per_connection": plan.agents_per_connection,
             "poll_interval": plan.poll_interval, "fast_poll_seconds": plan.fast_poll_seconds,
             "fast_poll_interval": plan.fast_poll_interval,
             "heartbeat_interval": plan.heartbeat_interval,
             "trust_key": str(public), "start_at": start_at, "ramp": plan.ramp_seconds,
             "nice": plan.agents_nice}
        )  # fmt: skip
    print(f"{plan.vms} agents in {plan.workers} process(es), starting over "
          f"{plan.ramp_seconds:.0f} s ...", flush=True)  # fmt: skip
    for proc in agents:
        answer = await proc.recv(plan.ramp_seconds + 300)
        if answer.get("failed"):
            raise RuntimeError(f"{proc.name}: agents failed: {answer['failed']}")
    result.startup_seconds = round(time.time() - start_at, 1)
    print(f"all agents ready after {result.startup_seconds} s; settling {plan.settle:g} s",
          flush=True)  # fmt: skip
    await asyncio.sleep(plan.settle)
    for shard in shards:
        await shard.ask({"op": "reset-stats"})

    # ---- the burst
    every = round(1 / plan.long_share) if plan.long_share > 0 else 0
    events = {
        str(uuid.uuid4()).upper(): {
            "vm": name,
            "duration": LONG if every and i % every == every - 1 else SHORT,
            "not_before": plan.not_before_seconds,
        }
        for i, name in enumerate(names)
    }
    approvable = _approvable(plan, events)
    result.events, result.approvable = len(events), len(approvable)
    burst_at = math.floor(time.time()) + 2.0
    by_shard: dict[int, list[dict[str, Any]]] = {}
    for event_id, event in events.items():
        by_shard.setdefault(local.shard_of(event["vm"]), []).append({"id": event_id, **event})
    pids: dict[str, int | None] = {p.name: p.pid for p in procs}
    cpu = _CpuMeter(pids | dict([broker]))
    for k, shard in enumerate(shards):
        await shard.send({"op": "events", "at": burst_at, "events": by_shard.get(k, [])})
    for shard in shards:
        await shard.recv(60)
    print(f"{len(events)} events created at {time.strftime('%H:%M:%S', time.localtime(burst_at))}"
          f" ({len(approvable)} approvable) ...", flush=True)  # fmt: skip

    expected = len(events) + 2 * len(approvable)
    deadline = burst_at + plan.timeout
    while time.time() < deadline:
        await asyncio.sleep(2)
        completed = 0
        for shard in shards:
            completed += (await shard.ask({"op": "progress"})).get("Completed", 0)
        seen = [(await central[r].ask({"op": "progress"}))["transitions"] for r in central]
        print(f"  +{time.time() - burst_at:5.0f} s: {completed}/{len(approvable)} completed, "
              f"transitions seen {seen[0]} / {seen[1]} of {expected}", flush=True)  # fmt: skip
        if completed >= len(approvable) and min(seen) >= expected:
            break
    result.finished_in = round(time.time() - burst_at, 1)
    result.cpu_percent, result.runqueue_percent = cpu.stop()
    for shard in shards:
        for method, count in (await shard.ask({"op": "requests"}, timeout=60)).items():
            result.imds_requests[method] = result.imds_requests.get(method, 0) + count

    # ---- reports
    agent_reports = [await proc.ask({"op": "stop"}, timeout=120) for proc in agents]
    central_reports = {r: await central[r].ask({"op": "stop"}, timeout=120) for r in central}
    sim_reports = [await shard.ask({"op": "report"}, timeout=120) for shard in shards]
    _account(result, events, approvable, agent_reports, central_reports, sim_reports)


def _rabbitmq_pid() -> int | None:
    for process in psutil.process_iter(["name", "cmdline"]):
        if process.info["name"] == "beam.smp":
            return process.pid
    return None


class _CpuMeter:
    """Each process's CPU and its threads' time waiting for a CPU while runnable (the kernel's
    run-queue wait, ``/proc/PID/task/*/schedstat``), in percent of one core, from now to
    :meth:`stop`. A process that is slow with little CPU and a large wait is starved by the
    other processes on the machine, not waiting on I/O."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self.processes = {
            name: psutil.Process(pid) for name, pid in pids.items() if pid is not None
        }
        self.began = time.monotonic()
        self.start = {name: self._cpu(p) for name, p in self.processes.items()}
        self.start_wait = {name: self._waited(p.pid) for name, p in self.processes.items()}

    @staticmethod
    def _cpu(process: psutil.Process) -> float:
        try:
            times = process.cpu_times()
        except psutil.Error:
            return 0.0
        return float(times.user + times.system)

    @staticmethod
    def _waited(pid: int) -> float:
        total = 0
        for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int(stat.read_text().split()[1])
        return total / 1e9

    def stop(self) -> tuple[dict[str, float], dict[str, float]]:
        wall = time.monotonic() - self.began
        cpu = {
            name: round(100 * (self._cpu(p) - self.start[name]) / wall, 1)
            for name, p in self.processes.items()
        }
        waited = {
            name: round(100 * (self._waited(p.pid) - self.start_wait[name]) / wall, 1)
            for name, p in self.processes.items()
        }
        return cpu, waited


def _account(
    result: Result,
    events: dict[str, dict[str, Any]],
    approvable: set[str],
    agent_reports: list[dict[str, Any]],
    central: dict[str, dict[str, Any]],
    sims: list[dict[str, Any]],
) -> None:
    result.loop_lag = [report["loop_lag"] for report in agent_reports]
    result.agent_peak_per_second = max((r["peak_rps"] for r in agent_reports), default=0)
    for report in agent_reports:
        for kind, count in report["published"].items():
            result.published_by_kind[kind] = result.published_by_kind.get(kind, 0) + count
        for kind, count in report["imds_errors"].items():
            result.imds_errors[kind] = result.imds_errors.get(kind, 0) + count
    result.published = sum(result.published_by_kind.values())
    lives: dict[str, dict[str, Any]] = {}
    posts = 0
    for report in sims:
        lives.update(report["events"])
        posts += sum(report["posts"].values())
        result.busiest_vm_per_second = max(
            result.busiest_vm_per_second, report["busiest_vm_per_second"]
        )
        result.vms_over_two_per_second += report["vms_over_two_per_second"]
        result.sim_loop_lag.append(report["loop_lag"])
    result.posts = posts
    # What each VM went through, by the simulator: its own event's transitions.
    expected: set[tuple[str, str, str]] = set()
    for event_id, life in lives.items():
        if event_id not in events:
            continue
        vm = life["vm"].casefold()
        expected.add((vm, event_id, "scheduled"))
        if life["started"] is not None:
            expected.add((vm, event_id, "started"))
        if life["state"] == "Completed":
            expected.add((vm, event_id, "completed"))
    result.completed = sum(1 for life in lives.values() if life["state"] == "Completed")
    seen: dict[str, dict[tuple[str, str, str], list[float]]] = {}
    for role, report in central.items():
        seen[role] = {(vm, e, k): [t, r] for vm, e, k, t, r in report["transitions"]}
        result.duplicates_to_handlers += report["duplicates"]
        result.dead_lettered += report["dead_lettered"]
    missing = {key for role in seen for key in expected - seen[role].keys()}
    result.lost = len(missing)
    for _, _, kind in missing:
        result.lost_by_kind[kind] = result.lost_by_kind.get(kind, 0) + 1
    recorded = [report.get("published_transitions") for report in agent_reports]
    if recorded and all(keys is not None for keys in recorded):
        published = {tuple(key) for keys in recorded for key in keys or ()}
        result.lost_unpublished = len(missing - published)
    wrong = 0
    for event_id, life in lives.items():
        approvals = life["approvals"]
        wrong += len(approvals) if event_id not in approvable else max(0, len(approvals) - 1)
    result.wrong_posts = wrong
    decisions = central["approver"]["decisions"]
    detection, decided, posted, d_decided, d_posted, judged = [], [], [], [], [], []
    delivered = [r - t for (_, _, kind), (t, r) in seen["approver"].items() if kind == "scheduled"]
    for event_id, life in lives.items():
        if event_id not in events:
            continue
        created = life["created"]
        key = (life["vm"].casefold(), event_id, "scheduled")
        detected, received = seen["approver"].get(key, (None, None))
        if detected is not None:
            detection.append(detected - created)
        if event_id in decisions:
            at = decisions[event_id][1]
            decided.append(at - created)
            if detected is not None:
                d_decided.append(at - detected)
            if received is not None:
                judged.append(at - received)
        if life["approvals"]:
            at = min(time for _, time in life["approvals"])
            posted.append(at - created)
            if detected is not None:
                d_posted.append(at - detected)
    result.detection = Quantiles.of(detection)
    result.delivered = Quantiles.of(delivered)
    result.judged = Quantiles.of(judged)
    result.decided = Quantiles.of(decided)
    result.posted = Quantiles.of(posted)
    result.detected_to_decided = Quantiles.of(d_decided)
    result.detected_to_posted = Quantiles.of(d_posted)
    result.samples = {
        "appeared -> decided": decided,
        "appeared -> posted": posted,
        "detected -> decided": d_decided,
        "detected -> posted": d_posted,
    }


def _lost_split(result: Result) -> str:
    """What the lost were: published by an agent and never handled (the system lost them), or
    never published (no poll of the VM saw that state, or its agent still held it)."""
    if not result.lost or result.lost_unpublished is None:
        return ""
    unpublished = result.lost_unpublished
    return (
        f" ({result.lost - unpublished} published by an agent and not handled, {unpublished} "
        "never published: no poll of the VM saw that state, or its agent still held it when "
        "the run stopped)"
    )


def _unless_default(plan: Plan, name: str, text: str) -> str:
    """``text`` with the plan's ``name`` in it when that is not the agent's default."""
    value = getattr(plan, name)
    return "" if value == AGENT_DEFAULTS[name] else text.format(value)


def table(result: Result) -> str:
    plan = result.plan
    lines = [
        f"{plan.vms} VMs ({plan.workers} agent process(es), {plan.shards} simulator shard(s), "
        f"placement groups of {plan.placement_group_size}), poll every {plan.poll_interval:g} s"
        f"{'' if plan.fast_poll_seconds else ' (fast polling off)'}"
        f"{_unless_default(plan, 'fast_poll_interval', ', fast {:g} s')}"
        f"{_unless_default(plan, 'heartbeat_interval', ', heartbeats {:g} s')}"
        f"{f', agents at nice {plan.agents_nice}' if plan.agents_nice else ''}"
        f"{f', approver and audit at nice {plan.central_nice}' if plan.central_nice else ''}"
        ", approver state "
        f"{plan.approver_db}, "
        + ("the Service Bus double" if plan.servicebus else f"broker {plan.broker.split('@')[-1]}"),
        f"{result.events} events ({result.approvable} approvable), {result.completed} completed"
        f" in {result.finished_in} s; agents ready {result.startup_seconds} s after the start",
        "",
        f"| {'latency (s)':28} | {'n':>6} | {'p50':>7} | {'p99':>7} | {'max':>7} |",
        f"| {'-' * 28} | {'-' * 5}: | {'-' * 6}: | {'-' * 6}: | {'-' * 6}: |",
    ]
    for name, q in (
        ("appeared -> detected", result.detection),
        ("detected -> approver has it", result.delivered),
        ("approver has it -> decided", result.judged),
        ("appeared -> decided", result.decided),
        ("appeared -> POST", result.posted),
        ("detected -> decided", result.detected_to_decided),
        ("detected -> POST", result.detected_to_posted),
    ):
        lines.append(f"| {name:28} | {q.n:>6} | {q.p50!s:>7} | {q.p99!s:>7} | {q.max!s:>7} |")
    lines += [
        "",
        f"published {result.published} {dict(sorted(result.published_by_kind.items()))}",
        f"lost {result.lost} {result.lost_by_kind}{_lost_split(result)}; duplicates to handlers "
        f"{result.duplicates_to_handlers}; wrong POSTs {result.wrong_posts} (of {result.posts}"
        f" POSTs); dead-lettered {result.dead_lettered}",
        *(
            []
            if result.finished
            else [
                f"NOT FINISHED: {result.approvable - result.completed} of {result.approvable} "
                "approvable events had not completed at the time limit (--timeout); 'lost' "
                "counts their transitions that were still under way then"
            ]
        ),
        f"IMDS errors {result.imds_errors}; busiest VM {result.busiest_vm_per_second} requests"
        f" in one second as the simulator stamped their arrival ({result.vms_over_two_per_second}"
        " VMs over 2; its shards' event-loop lag, p99 / max: "
        + ", ".join(f"{lag['p99']:.2f} / {lag['max']:.2f} s" for lag in result.sim_loop_lag)
        + f"), {result.agent_peak_per_second} as the agents wrote them",
        "IMDS requests from the burst to the end: "
        + ", ".join(
            f"{count} {method}s ({count / max(result.finished_in, 0.1):.0f}/s)"
            for method, count in result.imds_requests.items()
        ),
        "agent processes' event-loop lag over the run (how late a 0.1 s timer fired), p99 / max: "
        + ", ".join(f"{lag['p99']:.2f} / {lag['max']:.2f} s" for lag in result.loop_lag),
        "CPU (% of one core) from the burst to the end: "
        + ", ".join(f"{k} {v}" for k, v in result.cpu_percent.items()),
        "waiting for a CPU while runnable (% of one core, all threads), same span: "
        + ", ".join(f"{k} {v}" for k, v in result.runqueue_percent.items()),
    ]
    return "\n".join(lines)


def plot(result: Result, path: str) -> None:
    """The latency distributions as CDFs (matplotlib, the ``benchmarks`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=120)
    for name, values in result.samples.items():
        if not values:
            continue
        ordered = sorted(values)
        fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
        axes.step(ordered, fractions, where="post", label=name)
    plan = result.plan
    axes.set_title(
        f"{plan.vms} VMs, one Freeze each in the same second, poll every {plan.poll_interval:g} s"
    )
    axes.set_xlabel("seconds")
    axes.set_ylabel("fraction of events")
    axes.axhline(0.99, color="grey", linewidth=0.5, linestyle=":")
    axes.grid(True, linewidth=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    if args_list[:1] == ["--worker"]:
        return worker(args_list[1])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Plan()
    parser.add_argument("--vms", type=int, default=defaults.vms)
    parser.add_argument("--broker", default=defaults.broker)
    parser.add_argument("--policy", help="approver policy file (default: the sample policy)")
    parser.add_argument("--poll-interval", type=float, default=defaults.poll_interval)
    parser.add_argument("--fast-poll-seconds", type=float, default=defaults.fast_poll_seconds)
    parser.add_argument(
        "--fast-poll-interval", type=float, default=defaults.fast_poll_interval,
        help="seconds between an agent's polls while it polls fast (the agent's default: 0.5)",
    )  # fmt: skip
    parser.add_argument(
        "--heartbeat-interval", type=float, default=defaults.heartbeat_interval,
        help="seconds an agent stays quiet before it sends a heartbeat, "
        f"{MIN_HEARTBEAT_INTERVAL:g} to {MAX_HEARTBEAT_INTERVAL:.0f} (the agent's default: 60); "
        "the agents declare it, and the "
        f"approver counts each live for {LIVENESS_PER_HEARTBEAT:g} of them",
    )  # fmt: skip
    parser.add_argument("--sim-shards", type=int, default=0, help="default: by polls a second")
    parser.add_argument("--agent-workers", type=int, default=0, help="default: by VMs")
    parser.add_argument("--agents-per-connection", type=int, default=defaults.agents_per_connection)
    parser.add_argument("--placement-group-size", type=int, default=defaults.placement_group_size)
    parser.add_argument("--long-share", type=float, default=defaults.long_share)
    parser.add_argument("--ramp", type=float, default=0.0, help="default: VMs / 100 s")
    parser.add_argument("--settle", type=float, default=defaults.settle)
    parser.add_argument("--timeout", type=float, default=defaults.timeout)
    parser.add_argument("--approver-db", choices=["sqlite", "memory"], default="sqlite")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--agents-nice",
        type=int,
        default=defaults.agents_nice,
        help="run the agent processes (the stand-ins for the fleet's VMs) at this niceness, so "
        "that the broker, the central services and the simulator (IMDS, a service of the host "
        "on Azure) get the CPU they need before them, as on a real fleet, where each agent has "
        "its VM's CPU to itself (default 0: every process shares the machine's cores alike)",
    )
    parser.add_argument(
        "--central-nice",
        type=int,
        default=defaults.central_nice,
        help="run the approver and the audit at this niceness; a negative one (root only) gives "
        "them a CPU before the stand-ins for the fleet, the simulator and the broker, as where "
        "the central services run on machines of their own (default 0)",
    )
    parser.add_argument("--png", help="draw the latency distributions to this PNG")
    parser.add_argument(
        "--servicebus", action="store_true", help="over the Service Bus double, not RabbitMQ"
    )
    args = parser.parse_args(args_list)
    if min(args.agents_nice, args.central_nice) < 0 and os.geteuid() != 0:
        parser.error("a negative niceness needs root (or CAP_SYS_NICE)")
    plan = Plan(
        vms=args.vms,
        broker=args.broker,
        policy=args.policy,
        poll_interval=args.poll_interval,
        fast_poll_seconds=args.fast_poll_seconds,
        heartbeat_interval=args.heartbeat_interval,
        fast_poll_interval=args.fast_poll_interval,
        sim_shards=args.sim_shards,
        agent_workers=args.agent_workers,
        agents_per_connection=args.agents_per_connection,
        placement_group_size=args.placement_group_size,
        long_share=args.long_share,
        ramp=args.ramp,
        settle=args.settle,
        timeout=args.timeout,
        approver_db=args.approver_db,
        seed=args.seed,
        servicebus=args.servicebus,
        agents_nice=args.agents_nice,
        central_nice=args.central_nice,
    )
    # The run's own times, refused before anything starts: a NaN or infinite limit made the
    # Freezes' NotBefore (past the limit) a traceback once the fleet was up, and 1e300 ended the
    # simulator; a negative one ran a fleet to report nothing.
    for name, value, least in (
        ("--timeout", plan.timeout, 1.0),
        ("--ramp", plan.ramp, 0.0),
        ("--settle", plan.settle, 0.0),
    ):
        if not (math.isfinite(value) and least <= value <= MAX_RUN_SECONDS):
            parser.error(
                f"{name} must be {least:g} to {MAX_RUN_SECONDS:.0f} seconds, got {value!r}"
            )
    try:  # the agents' settings, refused here rather than by every agent process
        AgentSettings(
            broker="memory://fleet-check",
            poll_interval=plan.poll_interval,
            fast_poll_seconds=plan.fast_poll_seconds,
            fast_poll_interval=plan.fast_poll_interval,
            heartbeat_interval=plan.heartbeat_interval,
        )
    except ConfigError as exc:
        parser.error(str(exc))
    began = time.monotonic()
    result = asyncio.run(measure(plan))
    print()
    print(table(result))
    print(f"wall time {time.monotonic() - began:.0f} s")
    if args.png:
        plot(result, args.png)
        print(f"latency distributions drawn to {args.png}")
    print(json.dumps(result.line()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
