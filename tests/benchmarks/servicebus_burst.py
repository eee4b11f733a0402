"""Service Bus under a storm of connections: N transports in one process (the real SDK) start
at once, each doing what an agent does when a wave reaches a fleet: ``connect()`` (the start-up
check), then one publish, each step under the outbox's own deadline (``--deadline``, the
agent's ``--publish-timeout``), tried again 0.3 s after a failure, until it goes through.
With ``--receivers`` each one also opens its approvals session at once, as an agent does when an
event it may approve appears, and waits for the approval queued for it before the start.

In one interpreter the SDK's openings take turns on one core, so N openings at once take far
longer than one: this is how a slow namespace looks to every agent. It prints when each publish
went through and how many tries it took; with a deadline that threw away every opening half
done, the last one took minutes (or never came).

    python tests/benchmarks/servicebus_burst.py --transports 500
    python tests/benchmarks/servicebus_burst.py --transports 500 --receivers

Prints a table, then its figures as one JSON line. The double runs in a process of its own
(``tests/benchmarks/servicebus_capacity.py``'s ``DoubleProcess``); loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from schemas import ChannelNames, RelayError
from schemas.transport.servicebus import ServiceBusTransport
from tests.benchmarks.servicebus_capacity import DoubleProcess
from tests.transport._helpers import outgoing


class _ReceiverFailures(logging.Handler):
    """Counts the transport's "receiving from ... failed" records (each one a receiver thrown
    away and opened again: the first of a spell a warning, the others at debug level)."""

    _FAILED = re.compile(r"^receiving from .* (?:failed|still fails)[^(]*\((.*)\); ")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0
        self.reasons: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        failed = self._FAILED.match(record.getMessage())
        if failed:
            self.count += 1
            self.reasons[failed.group(1)[:120]] += 1


@dataclass
class _Progress:
    """When each milestone was reached, in seconds from the start, as it happens: a run cut
    off at its limit still shows what got through."""

    checked: list[float] = field(default_factory=list)
    published: list[float] = field(default_factory=list)
    approved: list[float] = field(default_factory=list)
    tries: list[int] = field(default_factory=list)


async def _agent(
    address: str,
    channels: ChannelNames,
    n: int,
    deadline: float,
    began: float,
    receive: bool,
    progress: _Progress,
) -> None:
    transport = ServiceBusTransport(address, channels)
    tries = 1  # one more for each attempt (the start-up check or a publish) that failed

    async def publish() -> None:
        nonlocal tries
        while True:
            try:
                await asyncio.wait_for(transport.connect(), deadline)
                await asyncio.wait_for(transport.publish(outgoing(f"agent {n}")), deadline)
                progress.published.append(time.monotonic() - began)
                progress.tries.append(tries)
                return
            except (RelayError, TimeoutError):
                tries += 1
                await asyncio.sleep(0.3)

    async def approval() -> None:
        async with transport.approvals(f"vm-{n}") as inbox:
            delivery = await anext(inbox)
            await delivery.ack()
        progress.approved.append(time.monotonic() - began)

    try:
        while True:  # the start-up check: until it passes, there is nothing to receive with
            try:
                await asyncio.wait_for(transport.connect(), deadline)
                break
            except (RelayError, TimeoutError):
                tries += 1
                await asyncio.sleep(0.3)
        progress.checked.append(time.monotonic() - began)
        await asyncio.gather(publish(), *([approval()] if receive else []))
    finally:
        await transport.close()


async def measure(
    transports: int, deadline: float, limit: float, receivers: bool
) -> dict[str, object]:
    channels = ChannelNames().suffixed(f"burst-{uuid.uuid4().hex[:6]}")
    failures = _ReceiverFailures()
    transport_log = logging.getLogger("schemas.transport.servicebus")
    transport_log.addHandler(failures)
    transport_log.setLevel(logging.DEBUG)  # counted, not printed
    transport_log.propagate = False
    progress = _Progress()
    async with DoubleProcess(channels, "approver", plain=("audit",)) as double:
        if receivers:
            async with ServiceBusTransport(double.connection_string, channels) as approver:
                for n in range(transports):
                    reply = approver.reply_address(f"vm-{n}")
                    await approver.send_approval(reply, outgoing(f"approve vm-{n}"))
        began = time.monotonic()
        tasks = [
            asyncio.ensure_future(
                _agent(double.connection_string, channels, n, deadline, began, receivers, progress)
            )
            for n in range(transports)
        ]
        _, pending = await asyncio.wait(tasks, timeout=limit)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def at(values: list[float], q: float) -> float | None:
        values = sorted(values)
        return round(values[min(len(values) - 1, int(q * len(values)))], 1) if values else None

    figures: dict[str, object] = {
        "transports": transports,
        "deadline_s": deadline,
        "checked": len(progress.checked),
        "checked_last_s": at(progress.checked, 1.0),
        "published": len(progress.published),
        "p50_s": at(progress.published, 0.5),
        "last_s": at(progress.published, 1.0),
        "max_tries": max(progress.tries, default=None),
    }
    if receivers:
        figures |= {
            "approvals_received": len(progress.approved),
            "approval_p50_s": at(progress.approved, 0.5),
            "approval_last_s": at(progress.approved, 1.0),
            "receivers_thrown_away": failures.count,
            "why": dict(failures.reasons.most_common(3)),
        }
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", type=int, default=500)
    parser.add_argument("--deadline", type=float, default=10.0, help="seconds per attempt")
    parser.add_argument("--limit", type=float, default=180.0, help="give up after (seconds)")
    parser.add_argument(
        "--receivers",
        action="store_true",
        help="each transport also opens its approvals session and waits for its approval",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    figures = asyncio.run(measure(args.transports, args.deadline, args.limit, args.receivers))
    print(
        f"{figures['checked']}/{args.transports} passed the start-up check, the last at "
        f"{figures['checked_last_s']} s"
    )
    print(
        f"{figures['published']}/{args.transports} published within {args.limit:g} s "
        f"(each attempt under {args.deadline:g} s): half by {figures['p50_s']} s, the last at "
        f"{figures['last_s']} s, after at most {figures['max_tries']} tries"
    )
    if args.receivers:
        print(
            f"{figures['approvals_received']}/{args.transports} approvals received: half by "
            f"{figures['approval_p50_s']} s, the last at {figures['approval_last_s']} s; "
            f"{figures['receivers_thrown_away']} receivers failed and were opened again"
        )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
