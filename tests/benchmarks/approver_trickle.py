"""The approver's CPU when messages come a few at a time, and while nothing comes.

In a fleet's wave the approver does not get a flood: the agents detect their events over a poll
interval, so messages arrive a few at a time and each few is a commit of its own (in a
10,000-VM wave, 6,724 commits of 5 or 6 messages). This measures, on one
:class:`ApproverService` (the in-memory transport, the broker left out; state in SQLite or in
memory), the CPU it spends per message:

- **flood**: ``--messages`` messages queued at once (a full batch per commit), as
  ``approver_flood.py`` delivers them (per VM a short Freeze scheduled, approved, started and
  completed, and a heartbeat for one VM in ten);
- **trickle**: the same kind of messages, ``--batch`` at a time every ``--gap`` seconds;
- **idle**: ``--idle`` seconds of the running service with nothing to read (its flusher and its
  housekeeping), as milliseconds of CPU a second.

CPU is the process's (``time.process_time``: every thread, the database's too), so the figures
hold on a machine whose other processes or neighbours take the cores now and then, where a rate
in messages a second would not.

    python tests/benchmarks/approver_trickle.py [--messages 4000] [--batch 5] [--gap 0.02]
        [--idle 10] [--store sqlite|memory|all]

Prints a table, then the figures as one JSON line. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from consumers._approver import ApproverService
from consumers._cli import tune_collector
from consumers._db import open_database
from consumers._policies import parse_policy
from consumers._schema import ensure_schema
from schemas import decode
from schemas.approvals import generate_signing_key
from schemas.channels import ChannelNames
from schemas.transport import MemoryTransport, OutgoingMessage
from schemas.wire import lifecycle_message
from tests.benchmarks.approver_flood import DEFAULT_POLICY, flood_messages


@dataclass
class Figures:
    store: str
    #: CPU per message (µs), all queued at once.
    flood_us: float
    #: CPU per message (µs), ``batch`` at a time every ``gap`` seconds.
    trickle_us: float
    #: CPU a second (ms) with nothing to read.
    idle_ms_per_s: float


async def _drain(service: ApproverService, target: int) -> None:
    """Until the service has received ``target`` messages in all and committed them."""
    async with asyncio.timeout(600):
        while service.stream.stats.received < target:  # noqa: ASYNC110 - the stream's count
            await asyncio.sleep(0.005)
    await service.commit()


async def _cpu_per_message(
    service: ApproverService,
    transport: MemoryTransport,
    wire: list[OutgoingMessage],
    batch: int,
    gap: float,
) -> float:
    """CPU µs per message to take ``wire``, ``batch`` at a time every ``gap`` seconds."""
    began = time.process_time()
    target = service.stream.stats.received + len(wire)
    for offset in range(0, len(wire), batch):
        for message in wire[offset : offset + batch]:
            await transport.publish(message)
        if gap:
            await asyncio.sleep(gap)
    await _drain(service, target)
    return 1e6 * (time.process_time() - began) / len(wire)


async def measure(store: str, args: argparse.Namespace) -> Figures:
    group = f"approver-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="approver-trickle-") as scratch:
        db = open_database(f"sqlite:///{scratch}/approver.db") if store == "sqlite" else None
        async with MemoryTransport(f"trickle-{group}", ChannelNames().suffixed(group)) as transport:
            await transport.declare_group(group)
            if db is not None:
                await db.connect()
                await ensure_schema(db)
            try:
                service = ApproverService(
                    transport,
                    generate_signing_key(),
                    parse_policy(DEFAULT_POLICY),
                    group=group,
                    decided_by="bench-approver",
                    db=db,
                )
                reply = transport.reply_address("x").channel

                def wire() -> list[OutgoingMessage]:  # new events each time (the same VM names)
                    bodies = flood_messages(args.messages, reply, "bench-approver")
                    return [lifecycle_message(decode(body)) for body in bodies]

                runner = asyncio.create_task(service.run())
                try:
                    burst = wire()
                    flood = await _cpu_per_message(service, transport, burst, len(burst), 0)
                    trickle = await _cpu_per_message(
                        service, transport, wire(), args.batch, args.gap
                    )
                    await asyncio.sleep(1.0)  # what the last messages left to do
                    began = time.process_time()
                    await asyncio.sleep(args.idle)
                    idle = 1e3 * (time.process_time() - began) / args.idle
                finally:
                    service.stop()
                    await runner
            finally:
                if db is not None:
                    await db.close()
    return Figures(store, round(flood, 1), round(trickle, 1), round(idle, 2))


def _number(low: float, high: float, kind: type[float] | type[int] = float) -> Any:
    """An argparse type: a finite number in [low, high], refused in one line otherwise."""

    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"must be {low:g} to {high:g}, got {text}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--messages",
        default=4000,
        type=_number(10, 1_000_000, int),
        help="messages in the flood and in the trickle, each (default 4000)",
    )
    parser.add_argument(
        "--batch",
        default=5,
        type=_number(1, 100_000, int),
        help="messages that arrive together in the trickle (default 5)",
    )
    parser.add_argument(
        "--gap",
        default=0.02,
        type=_number(0, 10),
        help="seconds between two arrivals in the trickle (default 0.02)",
    )
    parser.add_argument(
        "--idle",
        default=10.0,
        type=_number(1, 3600),
        help="seconds of idling measured (default 10)",
    )
    parser.add_argument("--store", choices=["sqlite", "memory", "all"], default="all")
    args = parser.parse_args(argv)
    tune_collector()  # as the CLI runs the approver
    stores = ["sqlite", "memory"] if args.store == "all" else [args.store]
    results = []
    for store in stores:
        figures = asyncio.run(measure(store, args))
        print(
            f"{store}: flood {figures.flood_us:.0f} µs/msg, trickle of {args.batch} every "
            f"{args.gap:g} s {figures.trickle_us:.0f} µs/msg, idle {figures.idle_ms_per_s:.2f} "
            "ms of CPU a second",
            flush=True,
        )
        results.append(figures)
    print()
    print(f"| state  | flood µs/msg | trickle ({args.batch} / {args.gap:g} s) µs/msg | idle ms/s |")
    print("| ------ | -----------: | ----------------------: | --------: |")
    for f in results:
        print(
            f"| {f.store:6} | {f.flood_us:12.0f} | {f.trickle_us:23.0f} | {f.idle_ms_per_s:9.2f} |"
        )
    print(json.dumps([asdict(f) for f in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
