"""A fault storm over a fleet: the fleet benchmark's processes (``_fleet_workers.py``: real
agents, the simulator in fleet mode, the approver and the audit over RabbitMQ), then one phase
per fault, each a burst of events with the fault thrown in the middle of it:

- ``link-cut``: the agents' and the approvers' broker links (each through a TCP proxy of its
  own, ``tests/transport/proxy.py``) are cut for ``--link-cut`` seconds: open connections reset,
  new ones refused;
- ``approver-kill``: two approver processes share one SQLite state (an exclusive group: one is
  active); once the active one has committed a quarter of the burst it is killed with SIGKILL
  (the standby takes over; a new standby is started);
- ``agents-kill``: the agents run ``--agents-per-process`` to a process, each with its state
  store on disk; for ``--kill-seconds`` a process is killed with SIGKILL every
  ``--kill-every`` seconds and started again over the same state directories;
- ``imds-storm``: for ``--storm-seconds`` the simulator answers, a round a second, 429s and 500s
  (every endpoint), timeouts (held past the agents' IMDS timeout) and garbage bodies (GETs);
- ``imds-hang``: every IMDS request hangs for ``--hang-seconds``; the burst appears meanwhile.

Every VM gets a Freeze of its own in each burst: DurationInSeconds 5, which the sample policy
approves, and for ``--long-share`` of them 30, which no policy approves (never to be POSTed).
An approved Freeze runs ``--run-seconds`` (the storm's: see :attr:`Plan.storm_run`). Once the
phase is over, what is still Scheduled is canceled (its agents report it) and counted too.

Counted per phase, from the simulator's event lives and what the handlers (one more handler on
the approver's and on the audit's stream, journaling to a file what it was given -- the
approver's once committed, so a killed approver's part is counted) received: transitions lost
(a scheduled, started, completed or canceled the simulator went through that a handler never
got), duplicates that reached a handler (a (VM, event, transition) given to the handlers of one
service twice), wrong POSTs (a POST StartRequests for an event no policy approves, or a second
one for an event), invented transitions (a transition a handler got that the simulator never
went through), and the recovery time: from the end of the fault to the first moment the
handlers hold every transition the simulator went through and every approvable event has been
POSTed. Every count must be 0.

    python tests/benchmarks/faults.py                  # 200 VMs, 30 s cut and hang
    python tests/benchmarks/faults.py --vms 400 --faults link-cut,imds-hang

Prints a table, then as its last line one JSON object. Stops by itself (each wait is bounded);
loopback only; the broker entities are named for the run and deleted afterwards. Asserts nothing
(``tests/scale/test_fault_storm.py`` runs a short one that does).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from publisher._watch import IMDS_BACKOFF_CAP  # noqa: E402
from tests.benchmarks._fleet_workers import worker  # noqa: E402
from tests.benchmarks.fleet import Plan as FleetPlan  # noqa: E402
from tests.benchmarks.fleet import _approvable, _Process, _processes, _topology  # noqa: E402
from tests.transport.proxy import TcpProxy  # noqa: E402

AMQP_URL = os.environ.get("RELAY_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
FAULTS = ("link-cut", "approver-kill", "agents-kill", "imds-storm", "imds-hang")
SHORT, LONG = 5, 30
TRANSITIONS = frozenset({"scheduled", "started", "updated", "completed", "canceled"})
#: Answers of 200 that are no document (the storm's garbage).
GARBAGE = (
    '{"DocumentIncarnation": 7, "Events": [{"EventId": "',
    "<html><body>502 Bad Gateway</body></html>",
    '{"Events": "none"}',
    "null",
    "\x00\x01\x02 not json",
)

Key = tuple[str, str, str]  # (vm casefolded, event id, transition)
Lives = dict[str, dict[str, Any]]  # event id -> its life, as the simulator worker reports it
Done = Callable[[Lives], bool]


@dataclass(frozen=True)
class Plan:
    vms: int = 200
    broker: str = AMQP_URL
    policy: str | None = None
    agents_per_process: int = 10
    poll_interval: float = 1.0
    imds_timeout: float = 5.0
    run_seconds: float = 10.0
    long_share: float = 0.1
    link_cut: float = 30.0
    kill_seconds: float = 20.0
    kill_every: float = 2.0
    storm_seconds: float = 20.0
    #: How long an approved Freeze of the storm's burst runs; None: longer than IMDS can be
    #: blind to its agent (see :attr:`storm_run`).
    storm_run_seconds: float | None = None
    hang_seconds: float = 30.0
    #: The longest wait for each of recovery, completion and cancellation in a phase.
    phase_timeout: float = 60.0
    faults: tuple[str, ...] = FAULTS
    seed: int = 7

    @property
    def workers(self) -> int:
        return max(1, math.ceil(self.vms / self.agents_per_process))

    @property
    def storm_run(self) -> float:
        """An event that starts and ends while IMDS fails its agent's every request is not in
        any document that agent gets: to it, a Scheduled event that vanished, which it must
        report ``canceled``. An agent can be blind the whole storm, then one more poll timing
        out and its longest back-off; so by default the storm's events run longer than that."""
        if self.storm_run_seconds is not None:
            return self.storm_run_seconds
        blind = self.storm_seconds + self.imds_timeout + IMDS_BACKOFF_CAP + 5.0
        return max(self.run_seconds, blind)


@dataclass
class Phase:
    fault: str
    detail: str = ""
    events: int = 0
    approvable: int = 0
    lost: int = 0
    duplicates_to_handlers: int = 0
    wrong_posts: int = 0
    invented: int = 0
    #: Seconds from the end of the fault to caught up; None: not within the phase timeout.
    recovery_s: float | None = None
    fault_s: float = 0.0
    #: Approvable events not Completed within the phase timeout.
    unfinished: int = 0
    lost_by_kind: dict[str, int] = field(default_factory=dict)
    invented_by_kind: dict[str, int] = field(default_factory=dict)
    duplicates_by_service: dict[str, int] = field(default_factory=dict)
    #: A few of the transitions lost and invented, to look into.
    examples: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        counts = (self.lost, self.duplicates_to_handlers, self.wrong_posts, self.invented)
        return not any(counts) and self.recovery_s is not None and not self.unfinished


@dataclass
class Result:
    plan: Plan
    phases: list[Phase] = field(default_factory=list)
    startup_s: float = 0.0
    imds_errors: dict[str, int] = field(default_factory=dict)
    processes_killed: int = 0

    def line(self) -> dict[str, Any]:
        return {
            "vms": self.plan.vms,
            "faults": {
                p.fault: {
                    "events": p.events,
                    "lost": p.lost,
                    "duplicates_to_handlers": p.duplicates_to_handlers,
                    "wrong_posts": p.wrong_posts,
                    "invented": p.invented,
                    "recovery_s": p.recovery_s,
                    "unfinished": p.unfinished,
                    "fault_s": p.fault_s,
                }
                for p in self.phases
            },
            "all_zero": all(p.clean for p in self.phases),
        }


def _via(url: str, port: int) -> str:
    """``url`` with its host and port replaced by the proxy's (loopback)."""
    split = urlsplit(url)
    auth = split.netloc.rpartition("@")[0]
    netloc = f"{auth}@127.0.0.1:{port}" if auth else f"127.0.0.1:{port}"
    return urlunsplit(split._replace(netloc=netloc))


class _Journals:
    """What each service's handlers were given, read as the journals grow."""

    def __init__(self) -> None:
        self.paths: dict[str, list[Path]] = {"approver": [], "audit": []}
        self.seen: dict[str, Counter[Key]] = {role: Counter() for role in self.paths}
        self.last_at: dict[Path, float] = {}
        self._offsets: dict[Path, int] = {}

    def add(self, role: str, path: Path) -> None:
        self.paths[role].append(path)

    def read(self) -> None:
        for role, paths in self.paths.items():
            for path in paths:
                with contextlib.suppress(FileNotFoundError), path.open("rb") as file:
                    file.seek(self._offsets.get(path, 0))
                    chunk = file.read()
                    whole = chunk[: chunk.rfind(b"\n") + 1]
                    self._offsets[path] = self._offsets.get(path, 0) + len(whole)
                    for raw in whole.splitlines():
                        vm, _id, kind, subject, received = json.loads(raw)
                        self.last_at[path] = received
                        if kind in TRANSITIONS and subject:
                            self.seen[role][(vm, subject, kind)] += 1

    def of(self, ids: set[str]) -> dict[str, Counter[Key]]:
        return {
            role: Counter({k: n for k, n in seen.items() if k[1] in ids})
            for role, seen in self.seen.items()
        }


def _expected(lives: dict[str, dict[str, Any]]) -> set[Key]:
    """The transitions the simulator took each VM through (its own event's)."""
    expected: set[Key] = set()
    for event_id, life in lives.items():
        vm = life["vm"].casefold()
        expected.add((vm, event_id, "scheduled"))
        if life["started"] is not None:
            expected.add((vm, event_id, "started"))
        if life["state"] == "Completed":
            expected.add((vm, event_id, "completed"))
        if life["state"] == "Canceled":
            expected.add((vm, event_id, "canceled"))
    return expected


class Fleet:
    """The processes, the proxies and the journals of one run."""

    def __init__(
        self, plan: Plan, procs: list[_Process], channels: Any, scratch: Path, key: Path
    ) -> None:
        from publisher.simulator import Shard, Simulator, SimulatorConfig, Topology

        self.plan = plan
        self.procs = procs
        self.channels = channels
        self.scratch = scratch
        self.key = key
        self.public = scratch / "approver.pub"
        self.topology = _topology(FleetPlan(vms=plan.vms))
        self.local = Simulator(
            SimulatorConfig(seed=plan.seed, shard=Shard(0, 1)),
            topology=Topology.fleet(**self.topology),
        )
        self.names = self.local.vm_names()
        self.rng = random.Random(plan.seed)
        self.journals = _Journals()
        self.approver_journal: dict[str, Path] = {}
        self.events: set[str] = set()
        self.invented_seen: set[Key] = set()
        self.shard: _Process | None = None
        self.url = ""
        self.approvers: list[_Process] = []
        self.audit: _Process | None = None
        self.agents: list[_Process] = []
        self.agent_specs: list[dict[str, Any]] = []
        self.agent_proxy: TcpProxy | None = None
        self.approver_proxy: TcpProxy | None = None
        self.killed = 0
        self._starting: set[asyncio.Task[Any]] = set()
        self._approver_count = 0
        self._sim_lock = asyncio.Lock()

    # ------------------------------------------------------------------------- starting

    async def start(self, agent_proxy: TcpProxy, approver_proxy: TcpProxy) -> float:
        plan = self.plan
        self.agent_proxy, self.approver_proxy = agent_proxy, approver_proxy
        shard = self.shard = self._proc("sim", "simulator")
        await shard.start(
            {"shard": 0, "shards": 1, "seed": plan.seed, "rate_limit": 5,
             "topology": self.topology, "finished_events_kept": 10 * plan.vms}
        )  # fmt: skip
        self.url = (await shard.recv(120))["url"]
        await self.start_approver()
        await asyncio.sleep(1.0)  # the first one is the active one
        await self.start_approver()
        audit = self.audit = self._proc("audit", "audit")
        journal = self.scratch / "audit.journal"
        self.journals.add("audit", journal)
        await audit.start(
            {"broker": plan.broker, "channels": asdict(self.channels),
             "db": f"sqlite:///{self.scratch}/audit.db", "journal": str(journal)}
        )  # fmt: skip
        await audit.recv(120)
        began = time.time()
        ramp = max(3.0, plan.vms / 50)
        for w in range(plan.workers):
            vms = [[n, f"{self.url}/vm/{n}"] for n in self.names[w :: plan.workers]]
            self.agent_specs.append(
                {"broker": _via(plan.broker, agent_proxy.port),
                 "channels": asdict(self.channels), "vms": vms,
                 "agents_per_connection": plan.agents_per_process,
                 "poll_interval": plan.poll_interval, "fast_poll_seconds": 10.0,
                 "imds_timeout": plan.imds_timeout, "trust_key": str(self.public),
                 "state_root": str(self.scratch / "state"),
                 "ramp": ramp * (w + 1) / plan.workers}
            )  # fmt: skip
            proc = self._proc("agents", f"agents {w}")
            self.agents.append(proc)
            await proc.start(self.agent_specs[w] | {"start_at": time.time() + 1})
        for proc in self.agents:
            answer = await proc.recv(ramp + 180)
            if answer.get("failed"):
                raise RuntimeError(f"{proc.name}: agents failed: {answer['failed']}")
        return round(time.time() - began, 1)

    def _proc(self, role: str, name: str) -> _Process:
        proc = _Process(role, name)
        self.procs.append(proc)
        return proc

    async def start_approver(self) -> _Process:
        assert self.approver_proxy is not None
        self._approver_count += 1
        proc = self._proc("approver", f"approver {self._approver_count}")
        journal = self.scratch / f"approver-{self._approver_count}.journal"
        self.journals.add("approver", journal)
        self.approver_journal[proc.name] = journal
        await proc.start(
            {"broker": _via(self.plan.broker, self.approver_proxy.port),
             "channels": asdict(self.channels), "signing_key": str(self.key),
             "policy": self.plan.policy, "db": f"sqlite:///{self.scratch}/approver.db",
             "journal": str(journal)}
        )  # fmt: skip
        await proc.recv(120)
        self.approvers.append(proc)
        return proc

    def _in_background(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def settle_starts(self) -> None:
        """Wait for the processes started in the background (a restarted agent process that is
        killed again before it is ready ends its start with an error: that is expected)."""
        if self._starting:
            await asyncio.gather(*self._starting, return_exceptions=True)

    async def kill(self, proc: _Process) -> None:
        assert proc.process is not None
        if proc.process.returncode is None:
            os.kill(proc.pid, signal.SIGKILL)
        await proc.process.wait()
        self.killed += 1

    # --------------------------------------------------------------------------- state

    async def sim(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.shard is not None
        async with self._sim_lock:  # one command at a time: the answers come in order
            return await self.shard.ask(command, timeout=60)

    async def lives(self, ids: set[str]) -> dict[str, dict[str, Any]]:
        report = await self.sim({"op": "report", "ids": sorted(ids)})
        lives: dict[str, dict[str, Any]] = report["events"]
        return lives

    async def until(self, ids: set[str], done: Done, within: float) -> float | None:
        """The time ``done(lives)`` first holds with every transition expected in both
        services' handlers; None after ``within`` seconds."""
        deadline = time.monotonic() + within
        while True:
            lives = await self.lives(ids)
            self.journals.read()
            expected = _expected(lives)
            seen = self.journals.of(ids)
            if all(expected <= s.keys() for s in seen.values()) and done(lives):
                return time.time()
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.5)

    # ---------------------------------------------------------------------------- phases

    def new_events(self, run_seconds: float) -> dict[str, dict[str, Any]]:
        plan = self.plan
        every = round(1 / plan.long_share) if plan.long_share > 0 else 0
        events = {
            str(uuid.uuid4()).upper(): {
                "vm": name,
                "duration": LONG if every and i % every == every - 1 else SHORT,
                "not_before": 900,
                "run_seconds": run_seconds,
            }
            for i, name in enumerate(self.names)
        }
        self.events.update(events)
        return events

    async def phase(self, fault: str) -> Phase:
        plan = self.plan
        phase = Phase(fault)
        run = plan.storm_run if fault == "imds-storm" else plan.run_seconds
        events = self.new_events(run)
        ids = set(events)
        approvable = _approvable(FleetPlan(policy=plan.policy), events)
        phase.events, phase.approvable = len(events), len(approvable)
        throw = getattr(self, "_" + fault.replace("-", "_"))
        if fault == "imds-hang":  # the burst appears while IMDS hangs
            hang_at = await self._hang()
            burst_at = time.time() + 2.0
            thrown = asyncio.ensure_future(throw(phase, hang_at, ids))
        else:
            burst_at = time.time() + 1.0
            thrown = asyncio.ensure_future(throw(phase, burst_at, ids))
        try:
            await self.sim(
                {"op": "events", "at": burst_at,
                 "events": [{"id": i, **e} for i, e in events.items()]}
            )  # fmt: skip
            print(f"[{fault}] {len(events)} events ({len(approvable)} approvable) ...", flush=True)
            began, ended = await thrown
        finally:
            if not thrown.done():
                thrown.cancel()
        phase.fault_s = round(ended - began, 1)
        print(f"[{fault}] {phase.detail}; over after {phase.fault_s} s", flush=True)

        def posted(lives: Lives) -> bool:
            return all(
                lives[e]["approvals"] or lives[e]["state"] != "Scheduled" for e in approvable
            )

        def completed(lives: Lives) -> bool:
            return all(lives[e]["state"] == "Completed" for e in approvable)

        caught_up = await self.until(ids, posted, plan.phase_timeout)
        if caught_up is not None:
            phase.recovery_s = round(max(0.0, caught_up - ended), 1)
        await self.until(ids, completed, plan.phase_timeout)
        # What is still Scheduled (never approvable, or never approved) goes, so the next
        # phase starts from a quiet fleet; its agents report it canceled.
        await self.sim({"op": "cancel", "ids": sorted(ids)})
        await self.until(ids, lambda _: True, plan.phase_timeout)
        await self.settle_starts()
        await self._account(phase, ids, approvable)
        print(
            f"[{fault}] recovered in {phase.recovery_s} s; lost {phase.lost}, duplicates "
            f"{phase.duplicates_to_handlers}, wrong POSTs {phase.wrong_posts}, invented "
            f"{phase.invented}, unfinished {phase.unfinished} {phase.examples}",
            flush=True,
        )
        return phase

    async def _account(self, phase: Phase, ids: set[str], approvable: set[str]) -> None:
        lives = await self.lives(ids)
        self.journals.read()
        expected = _expected(lives)
        seen = self.journals.of(ids)
        lost = {key for s in seen.values() for key in expected - s.keys()}
        invented = {key for s in seen.values() for key in s.keys() - expected}
        # Transitions of events no phase created (at most counted once, where first seen).
        for s in self.journals.seen.values():
            invented |= {k for k in s if k[1] not in self.events} - self.invented_seen
        self.invented_seen |= invented
        phase.lost, phase.invented = len(lost), len(invented)
        phase.lost_by_kind = dict(Counter(kind for _, _, kind in lost))
        phase.invented_by_kind = dict(Counter(kind for _, _, kind in invented))
        phase.examples = [f"lost {k}" for k in sorted(lost)[:3]] + [
            f"invented {k}" for k in sorted(invented)[:3]
        ]
        repeated = {role: {k: n for k, n in s.items() if n > 1} for role, s in seen.items()}
        phase.duplicates_by_service = {
            role: sum(n - 1 for n in r.values()) for role, r in repeated.items() if r
        }
        phase.duplicates_to_handlers = sum(phase.duplicates_by_service.values())
        phase.examples += [
            f"{n} x to the {role}: {k}"
            for role, r in repeated.items()
            for k, n in list(r.items())[:3]
        ]
        wrong = 0
        for event_id, life in lives.items():
            posts = len(life["approvals"])
            wrong += max(0, posts - 1) if event_id in approvable else posts
        phase.wrong_posts = wrong
        phase.unfinished = sum(1 for e in approvable if lives[e]["state"] != "Completed")

    @staticmethod
    async def _at(moment: float) -> None:
        await asyncio.sleep(max(0.0, moment - time.time()))

    # ---------------------------------------------------------------------------- faults

    async def _link_cut(self, phase: Phase, burst_at: float, ids: set[str]) -> tuple[float, float]:
        assert self.agent_proxy is not None
        assert self.approver_proxy is not None
        await self._at(burst_at + 1.5)
        began = time.time()
        await asyncio.gather(self.agent_proxy.cut(), self.approver_proxy.cut())
        await asyncio.sleep(self.plan.link_cut)
        await self.agent_proxy.restore()
        await self.approver_proxy.restore()
        phase.detail = f"agents' and approvers' broker links cut for {self.plan.link_cut:g} s"
        return began, time.time()

    async def _approver_kill(
        self, phase: Phase, burst_at: float, ids: set[str]
    ) -> tuple[float, float]:
        await self._at(burst_at)
        quarter = max(1, len(ids) // 4)
        deadline = time.monotonic() + 30
        victim = self.approvers[0]
        while time.monotonic() < deadline:
            self.journals.read()
            # The active one: the approver whose journal grew last (only it handles).
            victim = max(
                self.approvers,
                key=lambda p: self.journals.last_at.get(self.approver_journal[p.name], 0.0),
            )
            seen = self.journals.seen["approver"]
            if sum(1 for k in seen if k[1] in ids and k[2] == "scheduled") >= quarter:
                break
            await asyncio.sleep(0.05)
        began = time.time()
        await self.kill(victim)
        self.approvers.remove(victim)
        phase.detail = f"active approver ({victim.name}) killed (SIGKILL) mid-burst"
        self._in_background(self.start_approver())  # the next standby
        return began, began

    async def _agents_kill(
        self, phase: Phase, burst_at: float, ids: set[str]
    ) -> tuple[float, float]:
        plan = self.plan
        await self._at(burst_at + 0.5)
        began = last = time.time()
        slots = list(range(len(self.agents)))
        self.rng.shuffle(slots)
        kills = 0
        while time.time() - began < plan.kill_seconds:
            slot = slots[kills % len(slots)]
            await self.kill(self.agents[slot])
            last = time.time()
            kills += 1
            proc = self._proc("agents", f"agents {slot} (restart {kills})")
            self.agents[slot] = proc
            await proc.start(self.agent_specs[slot] | {"start_at": time.time(), "ramp": 0.5})
            self._in_background(proc.recv(120))
            await asyncio.sleep(plan.kill_every)
        agents = sum(len(self.agent_specs[s]["vms"]) for s in slots[: min(kills, len(slots))])
        phase.detail = (
            f"{kills} agent processes ({agents} agents) killed (SIGKILL) and restarted, one "
            f"every {plan.kill_every:g} s"
        )
        return began, last

    async def _imds_storm(
        self, phase: Phase, burst_at: float, ids: set[str]
    ) -> tuple[float, float]:
        plan = self.plan
        await self._at(burst_at + 1.0)
        began = time.time()
        timeout = plan.imds_timeout + 1
        rounds = Counter[str]()
        n = 0
        while time.time() - began < plan.storm_seconds:
            kinds: list[tuple[str, dict[str, Any]]] = [
                ("429", {"status": 429}),
                ("500", {"status": 500}),
                ("timeout", {"delay_seconds": timeout, "method": "GET"}),
                ("garbage", {"body": GARBAGE[n % len(GARBAGE)], "method": "GET"}),
            ]
            name, fault = kinds[n % len(kinds)]
            rounds[name] += 1
            n += 1
            await self.sim({"op": "clear-faults"})
            await self.sim({"op": "faults", "faults": [fault | {"times": len(self.names)}]})
            await asyncio.sleep(1.0)
        await self.sim({"op": "clear-faults"})
        phase.detail = (
            "IMDS storm: "
            + ", ".join(f"{k} x{v}" for k, v in rounds.items())
            + f" rounds of {len(self.names)} requests, one a second (approved events run "
            f"{plan.storm_run:g} s)"
        )
        return began, time.time()

    async def _hang(self) -> float:
        """Every IMDS request from now on hangs (past the end of the hang); when it began."""
        plan = self.plan
        began = time.time()
        tries = math.ceil(plan.hang_seconds / plan.imds_timeout) + 4
        await self.sim(
            {"op": "faults",
             "faults": [{"delay_seconds": plan.hang_seconds + 5, "times": tries * len(self.names)}]}
        )  # fmt: skip
        return began

    async def _imds_hang(self, phase: Phase, hang_at: float, ids: set[str]) -> tuple[float, float]:
        plan = self.plan
        await self._at(hang_at + plan.hang_seconds)
        await self.sim({"op": "clear-faults"})
        phase.detail = f"every IMDS request hangs for {plan.hang_seconds:g} s"
        return hang_at, time.time()

    # ------------------------------------------------------------------------- stopping

    async def stop(self, result: Result) -> None:
        """Stop the agents (each drains its outbox), then the approvers and the audit."""

        async def stop(proc: _Process) -> dict[str, Any]:
            if proc.process is None or proc.process.returncode is not None:
                return {}
            with contextlib.suppress(RuntimeError, TimeoutError):
                return await proc.ask({"op": "stop"}, timeout=120)
            return {}

        for report in await asyncio.gather(*(stop(p) for p in self.agents)):
            for kind, count in report.get("imds_errors", {}).items():
                result.imds_errors[kind] = result.imds_errors.get(kind, 0) + count
        await asyncio.gather(*(stop(p) for p in [*self.approvers, *filter(None, [self.audit])]))


async def measure(plan: Plan) -> Result:
    from schemas.approvals import write_key_pair
    from schemas.channels import ChannelNames
    from schemas.transport import open_transport

    unknown = set(plan.faults) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
    result = Result(plan)
    channels = ChannelNames().suffixed(f"faults-{uuid.uuid4().hex[:8]}")
    target = urlsplit(plan.broker)
    host, port = target.hostname or "127.0.0.1", target.port or 5672
    with tempfile.TemporaryDirectory(prefix="faults-") as scratch_dir:
        scratch = Path(scratch_dir)
        key, _public = write_key_pair(scratch)  # approver.key, approver.pub
        coordinator = open_transport(plan.broker, channels, name="faults coordinator")
        async with (
            coordinator,
            TcpProxy(host, port) as agent_proxy,
            TcpProxy(host, port) as approver_proxy,
            _processes() as procs,  # stopped before the proxies close
        ):
            fleet = Fleet(plan, procs, channels, scratch, key)
            await coordinator.declare_group("approver", exclusive=True)
            await coordinator.declare_group("audit")
            try:
                result.startup_s = await fleet.start(agent_proxy, approver_proxy)
                print(
                    f"{plan.vms} agents in {plan.workers} processes ready after "
                    f"{result.startup_s} s",
                    flush=True,
                )
                await asyncio.sleep(3.0)
                for fault in plan.faults:
                    result.phases.append(await fleet.phase(fault))
                await fleet.stop(result)
            finally:
                result.processes_killed = fleet.killed
                await fleet.settle_starts()
                print("deleting the run's broker entities ...", flush=True)
                with contextlib.suppress(Exception):
                    await coordinator.delete_topology(  # type: ignore[attr-defined]
                        groups=["approver", "audit"], vms=fleet.names, exchanges=True
                    )
    return result


def table(result: Result) -> str:
    plan = result.plan
    lines = [
        f"{plan.vms} VMs, {plan.workers} agent processes of {plan.agents_per_process}, "
        f"2 approvers (one active) and the audit, broker {plan.broker.split('@')[-1]}; "
        f"agents ready after {result.startup_s} s; {result.processes_killed} processes "
        "killed with SIGKILL",
        "",
        f"| {'fault':13} | {'events':>6} | {'lost':>4} | {'duplicates':>10} | "
        f"{'wrong POSTs':>11} | {'invented':>8} | {'recovery s':>10} | {'fault s':>7} |",
        f"| {'-' * 13} | {'-' * 5}: | {'-' * 3}: | {'-' * 9}: | {'-' * 10}: | {'-' * 7}: | "
        f"{'-' * 9}: | {'-' * 6}: |",
    ]
    for p in result.phases:
        recovery = "never" if p.recovery_s is None else f"{p.recovery_s:g}"
        lines.append(
            f"| {p.fault:13} | {p.events:>6} | {p.lost:>4} | {p.duplicates_to_handlers:>10} | "
            f"{p.wrong_posts:>11} | {p.invented:>8} | {recovery:>10} | {p.fault_s:>7g} |"
        )
    lines.append("")
    for p in result.phases:
        extra = ""
        if p.lost_by_kind or p.invented_by_kind or p.unfinished or p.duplicates_by_service:
            extra = (
                f" (lost {p.lost_by_kind}, invented {p.invented_by_kind}, duplicates "
                f"{p.duplicates_by_service}, approvable not completed {p.unfinished})"
            )
        lines.append(f"{p.fault}: {p.detail}{extra}")
        lines += [f"    {example}" for example in p.examples]
    lines.append(f"IMDS errors the agents saw (processes never killed): {result.imds_errors}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    if args_list[:1] == ["--worker"]:
        return worker(args_list[1])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Plan()
    parser.add_argument("--vms", type=int, default=d.vms)
    parser.add_argument("--broker", default=d.broker)
    parser.add_argument("--policy", help="approver policy file (default: the sample policy)")
    parser.add_argument("--agents-per-process", type=int, default=d.agents_per_process)
    parser.add_argument("--poll-interval", type=float, default=d.poll_interval)
    parser.add_argument("--imds-timeout", type=float, default=d.imds_timeout)
    parser.add_argument("--run-seconds", type=float, default=d.run_seconds)
    parser.add_argument("--long-share", type=float, default=d.long_share)
    parser.add_argument("--link-cut", type=float, default=d.link_cut)
    parser.add_argument("--kill-seconds", type=float, default=d.kill_seconds)
    parser.add_argument("--kill-every", type=float, default=d.kill_every)
    parser.add_argument("--storm-seconds", type=float, default=d.storm_seconds)
    parser.add_argument("--storm-run-seconds", type=float, help="default: see Plan.storm_run")
    parser.add_argument("--hang-seconds", type=float, default=d.hang_seconds)
    parser.add_argument("--phase-timeout", type=float, default=d.phase_timeout)
    parser.add_argument("--faults", default=",".join(FAULTS), help="which, in order")
    parser.add_argument("--seed", type=int, default=d.seed)
    args = parser.parse_args(args_list)
    plan = Plan(
        vms=args.vms,
        broker=args.broker,
        policy=args.policy,
        agents_per_process=args.agents_per_process,
        poll_interval=args.poll_interval,
        imds_timeout=args.imds_timeout,
        run_seconds=args.run_seconds,
        long_share=args.long_share,
        link_cut=args.link_cut,
        kill_seconds=args.kill_seconds,
        kill_every=args.kill_every,
        storm_seconds=args.storm_seconds,
        storm_run_seconds=args.storm_run_seconds,
        hang_seconds=args.hang_seconds,
        phase_timeout=args.phase_timeout,
        faults=tuple(f.strip() for f in args.faults.split(",") if f.strip()),
        seed=args.seed,
    )
    began = time.monotonic()
    result = asyncio.run(measure(plan))
    print()
    print(table(result))
    print(f"wall time {time.monotonic() - began:.0f} s")
    print(json.dumps(result.line()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
