"""Record what an agent of the previous minor version (contract 1.0) publishes while it shares
a fleet with the current approver: tests/deploy/fixtures/agent-1.0-session.json, which
test_rolling_upgrade.py feeds to the current consumers. Not a test; run by hand when the
previous minor version changes (the tests never need git history):

    git worktree add /tmp/relay-1.0 c64729b        # the last 1.0 commit
    git worktree add /tmp/relay-head HEAD
    PYTHONPATH=/tmp/relay-head .venv/bin/python tests/deploy/record_old_agent.py \\
        --old-tree /tmp/relay-1.0 --out tests/deploy/fixtures/agent-1.0-session.json

It runs, on the local RabbitMQ (guest, names with a suffix of their own, deleted afterwards):
the IMDS simulator with one scale-set VM, the 1.0 agent from ``--old-tree`` in a process of its
own (with a hook and the current approver's public key), the current approver (approving
user-initiated events at once), and a recorder bound to every lifecycle message. Scenario: a
user Reboot (the approver approves it; the 1.0 agent cannot verify a 1.1 approval: it reports
``bad-signature`` and the event starts at NotBefore), then a platform Freeze that is updated
and then canceled; SIGTERM at the end. The events exchange is declared first the 1.0 way
(without the alternate exchange), as it exists in a deployment that ran 1.0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import aio_pika

from consumers import ApproveUserInitiated, PolicySet
from consumers._approver import ApproverService
from publisher.simulator import EventSource, EventSpec, EventType, Simulator, SimulatorConfig, serve
from publisher.simulator import EventState as SimState
from schemas import ChannelNames, load_signing_key
from schemas.approvals import write_key_pair
from schemas.transport.rabbitmq import RabbitMQTransport

VM = "WestNO_0"


async def record(old_tree: Path, amqp_url: str, workdir: Path) -> list[dict[str, object]]:
    suffix = f"rec{uuid.uuid4().hex[:8]}"
    channels = ChannelNames().suffixed(suffix)
    _, public = write_key_pair(workdir)
    key = load_signing_key(workdir / "approver.key")
    simulator = Simulator(SimulatorConfig(speed=60, rate_limit=0), vms=[VM])
    recorded: list[dict[str, object]] = []

    connection = await aio_pika.connect(amqp_url, timeout=10)
    channel = await connection.channel()
    # The 1.0 declaration: no arguments (an exchange that existed before the upgrade).
    events = await channel.declare_exchange(
        channels.events_exchange, aio_pika.ExchangeType.TOPIC, durable=True
    )
    tap = await channel.declare_queue(f"{channels.group_prefix}recorder", exclusive=True)
    await tap.bind(events, "#")

    async def keep(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        async with message.process():
            recorded.append(
                {
                    "routing_key": message.routing_key,
                    "message_id": message.message_id,
                    "content_type": message.content_type,
                    "user_id": message.user_id,
                    "headers": {
                        k: (v.decode() if isinstance(v, bytes) else v)
                        for k, v in (message.headers or {}).items()
                    },
                    "body": json.loads(message.body),
                }
            )

    await tap.consume(keep)
    async with serve(simulator) as server, RabbitMQTransport(amqp_url, channels) as link:
        approver = ApproverService(link, key, PolicySet((ApproveUserInitiated(),)))
        approver_task = asyncio.create_task(approver.run())
        agent = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "publisher",
            "--imds-url",
            server.vm_url(VM),
            "--broker",
            amqp_url,
            "--channel-suffix",
            suffix,
            "--state-dir",
            str(workdir / "state"),
            "--trust-key",
            str(public),
            "--hook",
            "scheduled=true",
            "--poll-interval",
            "0.2",
            "--heartbeat-interval",
            "3",
            cwd=old_tree,
            env={**os.environ, "PYTHONPATH": str(old_tree)},
        )
        try:
            await asyncio.sleep(3)
            reboot = simulator.add_event(
                EventSpec(
                    event_type=EventType.REBOOT,
                    resources=(VM,),
                    event_source=EventSource.USER,
                    not_before_seconds=180,
                    run_seconds=240,
                )
            )
            await simulator.wait_for_state(reboot.event_id, SimState.COMPLETED, within=30)
            await asyncio.sleep(1)
            freeze = simulator.add_event(
                EventSpec(
                    event_type=EventType.FREEZE,
                    resources=(VM,),
                    not_before_seconds=900,
                    run_seconds=60,
                    duration_in_seconds=5,
                )
            )
            await asyncio.sleep(2)
            simulator.update_event(freeze.event_id, not_before_seconds=1200)
            await asyncio.sleep(2)
            simulator.cancel_event(freeze.event_id)
            await asyncio.sleep(3)
        finally:
            agent.send_signal(signal.SIGTERM)
            await asyncio.wait_for(agent.wait(), 20)
            await asyncio.sleep(1)
            approver.stop()
            await asyncio.wait_for(approver_task, 10)
            await link.delete_topology(groups=("approver",), vms=(VM,), exchanges=True)
    await connection.close()
    return recorded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-tree", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672/")
    args = parser.parse_args()
    workdir = Path(f"/tmp/record-old-agent-{uuid.uuid4().hex[:8]}")
    workdir.mkdir()
    messages = asyncio.run(record(args.old_tree.resolve(), args.amqp, workdir))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "agent": "scheduled-events-relay at c64729b (contract 1.0)",
                "approver": "the contract 1.1 approver, approving user-initiated events",
                "messages": messages,
            },
            indent=1,
        )
        + "\n"
    )
    kinds = [str(m["body"]["type"]).rsplit(".", 2)[-2:] for m in messages]  # type: ignore[index]
    print(f"{len(messages)} messages written to {args.out}: {kinds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
