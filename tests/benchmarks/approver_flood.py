"""The approver at fleet size: messages per second through :class:`ApproverService` with many
open events, in memory and with its durable state (SQLite, or PostgreSQL with ``--db``).

Two phases, one service:

1. **fill**: ``--open`` VMs each report an event no policy approves (a platform Reboot: it
   waits for NotBefore) and stay open for the rest of the run, like a fleet in a maintenance
   wave or VMs that vanished with an event in hand;
2. **flood**: ``--flood`` messages of other VMs, each VM's whole story of a short Freeze, as a
   burst delivers them: ``scheduled`` (approved: an approval is signed and sent), then
   ``approval.applied``, ``started`` and ``completed``, with a heartbeat now and then. With the
   default policy file a guard (``max_unavailable`` by fault domain) holds part of the wave, so
   ``started``/``completed`` change capacity and the held events are decided again.

Each phase's messages wait in the group's queue on the in-memory transport, then the service
runs until it has handled them all: the stream (decode, dedupe, acks, and with a database the
commit of each ack batch) and the service's whole work per message (fleet view, policies,
durable state, approvals signed and sent). The broker is left out: it costs the same whatever
the number of open events. The flood runs once on an empty view and once after the fill, so
the two rates show whether the cost per message grows with the number of open events.
``FleetView.prune`` (once a minute in the service) is timed over the full view.

    python tests/benchmarks/approver_flood.py [--open 20000] [--flood 50000]
        [--store memory|sqlite|all] [--db postgresql://...] [--policy FILE]
        [--default-collector]

The service runs with the collector thresholds its CLI sets (``tune_collector``);
``--default-collector`` keeps Python's, for comparison.

Prints a table, then the figures as one JSON line. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from consumers._approver import ApproverService
from consumers._cli import tune_collector
from consumers._db import Database, open_database
from consumers._policies import PolicySet, load_policy_file, parse_policy
from consumers._schema import ensure_schema
from schemas import (
    AgentData,
    AgentMessage,
    ApprovalOutcomeData,
    ApprovalOutcomeMessage,
    LifecycleMessage,
    MessageType,
    ReplyAddress,
    ScheduledEvent,
    Transition,
    TransitionKind,
    TransitionMessage,
    VmIdentity,
    decode,
)
from schemas.approvals import generate_signing_key
from schemas.channels import ChannelNames
from schemas.transport import MemoryTransport
from schemas.wire import lifecycle_message

#: The benchmark's default policy: the documents' sample policy, and at most a fifth of each
#: fault domain down at once.
DEFAULT_POLICY = {
    "approve": {"user_initiated": {}, "freeze": {"max_duration_seconds": 9}},
    "max_unavailable": [{"group_by": "fault_domain", "percent": 20}],
}
FAULT_DOMAINS = 5
ZONES = ("1", "2", "3")


@dataclass
class Phase:
    messages: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0


@dataclass
class Run:
    store: str
    open_events: int
    fill: Phase | None
    flood: Phase
    approvals_sent: int
    decisions: int
    prune_ms: float


def _identity(name: str, index: int) -> VmIdentity:
    return VmIdentity(
        name=name,
        resource_group="rg-fleet",
        scale_set=name.rsplit("_", 1)[0],
        zone=ZONES[index % len(ZONES)],
        fault_domain=index % FAULT_DOMAINS,
        update_domain=index % 5,
        subscription_id="sub-1",
    )


def _event(event_id: str, vm: str, event_type: str, status: str, duration: int) -> ScheduledEvent:
    not_before = datetime.now(UTC) + timedelta(minutes=15)
    return ScheduledEvent.from_imds(
        {
            "EventId": event_id,
            "EventStatus": status,
            "EventType": event_type,
            "ResourceType": "VirtualMachine",
            "Resources": [vm],
            "NotBefore": ""
            if status == "Started"
            else not_before.strftime("%a, %d %b %Y %H:%M:%S GMT"),
            "Description": "benchmark",
            "EventSource": "Platform",
            "DurationInSeconds": duration,
        }
    )


def _transition(
    kind: TransitionKind, event: ScheduledEvent, vm: VmIdentity, reply: ReplyAddress
) -> TransitionMessage:
    previous = {
        TransitionKind.SCHEDULED: None,
        TransitionKind.STARTED: "Scheduled",
        TransitionKind.COMPLETED: "Started",
    }[kind]
    return TransitionMessage.build(
        Transition(kind, event, previous, 1), vm=vm, reply_to=reply, observed_at=datetime.now(UTC)
    )


def _heartbeat(vm: VmIdentity, reply: ReplyAddress) -> AgentMessage:
    return AgentMessage.build(
        MessageType.AGENT_HEARTBEAT,
        AgentData(vm=vm, agent_version="0.1.0", reply_to=reply, document_incarnation=1),
        observed_at=datetime.now(UTC),
        instance="bench",
    )


def fill_messages(count: int, reply_channel: str) -> list[bytes]:
    """``count`` VMs, each with a Reboot no policy approves: open for the whole run."""
    out: list[bytes] = []
    for index in range(count):
        name = f"idle_{index}"
        vm = _identity(name, index)
        reply = ReplyAddress(channel=reply_channel, key=name)
        event = _event(str(uuid.uuid4()).upper(), name, "Reboot", "Scheduled", -1)
        out.append(_heartbeat(vm, reply).to_bytes())
        out.append(_transition(TransitionKind.SCHEDULED, event, vm, reply).to_bytes())
    return out


def flood_messages(count: int, reply_channel: str, decided_by: str) -> list[bytes]:
    """About ``count`` messages: per VM a short Freeze scheduled, approved, started and
    completed (and a heartbeat for one VM in ten), scheduled first for the whole burst."""
    waves: list[list[LifecycleMessage]] = [[], [], []]
    total = 0
    index = 0
    while total < count:
        name = f"burst_{index}"
        vm = _identity(name, index)
        reply = ReplyAddress(channel=reply_channel, key=name)
        event_id = str(uuid.uuid4()).upper()
        scheduled = _event(event_id, name, "Freeze", "Scheduled", 5)
        started = _event(event_id, name, "Freeze", "Started", 5)
        waves[0].append(_transition(TransitionKind.SCHEDULED, scheduled, vm, reply))
        applied = ApprovalOutcomeMessage.build(
            ApprovalOutcomeData(
                vm=vm,
                event_id=event_id,
                approval_id=str(uuid.uuid4()),
                decided_by=decided_by,
                applied=True,
                event=scheduled,
                reply_to=reply,
            ),
            observed_at=datetime.now(UTC),
        )
        waves[1] += [applied, _transition(TransitionKind.STARTED, started, vm, reply)]
        waves[2].append(_transition(TransitionKind.COMPLETED, started, vm, reply))
        total += 4
        if index % 10 == 0:
            waves[1].append(_heartbeat(vm, reply))
            total += 1
        index += 1
    return [m.to_bytes() for wave in waves for m in wave][:count]


async def _feed(service: ApproverService, transport: MemoryTransport, bodies: list[bytes]) -> Phase:
    """Queue ``bodies``, then run the service until it has handled (and committed) them."""
    for body in bodies:
        message = decode(body)
        await transport.publish(lifecycle_message(message))
    target = service.stream.stats.received + len(bodies)
    began = time.perf_counter()
    runner = asyncio.create_task(service.run())
    while service.stream.stats.received < target and not runner.done():  # noqa: ASYNC110
        await asyncio.sleep(0.005)
    await service.commit()
    elapsed = time.perf_counter() - began
    service.stop()
    await runner
    return Phase(len(bodies), elapsed)


async def measure(
    store: str, open_events: int, flood: int, policies: PolicySet, db_url: str | None = None
) -> Run:
    group = f"approver-{uuid.uuid4().hex[:8]}"
    channels = ChannelNames().suffixed(group)
    db: Database | None = None
    with tempfile.TemporaryDirectory(prefix="approver-flood-") as scratch:
        if store == "sqlite":
            db = open_database(f"sqlite:///{scratch}/approver.db")
        elif store == "postgres":
            assert db_url is not None
            db = open_database(db_url)
        async with MemoryTransport(f"flood-{group}", channels) as transport:
            await transport.declare_group(group)
            if db is not None:
                await db.connect()
                await ensure_schema(db)
            try:
                decided_by = "bench-approver"
                service = ApproverService(
                    transport,
                    generate_signing_key(),
                    policies,
                    group=group,
                    decided_by=decided_by,
                    db=db,
                )
                reply = transport.reply_address("x").channel
                fill = None
                if open_events:
                    fill = await _feed(service, transport, fill_messages(open_events, reply))
                opened = sum(1 for _ in service.fleet.events(open_only=True))
                result = await _feed(service, transport, flood_messages(flood, reply, decided_by))
                began = time.perf_counter()
                service.fleet.prune(datetime.now(UTC))
                prune_ms = (time.perf_counter() - began) * 1000
                return Run(
                    store=store,
                    open_events=opened,
                    fill=fill,
                    flood=result,
                    approvals_sent=len(service.sender.sent),
                    decisions=len(service.decisions),
                    prune_ms=round(prune_ms, 1),
                )
            finally:
                if db is not None:
                    if store == "postgres":
                        await _forget_group(db, group)
                    await db.close()


async def _forget_group(db: Database, group: str) -> None:
    """The PostgreSQL rows this run wrote (its group's), so the database is left as found."""
    async with db.transaction() as tx:
        await tx.execute("DELETE FROM approver_messages WHERE grp = ?", group)
        await tx.execute("DELETE FROM approver_approvals WHERE grp = ?", group)
        await tx.execute(
            "DELETE FROM central_meta WHERE key = ?", f"approver_state_version:{group}"
        )


def _table(runs: list[Run]) -> str:
    lines = [
        f"| {'state':8} | {'open events':>11} | {'fill msg/s':>10} | {'flood msgs':>10} | "
        f"{'flood s':>8} | {'flood msg/s':>11} | {'prune ms':>8} |",
        f"| {'-' * 8} | {'-' * 10}: | {'-' * 9}: | {'-' * 9}: | {'-' * 7}: | {'-' * 10}: | "
        f"{'-' * 7}: |",
    ]
    for run in runs:
        fill = f"{run.fill.rate:,.0f}" if run.fill else "-"
        lines.append(
            f"| {run.store:8} | {run.open_events:>11,} | {fill:>10} | {run.flood.messages:>10,} |"
            f" {run.flood.seconds:>8.1f} | {run.flood.rate:>11,.0f} | {run.prune_ms:>8.1f} |"
        )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[Run]:
    policies = load_policy_file(Path(args.policy)) if args.policy else parse_policy(DEFAULT_POLICY)
    stores = ["memory", "sqlite"] if args.store == "all" else [args.store]
    if args.db:
        stores.append("postgres")
    runs: list[Run] = []
    for store in stores:
        for opened in (0, args.open):
            run = await measure(store, opened, args.flood, policies, args.db)
            print(
                f"{store}: {run.open_events} open events, flood {run.flood.rate:,.0f} msg/s",
                flush=True,
            )
            runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--open", type=int, default=20_000, help="open events before the flood")
    parser.add_argument("--flood", type=int, default=50_000, help="messages in the flood")
    parser.add_argument("--store", choices=["memory", "sqlite", "all"], default="all")
    parser.add_argument("--db", help="also run with this PostgreSQL database (its rows removed)")
    parser.add_argument("--policy", help="a policy file (default: sample policy + a guard)")
    parser.add_argument(
        "--default-collector",
        action="store_true",
        help="keep Python's collector thresholds (the CLI's services tune them)",
    )
    args = parser.parse_args(argv)
    if not args.default_collector:
        tune_collector()  # as the CLI runs the approver
    runs = asyncio.run(main_async(args))
    print()
    print(_table(runs))
    print(json.dumps([asdict(run) for run in runs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
