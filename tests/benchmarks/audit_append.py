"""The audit service's own rate: messages per second through :class:`AuditService` into its
ledger (SQLite, or PostgreSQL with ``--db``), the broker left out.

The messages are a burst's (per VM a short Freeze scheduled, approved, started and completed,
and a heartbeat now and then; see ``approver_flood.py``), 5 % of them delivered twice, as an
agent repeats what it published before a restart. They wait in the group's queue on the
in-memory transport; the service then runs, as its CLI runs it, until it has stored every
distinct message: the stream (decode, dedupe, acks) and the ledger's appends.

    python tests/benchmarks/audit_append.py [--messages 20000] [--rounds 3] [--db postgresql://...]

With ``--db`` (a server where the user may create databases) each PostgreSQL run gets a
database of its own, dropped afterwards (the ledger is append-only).

Prints one line per round and store, then the figures as one JSON line. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from consumers._audit import Ledger
from consumers._audit_service import AuditService
from consumers._cli import tune_collector
from consumers._db import open_database
from schemas import decode
from schemas.channels import ChannelNames
from schemas.transport import MemoryTransport
from schemas.wire import lifecycle_message
from tests._postgres import scratch_database
from tests.benchmarks.approver_flood import flood_messages


def burst(count: int, reply_channel: str) -> list[bytes]:
    bodies = flood_messages(count, reply_channel, "bench-approver")
    rng = random.Random(7)
    repeated = rng.sample(bodies, len(bodies) // 20)
    return bodies + repeated


async def _run(url: str, bodies: list[bytes]) -> tuple[int, float, int]:
    """(messages, seconds, rows stored) for one run of the service over ``bodies``."""
    group = f"audit-{uuid.uuid4().hex[:8]}"
    channels = ChannelNames().suffixed(group)
    ledger = Ledger(open_database(url))
    async with MemoryTransport(f"audit-{group}", channels) as transport, ledger:
        await transport.declare_group(group)
        for body in bodies:
            await transport.publish(lifecycle_message(decode(body)))
        ids = sorted({decode(body).id for body in bodies})
        service = AuditService(transport, ledger, group=group)
        began = time.perf_counter()
        runner = asyncio.create_task(service.run())
        # Done when every distinct message is stored (the copies are acked, not stored).
        while service.appended < len(ids) and not runner.done():  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - began
        service.stop()
        await runner
        stored = 0
        for chunk in (ids[i : i + 500] for i in range(0, len(ids), 500)):
            marks = ", ".join("?" * len(chunk))
            row = await ledger.db.fetchone(
                f"SELECT count(*) FROM ledger_messages WHERE message_id IN ({marks})", *chunk
            )
            stored += 0 if row is None else int(row[0])
        return len(bodies), elapsed, stored


async def main_async(args: argparse.Namespace) -> list[dict[str, object]]:
    results: list[dict[str, object]] = []
    bodies = burst(args.messages, "bench-replies")
    for round_ in range(1, args.rounds + 1):
        with tempfile.TemporaryDirectory(prefix="audit-append-") as scratch:
            runs = [("sqlite", await _run(f"sqlite:///{scratch}/ledger.db", bodies))]
        if args.db:
            async with scratch_database(args.db, "audit_bench") as url:
                runs.append(("postgres", await _run(url, bodies)))
        for store, (messages, seconds, stored) in runs:
            rate = messages / seconds
            print(
                f"round {round_} {store:8}: {messages:,} messages ({stored:,} distinct stored) "
                f"in {seconds:.2f} s: {rate:,.0f} msg/s",
                flush=True,
            )
            results.append(
                {
                    "round": round_,
                    "store": store,
                    "messages": messages,
                    "stored": stored,
                    "seconds": round(seconds, 3),
                    "msg_per_s": round(rate),
                }
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000, help="distinct messages")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each store")
    parser.add_argument("--db", help="also run with this PostgreSQL database (its rows removed)")
    args = parser.parse_args(argv)
    if args.messages < 1 or args.rounds < 1:
        parser.error("--messages and --rounds must be at least 1")
    tune_collector()
    results = asyncio.run(main_async(args))
    print(json.dumps({"messages": args.messages, "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
