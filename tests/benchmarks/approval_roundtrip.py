"""The approval round trip: an event appears in IMDS -> the agent sees it and publishes it -> the
approver decides (the documents' default policy approves a short Freeze) -> the signed approval
reaches the agent -> POST StartRequests at IMDS. p50 and p99 over ``--events`` events, for two
checkouts of the project in one run on this machine: ``--before`` (a git revision, checked out
into a temporary worktree) and the working tree, so the cost of version binding and of the
approver's durable state (``--db``, SQLite) shows against the same noise.

Both run the same way: the simulator in-process, ``--vms`` agents polling every
``--poll-interval`` (at most 5 IMDS requests a second each, both versions), the approver in the
same process, RabbitMQ on loopback with names of their own (deleted afterwards).

    python tests/benchmarks/approval_roundtrip.py --before c64729b --events 60
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def _measure(args: argparse.Namespace) -> dict[str, object]:
    """Runs inside the checkout under test (its code on sys.path)."""
    from consumers._approver import ApproverService
    from publisher import Agent, AgentSettings
    from publisher.simulator import EventSpec, EventType, Simulator, SimulatorConfig, serve
    from schemas import ChannelNames, load_signing_key
    from schemas.approvals import write_key_pair
    from schemas.transport import open_transport

    tmp = Path(tempfile.mkdtemp(prefix="roundtrip-"))
    _, public = write_key_pair(tmp)
    key = load_signing_key(tmp / "approver.key")
    vms = [f"bench-{i}" for i in range(args.vms)]
    channels = ChannelNames().suffixed(uuid.uuid4().hex[:10])
    sim = Simulator(SimulatorConfig(rate_limit=0), vms=vms)
    fields = set(inspect.signature(AgentSettings).parameters)
    extra = {"imds_max_rps": 5, "fast_poll_interval": args.poll_interval}
    durable = "db" in inspect.signature(ApproverService).parameters
    async with serve(sim) as server, open_transport(args.broker, channels) as link:
        ledger = None
        kwargs: dict[str, object] = {}
        if durable:
            from consumers._audit import open_ledger

            ledger = open_ledger(f"sqlite:///{tmp / 'central.db'}")
            await ledger.connect()
            kwargs["db"] = ledger.db
        approver = ApproverService(link, key, **kwargs)  # type: ignore[arg-type]
        await link.declare_group("approver", exclusive=True)
        approving = asyncio.create_task(approver.run())
        agents = [
            Agent(
                AgentSettings(
                    imds_url=server.vm_url(vm),
                    broker=args.broker,
                    state_dir=tmp / vm,
                    trust_keys=(public,),
                    poll_interval=args.poll_interval,
                    channels=channels,
                    **{k: v for k, v in extra.items() if k in fields},
                )
            )
            for vm in vms
        ]
        runs = [asyncio.create_task(agent.run()) for agent in agents]
        for agent in agents:
            await agent.started(30)
        await asyncio.sleep(1.0)
        round_trips: list[float] = []
        try:
            for index in range(args.events):
                vm = vms[index % len(vms)]
                created = time.time()
                event = sim.add_event(
                    EventSpec(
                        event_type=EventType.FREEZE,
                        resources=(vm,),
                        duration_in_seconds=5,
                        not_before_seconds=900,
                        run_seconds=1,
                    )
                )
                async with asyncio.timeout(30):
                    while not sim.get_event(event.event_id).approvals:  # noqa: ASYNC110
                        await asyncio.sleep(0.002)
                approved = sim.get_event(event.event_id).approvals[0].time
                round_trips.append(approved - created)
                await asyncio.sleep(args.gap)
        finally:
            for agent in agents:
                agent.stop("benchmark over")
            await asyncio.gather(*runs, return_exceptions=True)
            approver.stop()
            await asyncio.gather(approving, return_exceptions=True)
            if ledger is not None:
                await ledger.close()
            delete = getattr(link, "delete_topology", None)
            if delete is not None:
                await delete(groups=["approver"], vms=vms, exchanges=True)
    return {
        "events": len(round_trips),
        "durable_state": durable,
        "p50_ms": round(statistics.median(round_trips) * 1000, 1),
        "p99_ms": round(_percentile(round_trips, 99) * 1000, 1),
        "max_ms": round(max(round_trips) * 1000, 1),
    }


def _run_in(checkout: Path, args: argparse.Namespace) -> dict[str, object]:
    command = [
        sys.executable, str(Path(__file__).resolve()), "--inner",
        "--broker", args.broker, "--events", str(args.events), "--vms", str(args.vms),
        "--poll-interval", str(args.poll_interval), "--gap", str(args.gap),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(checkout))
    result = subprocess.run(
        command, cwd=checkout, env=env, capture_output=True, text=True, timeout=1800, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"the run in {checkout} failed:\n{result.stderr[-3000:]}")
    figures: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--events", type=int, default=60)
    parser.add_argument("--vms", type=int, default=5)
    parser.add_argument("--poll-interval", type=float, default=0.2)
    parser.add_argument("--gap", type=float, default=0.3, help="seconds between events")
    parser.add_argument("--before", help="a git revision to compare with (a temporary worktree)")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        print(json.dumps(asyncio.run(_measure(args))))
        return 0
    rows: list[tuple[str, dict[str, object]]] = []
    if args.before:
        with tempfile.TemporaryDirectory(prefix="before-") as tmp:
            worktree = Path(tmp) / "tree"
            subprocess.run(
                ["git", "worktree", "add", "--detach", str(worktree), args.before],
                cwd=REPO,
                check=True,
                capture_output=True,
            )
            try:
                rows.append((f"before ({args.before})", _run_in(worktree, args)))
            finally:
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(worktree)],
                    cwd=REPO,
                    check=False,
                    capture_output=True,
                )
    rows.append(("after (this tree)", _run_in(REPO, args)))
    print(f"{'code':<26} {'events':>6} {'durable':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name, figures in rows:
        print(
            f"{name:<26} {figures['events']:>6} {figures['durable_state']!s:>8} "
            f"{figures['p50_ms']:>8} {figures['p99_ms']:>8} {figures['max_ms']:>8}"
        )
    print(json.dumps({name: figures for name, figures in rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
