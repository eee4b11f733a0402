"""The processes of the fleet benchmark (``fleet.py``), each run as ``python fleet.py --worker
ROLE``: the first line on stdin is its spec (JSON), then commands, one JSON object a line;
it answers with one JSON object a line on stdout (logs go to stderr).

- ``sim``: one shard of the IMDS simulator in fleet mode (:class:`Simulator` with a
  :class:`Topology` and ``SimulatorConfig(shard=...)``, served by :func:`serve`: uvicorn and
  httptools). ``events`` adds events at a wall-clock time, all in one loop turn; ``progress``
  counts events by state; ``report`` gives each event's life and the POSTs of each VM (of the
  events ``ids`` only, when given); ``faults`` adds faults (:class:`FaultSpec` bodies) and
  ``clear-faults`` drops the pending ones; ``cancel`` cancels the events ``ids`` still
  Scheduled.
- ``agents``: real agents (:class:`publisher.Agent`: IMDS client, state store in memory,
  outbox, transport), many per process, sharing one broker connection per
  ``agents_per_connection`` (RabbitMQ: a channel per agent for its approvals), started spread
  over ``ramp`` seconds. ``stop`` stops them all (each drains its outbox) and reports. With
  ``state_root`` each agent keeps its state store in ``state_root/<vm>`` (a process killed and
  started again over the same directories resumes where its agents were).
- ``approver`` / ``audit``: :class:`ApproverService` and :class:`AuditService` as the CLI runs
  them (SQLite state and ledger), with one more handler on their stream that records every
  message it is given (so duplicates reaching a handler, and transitions lost, are counted)
  and, for the approver, every decision with its time. With ``journal`` that handler also
  appends each message to that file as it is handled -- for the approver, once the commit that
  acks it is done (``before_ack``) -- so what a process killed with SIGKILL handled is still
  known.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger("fleet")


class LoopLag:
    """How late the event loop runs a timer (a busy loop answers everything late)."""

    def __init__(self, every: float = 0.1) -> None:
        self.every = every
        self.lags: list[float] = []
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.every
            await asyncio.sleep(self.every)
            self.lags.append(loop.time() - due)
            if os.environ.get("FLEET_LAG") and self.lags[-1] > 0.5:
                print(f"loop lag {self.lags[-1]:.2f} s at {time.strftime('%X')}", file=sys.stderr)

    def report(self) -> dict[str, float]:
        self._task.cancel()
        ordered = sorted(self.lags) or [0.0]
        return {
            "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
            "max": round(ordered[-1], 3),
        }


def _say(**values: Any) -> None:
    sys.stdout.write(json.dumps(values) + "\n")
    sys.stdout.flush()


async def _commands() -> Any:
    """The commands on stdin, one JSON object a line, until EOF."""
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            return
        yield json.loads(line)


# ------------------------------------------------------------------------------- simulator


async def run_sim(spec: dict[str, Any]) -> None:
    from publisher.simulator import (
        EventSpec,
        EventStateError,
        EventType,
        FaultSpec,
        Shard,
        Simulator,
        SimulatorConfig,
        Topology,
        UnknownEventError,
        serve,
    )

    shard = Shard(spec["shard"], spec["shards"])
    config = SimulatorConfig(
        rate_limit=spec["rate_limit"],
        seed=spec["seed"],
        shard=shard,
        finished_events_kept=spec.get(
            "finished_events_kept", 2 * spec["topology"]["scale_set_vms"]
        ),
    )
    sim = Simulator(config, topology=Topology.fleet(**spec["topology"]))
    keep_alive = spec.get("keep_alive", 5)
    async with serve(sim, port=0, shutdown_timeout=2, keep_alive_seconds=keep_alive) as server:
        lag = LoopLag()
        _say(url=server.base_url, vms=len(sim.served_vm_names()))
        async for command in _commands():
            op = command["op"]
            if op == "events":
                mine = [e for e in command["events"] if sim.serves(e["vm"])]
                await asyncio.sleep(max(0.0, command["at"] - time.time()))
                began = time.time()
                for event in mine:
                    sim.add_event(
                        EventSpec(
                            event_type=EventType.FREEZE,
                            resources=(event["vm"],),
                            duration_in_seconds=event["duration"],
                            not_before_seconds=event["not_before"],
                            event_id=event["id"],
                            run_seconds=event.get("run_seconds"),
                        )
                    )
                _say(added=len(mine), seconds=round(time.time() - began, 3))
            elif op == "progress":
                _say(**{state.value: n for state, n in sim.state_counts().items()})
            elif op == "report":
                wanted = set(command["ids"]) if "ids" in command else None
                events = {
                    e.event_id: {
                        "vm": e.resources[0],
                        "state": e.state.value,
                        "created": e.created_at,
                        "started": e.started_at,
                        "ended": e.ended_at,
                        "approvals": [[a.vm, a.time] for a in e.approvals],
                    }
                    for e in sim.events()
                    if wanted is None or e.event_id in wanted
                }
                posts = {
                    s.vm: s.count(method="POST")
                    for s in sim.all_request_stats()
                    if s.count(method="POST")
                }
                stats = sim.all_request_stats()
                _say(
                    events=events,
                    posts=posts,
                    busiest_vm_per_second=max((s.max_per_second for s in stats), default=0),
                    vms_over_two_per_second=sum(1 for s in stats if s.max_per_second > 2),
                    loop_lag=lag.report(),
                )
            elif op == "requests":
                stats = sim.all_request_stats()
                _say(**{m: sum(s.count(method=m) for s in stats) for m in ("GET", "POST")})
            elif op == "reset-stats":
                sim.reset_request_stats()
                _say(reset=True)
            elif op == "faults":
                for fault in command["faults"]:
                    sim.add_fault(FaultSpec.model_validate(fault))
                _say(added=len(command["faults"]))
            elif op == "clear-faults":
                _say(cleared=sim.clear_faults())
            elif op == "cancel":
                canceled = 0
                for event_id in command["ids"]:
                    try:
                        sim.cancel_event(event_id)
                    except UnknownEventError:
                        continue  # another shard's
                    except EventStateError:
                        continue  # started or over already
                    canceled += 1
                _say(canceled=canceled)


# ---------------------------------------------------------------------------------- agents

# ``FLEET_TRACE=1``: each agent process prints to stderr where a Scheduled event's time goes
# on the agent's side (detection -> publish -> confirm; approval issued -> handled -> fresh
# IMDS document -> POST done), as percentiles. ``FLEET_PROFILE=PATH``: cProfile of each process
# in ``PATH.<role>.<pid>`` (an agent process's from ready to stop, the others' whole run);
# ``FLEET_PROFILE_ROLES=approver,audit`` profiles only those roles (the profiler's own cost
# slows what it profiles, and a profiled agent process takes CPU from the rest).


def _profiled(role: str) -> bool:
    roles = os.environ.get("FLEET_PROFILE_ROLES")
    return bool(os.environ.get("FLEET_PROFILE")) and (
        roles is None or role in {r.strip() for r in roles.split(",")}
    )


#: Which process a FLEET_TRACE line is from (an agent process: its first VM's name).
_TRACE_LABEL = [""]
#: How long each commit before an ack batch took (approver: its state and approval sends).
_COMMITS: list[float] = []
#: (detected, publish began, confirmed) of each ``scheduled`` message.
_PUBLISHES: list[tuple[float, float, float]] = []
#: (issued, handling began, fresh document, POST done) of each approval applied.
_APPROVALS: list[tuple[float, float, float, float]] = []
#: When each approval reached the agent process (aiormq's delivery), by message id; and
#: (issued -> arrived, arrived -> handling began) of each.
_ARRIVED: dict[str, float] = {}
_ARRIVALS: list[tuple[float, float]] = []
#: How long each IMDS request waited for the VM's request budget, by method.
_LIMITER_WAITS: dict[str, list[float]] = {"GET": [], "POST": []}
#: How long each IMDS exchange took once admitted (GET, POST), and each new connection.
_EXCHANGES: dict[str, list[float]] = {}


#: (VM, event id, kind) of each transition the agents of this process published (confirmed),
#: so that the run can tell a transition lost on the way from one no poll of the VM saw.
_PUBLISHED: set[tuple[str, str, str]] = set()
_TRANSITION_KINDS = frozenset({"scheduled", "started", "completed", "canceled", "updated"})


def _record_publishes(transport: Any) -> None:
    """From the attributes each message carries as properties (``schemas.wire``): the stand-in
    agents' processes are short of CPU, and parsing every body again cost them for nothing."""
    from schemas.wire import CE_PREFIX

    original = transport.publish
    type_, subject = f"{CE_PREFIX}type", f"{CE_PREFIX}subject"

    async def publish(message: Any) -> None:
        await original(message)
        properties = message.properties
        kind = str(properties.get(type_, "")).rsplit(".", 1)[-1]
        if kind in _TRANSITION_KINDS and properties.get(subject):
            _PUBLISHED.add((str(properties["vm"]).casefold(), str(properties[subject]), kind))

    transport.publish = publish


def _trace_publishes(transport: Any) -> None:
    from datetime import datetime

    original = transport.publish

    async def publish(message: Any) -> None:
        began = time.time()
        await original(message)
        body = json.loads(message.body)
        if body["type"].endswith(".scheduled"):
            detected = datetime.fromisoformat(body["time"]).timestamp()
            _PUBLISHES.append((detected, began, time.time()))

    transport.publish = publish


def _trace_approvals() -> None:
    from publisher._approvals import ApprovalHandler
    from schemas.transport._amqp_consume import AmqpSubscription

    check, apply = ApprovalHandler._check_event, ApprovalHandler._apply
    marks: dict[str, list[float]] = {}
    delivered = AmqpSubscription._on_delivered

    async def traced_delivered(self: Any, message: Any) -> None:
        _ARRIVED[message.header.properties.message_id] = time.time()
        await delivered(self, message)

    AmqpSubscription._on_delivered = traced_delivered  # type: ignore[method-assign]

    async def traced_check(self: Any, approval: Any) -> Any:
        marks[approval.approval_id] = [approval.issued_at.timestamp(), time.time()]
        arrived = _ARRIVED.pop(approval.approval_id, None)
        if arrived is not None:
            _ARRIVALS.append((arrived - approval.issued_at.timestamp(), time.time() - arrived))
        event = await check(self, approval)
        marks[approval.approval_id].append(time.time())
        return event

    async def traced_apply(self: Any, approval: Any, event: Any, applied_by: Any) -> None:
        await apply(self, approval, event, applied_by)
        issued, began, fresh = marks.pop(approval.approval_id)
        _APPROVALS.append((issued, began, fresh, time.time()))

    ApprovalHandler._check_event = traced_check  # type: ignore[method-assign]
    ApprovalHandler._apply = traced_apply  # type: ignore[method-assign]


def _trace_limiter() -> None:
    import contextvars

    from publisher._http import HttpClient
    from publisher._imds import ImdsClient
    from publisher._poller import RequestLimiter

    method_of: contextvars.ContextVar[str] = contextvars.ContextVar("method", default="other")
    request, acquire = ImdsClient._request, RequestLimiter.acquire

    async def traced_request(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        method_of.set(method)  # the task's own context: requests of other tasks keep theirs
        return await request(self, method, *args, **kwargs)

    async def traced_acquire(self: Any) -> Any:
        began = time.monotonic()
        slot = await acquire(self)
        _LIMITER_WAITS.setdefault(method_of.get(), []).append(time.monotonic() - began)
        return slot

    ImdsClient._request = traced_request  # type: ignore[method-assign]
    RequestLimiter.acquire = traced_acquire  # type: ignore[method-assign]
    # How long each exchange took once admitted (GET, POST), each new connection, and each
    # request's bytes on the wire and its answer (the exchange).
    _timed(ImdsClient, "_send", lambda _slot, method, *_: method)
    _timed(HttpClient, "_connect", lambda *_: "connect")
    _timed(
        HttpClient, "_exchange", lambda _, raw, *__: f"{raw.split(b' ', 1)[0].decode()} exchange"
    )


def _timed(cls: Any, name: str, key: Callable[..., str]) -> None:
    """Wrap the coroutine method ``cls.name`` so that each call's duration is kept in
    ``_EXCHANGES`` under ``key(*its arguments)``."""
    original = getattr(cls, name)

    async def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.monotonic()
        try:
            return await original(self, *args, **kwargs)
        finally:
            _EXCHANGES.setdefault(key(*args), []).append(time.monotonic() - began)

    setattr(cls, name, timed)


def _trace(what: str, values: list[float], unit: str = "s") -> None:
    """One FLEET_TRACE line on stderr: the p50, p90, p99 and max of ``values`` (none: nothing)."""
    if not values:
        return
    ordered = sorted(values)
    at = [ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] for q in (50, 90, 99)]
    print(
        f"trace{_TRACE_LABEL[0]} {what}: p50 {at[0]:.2f} p90 {at[1]:.2f} p99 {at[2]:.2f} "
        f"max {ordered[-1]:.2f} {unit}",
        file=sys.stderr,
    )


def _trace_report() -> None:
    _trace("detected -> publish began", [b - d for d, b, _ in _PUBLISHES])
    _trace("publish began -> confirmed", [c - b for _, b, c in _PUBLISHES])
    _trace("approval issued -> handled", [b - i for i, b, _, _ in _APPROVALS])
    _trace("approval issued -> in the agent process", [a for a, _ in _ARRIVALS])
    _trace("approval in the agent process -> handled", [h for _, h in _ARRIVALS])
    _trace("handled -> fresh IMDS document", [f - b for _, b, f, _ in _APPROVALS])
    _trace("fresh document -> POST done", [p - f for _, _, f, p in _APPROVALS])
    for method, waits in _LIMITER_WAITS.items():
        _trace(f"IMDS {method}: wait for the VM's request budget", waits)
    for what, took in _EXCHANGES.items():
        _trace(f"IMDS {what}: took", took)


async def run_agents(spec: dict[str, Any]) -> None:
    from publisher import Agent, AgentSettings
    from schemas import MessageType
    from schemas.channels import ChannelNames
    from schemas.transport import open_transport

    channels = ChannelNames(**spec["channels"])
    state_root = spec.get("state_root")
    shared = spec["agents_per_connection"] > 0
    vms: list[list[str]] = spec["vms"]  # [name, imds base url]
    _TRACE_LABEL[0] = f" [agents from {vms[0][0]}]" if vms else ""
    transports = []
    if shared:
        count = math.ceil(len(vms) / spec["agents_per_connection"])
        for n in range(count):
            transport = open_transport(spec["broker"], channels, name=f"fleet agents {n}")
            await transport.connect()
            transports.append(transport)
            _record_publishes(transport)
            if os.environ.get("FLEET_TRACE"):
                _trace_publishes(transport)
    if os.environ.get("FLEET_TRACE"):
        _trace_approvals()
        _trace_limiter()
    # On its VM an agent has a thread of its own for its SQLite. Here a thousand agents share a
    # process: a thread each fight the event loop for the GIL when a burst makes them all commit
    # at once, and one shared thread made each operation wait behind up to 1,100 others (the
    # backlog FLEET_TRACE shows). So with the state on disk they share one thread; in memory (the
    # default here) the store runs each operation at once in the agents' own loop.
    state_thread = None if state_root is None else ThreadPoolExecutor(1, thread_name_prefix="state")
    agents = []
    for index, (name, url) in enumerate(vms):
        settings = AgentSettings(
            imds_url=url,
            broker=spec["broker"],
            state_dir=None if state_root is None else Path(state_root) / name,
            poll_interval=spec["poll_interval"],
            fast_poll_seconds=spec["fast_poll_seconds"],
            # The agent's own defaults where the spec says nothing (faults.py's does not).
            **{k: spec[k] for k in ("heartbeat_interval", "fast_poll_interval") if k in spec},
            trust_keys=(Path(spec["trust_key"]),),
            log_level="WARNING",
            channels=channels,
            imds_first_timeout=30.0,
            imds_timeout=spec.get("imds_timeout", 5.0),
        )
        given = transports[index // spec["agents_per_connection"]] if shared else None
        agents.append(
            Agent(
                settings,
                transport=given,
                close_transport=not shared,
                state_executor=state_thread,
            )
        )
    start_at = spec["start_at"]
    ramp = spec["ramp"]

    async def one(index: int, agent: Agent) -> None:
        await asyncio.sleep(max(0.0, start_at + ramp * index / len(agents) - time.time()))
        await agent.run()

    lag = LoopLag()
    backlog: list[float] = []  # operations waiting for the shared state thread (state on disk)

    async def sample_backlog(thread: ThreadPoolExecutor) -> None:
        while True:
            backlog.append(thread._work_queue.qsize())
            await asyncio.sleep(0.25)

    sampler = None
    if os.environ.get("FLEET_TRACE") and state_thread is not None:
        sampler = asyncio.create_task(sample_backlog(state_thread))
    if os.environ.get("FLEET_LAG"):
        began_gc = [0.0]

        def timing(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                began_gc[0] = time.perf_counter()
            elif (spent := time.perf_counter() - began_gc[0]) > 0.1:
                print(f"gc gen {info['generation']} {spent:.2f} s", file=sys.stderr)

        gc.callbacks.append(timing)
    tasks = [asyncio.create_task(one(i, a)) for i, a in enumerate(agents)]
    began = time.time()
    waits: set[asyncio.Future[Any]] = {
        asyncio.gather(*(a.ready.wait() for a in agents)),
        asyncio.ensure_future(asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)),
    }
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    # A thousand agents' objects in one heap: the collector's full passes over them stopped the
    # loop for 0.2-1.1 s every few seconds (measured with gc.callbacks). An agent alone on its
    # VM has a heap a thousand times smaller; here what exists once they run is frozen.
    gc.freeze()
    failed = [t for t in tasks if t.done() and t.exception() is not None]
    _say(ready=len([a for a in agents if a.ready.is_set()]), seconds=round(time.time() - began, 1),
         failed=[repr(t.exception()) for t in failed[:3]])  # fmt: skip
    profile = None
    if _profiled("agents"):
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    async for command in _commands():
        if command["op"] == "stop":
            break
    if profile is not None:
        profile.disable()
        profile.dump_stats(f"{os.environ['FLEET_PROFILE']}.agents.{os.getpid()}")
    _trace_report()
    if sampler is not None:
        sampler.cancel()
        _trace("state-thread backlog", backlog, "operations")
    for agent in agents:
        agent.stop("benchmark over")
    await asyncio.gather(*tasks, return_exceptions=True)
    for transport in transports:
        await transport.close()
    if state_thread is not None:
        state_thread.shutdown(wait=True)
    published: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for agent in agents:
        registry = agent.metrics.registry
        for kind in MessageType:
            value = registry.get_sample_value("agent_messages_published_total", {"kind": kind})
            if value:
                published[kind.value] += int(value)
        for error in ("throttled", "server", "timeout", "connection", "garbage", "too-large"):
            value = registry.get_sample_value("agent_imds_errors_total", {"kind": error})
            if value:
                errors[error] += int(value)
    _say(
        published=published,
        imds_errors=errors,
        peak_rps=max(a.limiter.peak for a in agents),
        loop_lag=lag.report(),
        # Only known where the agents share transports (each its own: made inside the agent).
        published_transitions=[list(key) for key in _PUBLISHED] if shared else None,
    )


# ------------------------------------------------------------------------ approver, audit


class _Seen:
    """What a handler was given: every (VM, message id), and each transition's time.

    With ``journal``, every message is also appended to that file, one JSON line ``[vm, id,
    kind, subject, received]`` written by one ``os.write`` (the kernel keeps it when the
    process is killed): at once, or -- when ``deferred`` -- at :meth:`flush`, which the
    approver's worker calls once the commit that acks those messages is done."""

    def __init__(self, journal: str | None = None, *, deferred: bool = False) -> None:
        self.ids: Counter[tuple[str, str]] = Counter()
        #: (vm, event id, kind) -> [message time (the agent's detection), received (wall)]
        self.transitions: dict[tuple[str, str, str], list[float]] = {}
        self._journal = (
            None
            if journal is None
            else os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        )
        self._deferred = deferred
        self._pending: list[str] = []

    async def __call__(self, message: Any) -> None:
        vm = message.vm.name.casefold()
        self.ids[(vm, message.id)] += 1
        if message.kind.is_transition and message.subject:
            key = (vm, message.subject, message.kind.value)
            self.transitions.setdefault(key, [message.time.timestamp(), time.time()])
        if self._journal is not None:
            line = [vm, message.id, message.kind.value, message.subject, time.time()]
            self._pending.append(json.dumps(line) + "\n")
            if not self._deferred:
                self.flush()

    def flush(self) -> None:
        """Append what was handled since the last flush to the journal."""
        self.write(self.take())

    def take(self) -> list[str]:
        """What was handled since the last take, for :meth:`write` once it is committed (not
        at all when its commit failed: it comes back)."""
        taken, self._pending = self._pending, []
        return taken

    def write(self, lines: list[str]) -> None:
        if self._journal is not None and lines:
            os.write(self._journal, "".join(lines).encode())

    def report(self) -> dict[str, Any]:
        return {
            "handled": sum(self.ids.values()),
            "duplicates": sum(n - 1 for n in self.ids.values() if n > 1),
            "transitions": [[*key, *times] for key, times in self.transitions.items()],
        }


async def run_central(role: str, spec: dict[str, Any]) -> None:
    from consumers._approver import ApproverService, Decision
    from consumers._audit import open_ledger
    from consumers._audit_service import AuditService
    from consumers._db import open_database
    from consumers._policies import PolicySet, load_policy_file
    from consumers._schema import ensure_schema
    from schemas import load_signing_key
    from schemas.channels import ChannelNames
    from schemas.transport import open_transport

    channels = ChannelNames(**spec["channels"])
    seen = _Seen(spec.get("journal"), deferred=role == "approver" and bool(spec.get("db")))
    decisions: dict[str, list[Any]] = {}

    def decided(decision: Decision) -> None:
        decisions.setdefault(decision.event_id, [decision.action.value, time.time()])

    from consumers._cli import tune_collector

    tune_collector()  # as the CLI runs the approver and the audit
    async with open_transport(spec["broker"], channels, name=f"fleet {role}") as transport:
        service: Any
        if role == "approver":
            db = open_database(spec["db"]) if spec["db"] else None
            if db is not None:
                await db.connect()
                await ensure_schema(db)
            policy = spec["policy"]
            service = ApproverService(
                transport,
                load_signing_key(Path(spec["signing_key"])),
                load_policy_file(Path(policy)) if policy else PolicySet.default(),
                db=db,
                on_decision=decided,
            )
        else:
            ledger = open_ledger(spec["db"])
            await ledger.connect()  # closed with the process
            service = AuditService(transport, ledger)
        service.stream.add_handler(seen)
        committed = service.stream.before_ack
        if committed is not None:

            async def commit_then_journal() -> asyncio.Future[None]:
                # What this commit covers is fixed when the stream's before_ack returns; the
                # approver writes it while the stream reads on (its pipeline).
                began = time.time()
                lines = seen.take()
                durable = await committed()

                async def journal() -> None:
                    if durable is not None:
                        await durable
                    seen.write(lines)
                    _COMMITS.append(time.time() - began)

                return asyncio.ensure_future(journal())

            service.stream.before_ack = commit_then_journal
        sends: list[tuple[float, float]] = []  # (issued -> send began, send began -> confirmed)
        if role == "approver" and os.environ.get("FLEET_TRACE"):
            send = service.sender.send

            async def traced_send(approval: Any, address: Any) -> None:
                began = time.time()
                await send(approval, address)
                sends.append((began - approval.issued_at.timestamp(), time.time() - began))

            service.sender.send = traced_send
        runner = asyncio.create_task(service.run())
        async with asyncio.timeout(60):
            while not service.stream.subscribed:  # noqa: ASYNC110 - the stream's own flag
                await asyncio.sleep(0.05)
        _say(ready=True)
        async for command in _commands():
            if command["op"] == "progress":
                _say(transitions=len(seen.transitions), handled=sum(seen.ids.values()))
            elif command["op"] == "stop":
                break
        service.stop()
        await runner
        _trace("approval issued -> send began", [w for w, _ in sends])
        _trace("approval send began -> confirmed", [c for _, c in sends])
        if os.environ.get("FLEET_TRACE") and _COMMITS:
            print(
                f"trace {role} commits (before each ack batch): {len(_COMMITS)}, "
                f"{sum(_COMMITS):.1f} s in all, longest {max(_COMMITS):.2f} s",
                file=sys.stderr,
            )
        stats = service.stream.stats
        _say(
            **seen.report(),
            decisions=decisions,
            received=stats.received,
            dead_lettered=stats.dead_lettered,
            reconnects=stats.reconnects,
        )


def worker(role: str) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    spec = json.loads(sys.stdin.readline())
    if spec.get("nice"):
        os.nice(spec["nice"])
    if role == "agents":
        asyncio.run(run_agents(spec))  # profiled from the moment its agents are ready
        return 0
    profile = None
    if _profiled(role):
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    if role == "sim":
        asyncio.run(run_sim(spec))
    else:
        asyncio.run(run_central(role, spec))
    if profile is not None:
        profile.disable()
        profile.dump_stats(f"{os.environ['FLEET_PROFILE']}.{role}.{os.getpid()}")
    return 0
