"""``scheduled-events demo``: the whole system in one process, playing a scenario.

The IMDS simulator (time compressed), one agent per VM, the approver (the documents' sample
policy) and the audit (SQLite in a temporary directory), all over the in-memory transport by
default, or over RabbitMQ with ``--broker amqp://...`` (entity names of the run's own, deleted
afterwards). The scenario: a user reboot approved at once, a live migration approved by policy,
a Spot preemption (30 s notice: nobody approves, it just happens) and a redeploy that Azure
cancels. A live timeline is printed while it runs, then a summary; exit 0 when every event
ended as expected. With ``console`` (``--console``), the operator console is served too, on the
same broker and database, with a sign-in token printed beside its address; the demo then keeps
running after the scenario, agents included, until Ctrl-C.

This is the one module of ``consumers`` that imports ``publisher`` (decided: the demo runs
both sides).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from publisher import Agent, AgentSettings
from publisher.simulator import EventSource as SimEventSource
from publisher.simulator import EventSpec, EventType, Simulator, SimulatorConfig, serve
from publisher.simulator import EventState as SimEventState
from schemas import DEFAULT_CHANNELS, ChannelNames, LifecycleMessage, load_signing_key
from schemas.approvals import write_key_pair
from schemas.transport import Transport, broker_kind, open_transport, redact

from ._approver import ApproverService, Decision
from ._audit import Ledger, open_ledger
from ._audit_service import AuditService
from ._db import Database
from ._policies import Action, PolicySet
from ._stream import FleetStream
from ._timeline import message_line

__all__ = ["run_demo"]

log = logging.getLogger(__name__)

VMS = ("web-01", "web-02", "spot-01", "app-01")


@dataclass(frozen=True, slots=True)
class _Step:
    """One event of the scenario: when (simulated seconds), what, and how it must end."""

    label: str
    at: float
    spec: EventSpec
    approved: bool
    end: SimEventState
    cancel_at: float | None = None


#: How long each event runs, in real seconds whatever ``--speed`` (``_play`` sets its
#: ``run_seconds``). An agent may ask IMDS twice a second (and, right after its own POST, not
#: again for a second), so a shorter run could start and end between two of its polls, and an
#: agent that did not start the event itself would have to call it canceled.
RUN_REAL_SECONDS = 1.5

SCENARIO = (
    _Step(
        "user reboot",
        5,
        EventSpec(
            event_type=EventType.REBOOT,
            resources=("web-01",),
            event_source=SimEventSource.USER,
            not_before_seconds=900,
            description="Virtual machine is going to be restarted as requested by authorized user.",
        ),
        approved=True,
        end=SimEventState.COMPLETED,
    ),
    _Step(
        "live migration",
        90,
        EventSpec(
            event_type=EventType.FREEZE,
            resources=("web-01", "web-02"),
            not_before_seconds=900,
            duration_in_seconds=5,
            description="Virtual machine is being paused because of a memory-preserving Live "
            "Migration operation.",
        ),
        approved=True,
        end=SimEventState.COMPLETED,
    ),
    _Step(
        "spot preemption",
        150,
        EventSpec(
            event_type=EventType.PREEMPT,
            resources=("spot-01",),
            not_before_seconds=30,
        ),
        approved=False,
        end=SimEventState.COMPLETED,
    ),
    _Step(
        "canceled redeploy",
        200,
        EventSpec(event_type=EventType.REDEPLOY, resources=("app-01",), not_before_seconds=600),
        approved=False,
        end=SimEventState.CANCELED,
        cancel_at=440,
    ),
)


class _Printer:
    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.start = time.monotonic()

    def __call__(self, text: str) -> None:
        if not self.quiet:
            print(f"+{time.monotonic() - self.start:5.1f}s  {text}", flush=True)


@contextlib.asynccontextmanager
async def _transport(url: str, channels: ChannelNames) -> AsyncIterator[Transport]:
    async with open_transport(url, channels) as transport:
        yield transport


@contextlib.asynccontextmanager
async def _console(
    listen: str | None, url: str, channels: ChannelNames, db: Database, key: Ed25519PrivateKey
) -> AsyncIterator[str | None]:
    """The operator console on ``listen`` (HOST:PORT), signed in with a token made now; yields
    its address, or None without ``listen``."""
    if listen is None:
        yield None
        return
    from .console._auth import Authenticator
    from .console._server import console_running, parse_listen
    from .console._sessions import SessionCodec, load_session_key

    host, port = parse_listen(listen)
    token = secrets.token_urlsafe(12)
    auth = Authenticator(SessionCodec(load_session_key(None)), token=token)
    async with (
        _transport(url, channels) as link,
        console_running(link, db, auth, signing_key=key, host=host, port=port) as (_, server),
    ):
        print(f"console: {server.url}/ (sign in with any name and the token {token})", flush=True)
        yield server.url


async def _until_interrupted(announce: str) -> None:
    """Print ``announce`` once SIGINT/SIGTERM are caught, then wait for one."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        print(announce, flush=True)
        await stop.wait()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


async def run_demo(
    broker: str, *, speed: float = 60.0, quiet: bool = False, console: str | None = None
) -> int:
    """Run the scenario; 0 when every event ended as expected, 1 otherwise. ``console``
    (HOST:PORT): serve the operator console too, and keep running until SIGINT/SIGTERM."""
    networked = broker_kind(broker) != "memory"
    suffix = f"demo-{uuid.uuid4().hex[:8]}"
    channels = DEFAULT_CHANNELS.suffixed(suffix) if networked else DEFAULT_CHANNELS
    if broker_kind(broker) == "memory" and broker.rstrip("/") in ("memory:", "memory:/"):
        broker = "memory://demo"
    say = _Printer(quiet)
    with tempfile.TemporaryDirectory(prefix="scheduled-events-demo-") as tmp:
        keys = Path(tmp) / "keys"
        _, public = write_key_pair(keys)
        key = load_signing_key(keys / "approver.key")
        simulator = Simulator(SimulatorConfig(speed=speed, rate_limit=0), vms=list(VMS))
        ledger = open_ledger(str(Path(tmp) / "audit.db"))
        print(
            f"demo: {len(VMS)} VMs on the IMDS simulator ({speed:g}x time), their agents, the "
            f"approver and the audit over {redact(broker)}"
        )
        async with (
            serve(simulator) as server,
            ledger,
            _transport(broker, channels) as approver_link,
            _transport(broker, channels) as audit_link,
            _transport(broker, channels) as timeline_link,
            _console(console, broker, channels, ledger.db, key) as console_url,
        ):
            decisions: list[Decision] = []

            def decided(decision: Decision) -> None:
                decisions.append(decision)
                target = f" -> {decision.target}" if decision.target else ""
                say(
                    f"APPROVER  {decision.event_type:<8} {decision.action.value}: "
                    f"{decision.reason}{target}"
                )

            approver = ApproverService(
                approver_link, key, PolicySet.default(), db=ledger.db, on_decision=decided
            )
            audit = AuditService(audit_link, ledger)
            timeline = FleetStream(timeline_link, "demo-timeline")

            @timeline.on()
            async def show(message: LifecycleMessage) -> None:
                if message.kind.value != "agent.heartbeat":
                    say(message_line(message)[11:])

            agents = [
                Agent(
                    AgentSettings(
                        imds_url=server.vm_url(vm),
                        broker=broker,
                        state_dir=None,
                        trust_keys=(public,),
                        poll_interval=0.2,
                        fast_poll_interval=0.1,
                        heartbeat_interval=5.0,
                        drain_timeout=5.0,
                        channels=channels,
                        log_level="WARNING",
                    )
                )
                for vm in VMS
            ]
            ok = False
            try:
                async with asyncio.TaskGroup() as group:
                    services = [
                        group.create_task(approver.run()),
                        group.create_task(audit.run()),
                        group.create_task(timeline.run()),
                    ]
                    await asyncio.sleep(0)
                    runs = [group.create_task(agent.run()) for agent in agents]
                    async with asyncio.timeout(30):
                        for agent in agents:
                            await agent.started()
                    say(f"{len(agents)} agents online; playing the scenario")
                    try:
                        ok = await _play(simulator, say)
                        await _settle(ledger, simulator, len(SCENARIO))
                        if console_url is not None:
                            await _until_interrupted(
                                f"scenario over; the console stays up at {console_url}/ with "
                                f"the agents running (IMDS simulator at {server.base_url}); "
                                "Ctrl-C to stop"
                            )
                    finally:
                        for agent in agents:
                            agent.stop("demo over")
                        async with asyncio.timeout(15):
                            await asyncio.gather(*runs, return_exceptions=True)
                        await asyncio.sleep(0.3)  # the agents' offline messages
                        approver.stop()
                        audit.stop()
                        timeline.stop()
                        del services
                ends = {
                    info.event_id: await _reported_ends(ledger, info.event_id)
                    for info in simulator.events()
                }
                ok = _summary(simulator, decisions, ends, await ledger.count()) and ok
            finally:
                if networked:
                    await _cleanup(approver_link)
    return 0 if ok else 1


async def _play(simulator: Simulator, say: _Printer) -> bool:
    """Create each event at its time and wait until every one ended."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    ids: dict[str, str] = {}
    pending = sorted(
        [(step.at, "create", step) for step in SCENARIO]
        + [(step.cancel_at, "cancel", step) for step in SCENARIO if step.cancel_at is not None],
        key=lambda item: item[0],
    )
    for at, action, step in pending:
        delay = start + simulator.to_real(at) - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if action == "create":
            run = RUN_REAL_SECONDS * simulator.config.speed
            info = simulator.add_event(step.spec.model_copy(update={"run_seconds": run}))
            ids[step.label] = info.event_id
            say(
                f"AZURE     {step.label}: {info.event_type} of {', '.join(info.resources)} "
                f"scheduled ({info.event_id})"
            )
        else:
            simulator.cancel_event(ids[step.label])
            say(f"AZURE     {step.label}: canceled")
    for step in SCENARIO:
        await simulator.wait_for_state(ids[step.label], step.end, within=30)
    return True


async def _settle(ledger: Ledger, simulator: Simulator, events: int) -> None:
    """Give the agents time to see the last event go, and the audit to record it: until every
    VM of every event has an end recorded (or 10 s)."""
    deadline = asyncio.get_running_loop().time() + 10
    while asyncio.get_running_loop().time() < deadline:
        done = [
            e
            for e in simulator.events()
            if e.state in (SimEventState.COMPLETED, SimEventState.CANCELED)
        ]
        if len(done) >= events:
            ends = [await _reported_ends(ledger, e.event_id) for e in done]
            if all(
                {vm.casefold() for vm in e.resources} <= end.keys()
                for e, end in zip(done, ends, strict=True)
            ):
                return
        await asyncio.sleep(0.2)


async def _reported_ends(ledger: Ledger, event_id: str) -> dict[str, str]:
    """How each VM's agent reported the end of an event (``completed`` or ``canceled``)."""
    return {
        entry.vm.casefold(): entry.kind
        for entry in await ledger.history(event_id=event_id)
        if entry.record == "message" and entry.kind in ("completed", "canceled")
    }


def _summary(
    simulator: Simulator,
    decisions: list[Decision],
    ends: dict[str, dict[str, str]],
    recorded: int,
) -> bool:
    print("\nsummary")
    ok = True
    events = {e.event_type: e for e in simulator.events()}
    for step in SCENARIO:
        info = events.get(step.spec.event_type)
        if info is None:
            print(f"  {step.label:<18} never created")
            ok = False
            continue
        approved = [
            d for d in decisions if d.event_id == info.event_id and d.action is Action.APPROVE
        ]
        by = (
            f"approved by policy ({approved[0].reason}) on {approved[0].target}"
            if approved
            else "not approved: NotBefore applied"
        )
        # Every VM of the event reported the end it had: an agent that missed a short event's
        # start must not call it canceled.
        reported = ends.get(info.event_id, {})
        wrong = [
            f"{vm} reported {reported.get(vm.casefold(), 'no end')}"
            for vm in info.resources
            if reported.get(vm.casefold()) != info.state.value.lower()
        ]
        good = bool(approved) == step.approved and info.state is step.end and not wrong
        ok = ok and good
        print(
            f"  {'ok ' if good else 'BAD'} {step.label:<18} {info.event_type:<9} "
            f"{','.join(info.resources):<15} {info.state.value:<9} {by}"
            + (f" ({'; '.join(wrong)})" if wrong else "")
        )
    print(f"  audit ledger: {recorded} messages recorded; approver decisions: {len(decisions)}")
    print("demo " + ("passed: every event ended as expected" if ok else "FAILED"))
    return ok


async def _cleanup(transport: Transport) -> None:
    delete = getattr(transport, "delete_topology", None)
    if delete is None:
        return
    try:
        await delete(groups=("approver", "audit", "demo-timeline"), vms=VMS, exchanges=True)
    except Exception as exc:  # best effort: the run is over either way
        log.warning("could not delete the demo's broker entities (%s); they stay", exc)
