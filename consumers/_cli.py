"""``scheduled-events`` / ``python -m consumers``: the central services on the command line.

Every command that talks to a broker takes ``--broker URL`` (or ``SCHEDULED_EVENTS_BROKER``):
``memory://NAME`` (one process), ``amqp://user:pass@host/vhost`` (RabbitMQ), or a Service Bus
connection string. Exit status: 0 done, 1 the broker or database failed, 2 bad settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from schemas import (
    DEFAULT_CHANNELS,
    ChannelNames,
    ConfigError,
    RelayError,
    TransportError,
    load_signing_key,
)
from schemas.approvals import write_key_pair
from schemas.transport import open_transport, redact

from ._approvals import ApprovalSender
from ._approver import ApproverService
from ._audit import open_ledger
from ._audit_service import AuditService
from ._filters import MessageFilter
from ._policies import PolicySet, load_policy_file
from ._stream import FleetStream
from ._timeline import entry_line, message_line

__all__ = ["main"]

log = logging.getLogger("consumers")

BROKER_ENV = "SCHEDULED_EVENTS_BROKER"


def _channels(args: argparse.Namespace) -> ChannelNames:
    suffix: str | None = getattr(args, "channel_suffix", None)
    return DEFAULT_CHANNELS.suffixed(suffix) if suffix else DEFAULT_CHANNELS


def _broker(args: argparse.Namespace) -> str:
    url: str | None = args.broker or os.environ.get(BROKER_ENV)
    if not url:
        raise ConfigError(f"no broker: give --broker URL or set {BROKER_ENV}")
    return url


async def _until_signalled(run: Coroutine[Any, Any, None], stop: Callable[[], None]) -> None:
    """Run a service; SIGINT/SIGTERM ask it to stop after the message in hand."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop)
    try:
        await run
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


# ---------------------------------------------------------------------------------- commands


async def _approver(args: argparse.Namespace) -> int:
    key = load_signing_key(Path(args.signing_key))
    policies = load_policy_file(Path(args.policy)) if args.policy else PolicySet.default()
    url = _broker(args)
    ledger = open_ledger(args.db) if args.db else None
    async with open_transport(url, _channels(args)) as transport:
        if ledger is not None:
            await ledger.connect()
        try:
            service = ApproverService(
                transport,
                key,
                policies,
                group=args.group or "approver",
                decided_by=args.decided_by,
                ledger=ledger,
            )
            log.info("approver on %s with %d policies", redact(url), len(policies.policies))
            await _until_signalled(service.run(), service.stop)
        finally:
            if ledger is not None:
                await ledger.close()
    return 0


async def _audit(args: argparse.Namespace) -> int:
    if args.audit_command == "history":
        return await _history(args)
    url = _broker(args)
    async with open_transport(url, _channels(args)) as transport, open_ledger(args.db) as ledger:
        service = AuditService(transport, ledger, group=args.group or "audit")
        await _until_signalled(service.run(), service.stop)
        log.info("audit: %d messages appended", service.appended)
    return 0


async def _history(args: argparse.Namespace) -> int:
    async with open_ledger(args.db) as ledger:
        entries = await ledger.history(vm=args.vm, event_id=args.event)
    if args.json:
        json.dump([e.to_json() for e in entries], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    what = f"VM {args.vm}" if args.vm else f"event {args.event}"
    if not entries:
        print(f"nothing recorded for {what}")
        return 0
    print(f"timeline of {what} ({len(entries)} entries, UTC):")
    for entry in entries:
        print(entry_line(entry))
    return 0


async def _tail(args: argparse.Namespace) -> int:
    url = _broker(args)
    wanted = MessageFilter.of(
        kinds=args.type or None,
        event_type=args.event_type or None,
        vm=args.vm or None,
    )
    async with open_transport(url, _channels(args)) as transport:
        # Transient: what tail reads goes away with it (a durable group would keep collecting).
        stream = FleetStream(transport, args.group or "tail", filter=wanted, transient=True)

        async def show() -> None:
            async with stream:
                async for message in stream:
                    if args.json:
                        print(message.to_bytes().decode(), flush=True)
                    else:
                        print(message_line(message), flush=True)

        task = asyncio.ensure_future(show())

        def stop() -> None:
            task.cancel()

        await _until_signalled(_quietly(task), stop)
    return 0


async def _quietly(task: asyncio.Future[None]) -> None:
    try:
        await task
    except asyncio.CancelledError:
        if not task.cancelled():
            raise


async def _approve(args: argparse.Namespace) -> int:
    key = load_signing_key(Path(args.signing_key))
    async with open_transport(_broker(args), _channels(args)) as transport:
        sender = ApprovalSender(transport, key, decided_by=args.decided_by)
        approval = await sender.approve(args.event_id, args.vm, reason=args.reason)
    print(
        f"approval {approval.approval_id} of event {approval.event_id} sent to {approval.vm} "
        f"(expires {approval.expires_at.isoformat()})"
    )
    return 0


async def _keygen(args: argparse.Namespace) -> int:
    private, public = write_key_pair(Path(args.out))
    print(f"wrote {private} (keep it on the approver) and {public} (give it to the agents)")
    return 0


async def _demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    if args.log_level != "DEBUG":  # the timeline is the output; only problems are logged
        logging.getLogger().setLevel(logging.WARNING)

    result: int = await run_demo(args.broker or "memory://demo", speed=args.speed, quiet=args.quiet)
    return result


# ------------------------------------------------------------------------------------ parser


def _broker_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--broker",
        metavar="URL",
        help=f"memory://NAME, amqp://user:pass@host:5672/vhost or a Service Bus connection "
        f"string (default: ${BROKER_ENV})",
    )
    parser.add_argument(
        "--channel-suffix",
        metavar="SUFFIX",
        help="append SUFFIX to every exchange, queue and topic name, to run an isolated copy "
        "of the system on a shared broker (tests, side-by-side deployments); the agents must "
        "use the same suffix",
    )


def _group_option(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--group",
        metavar="NAME",
        help=f"the consumer group to read as (default: {default}); processes on one group "
        "share its messages",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scheduled-events",
        description="The central side of scheduled-events-relay: read the lifecycle messages "
        "of the whole fleet, approve events by policy, keep an audit ledger.",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    approver = commands.add_parser(
        "approver",
        help="the central approval service",
        description="Read the fleet stream (group 'approver', one active process at a time; "
        "start more for failover), decide on every Scheduled event by policy, and send a "
        "signed approval to one live VM of the event when the policy says so.",
    )
    _broker_options(approver)
    _group_option(approver, "approver")
    approver.add_argument("--signing-key", required=True, metavar="FILE", help="approver.key")
    approver.add_argument(
        "--policy",
        metavar="FILE",
        help="a policy TOML file (default: approve user-initiated events at once and Freeze "
        "events with 0 <= DurationInSeconds < 9; everything else waits for NotBefore)",
    )
    approver.add_argument(
        "--db", metavar="URL", help="also record every decision in this audit ledger"
    )
    approver.add_argument(
        "--decided-by", default="approver", metavar="NAME", help="the name put in approvals"
    )
    approver.set_defaults(run=_approver)

    audit = commands.add_parser(
        "audit",
        help="the append-only audit ledger, and its history",
        description="Without a subcommand: append every lifecycle message to the ledger "
        "(group 'audit'). 'audit history' prints the timeline of a VM or an event.",
    )
    _broker_options(audit)
    _group_option(audit, "audit")
    audit.add_argument(
        "--db",
        default="audit.db",
        metavar="URL",
        help="a SQLite file (default audit.db), sqlite:///PATH, or postgresql://USER@HOST/DB",
    )
    audit_commands = audit.add_subparsers(dest="audit_command", metavar="history")
    history = audit_commands.add_parser("history", help="print the timeline of one VM or one event")
    history.add_argument(
        "--db", default=argparse.SUPPRESS, metavar="URL", help="the ledger to read"
    )
    which = history.add_mutually_exclusive_group(required=True)
    which.add_argument("--vm", metavar="NAME", help="a VM's timeline")
    which.add_argument("--event", metavar="ID", help="an event's timeline (every VM)")
    history.add_argument("--json", action="store_true", help="JSON for machines")
    audit.set_defaults(run=_audit)

    tail = commands.add_parser(
        "tail",
        help="the live stream, one line per message",
        description="Print the live lifecycle stream, one readable line per message, from the "
        "moment it starts. It reads a transient copy of the stream (RabbitMQ: an exclusive "
        "auto-delete queue named after --group) that the broker drops when tail stops; on "
        "Service Bus it reads the subscription --group, which the operator creates with "
        "AutoDeleteOnIdle.",
    )
    _broker_options(tail)
    tail.add_argument(
        "--group",
        metavar="NAME",
        help="names the transient copy of the stream (default: tail); every tail sees every "
        "message (Service Bus: the subscription to read)",
    )
    tail.add_argument("--type", action="append", metavar="TYPE", help="only this message type")
    tail.add_argument("--event-type", action="append", metavar="T", help="only this EventType")
    tail.add_argument("--vm", action="append", metavar="NAME", help="only from this VM")
    tail.add_argument("--json", action="store_true", help="print the CloudEvents JSON")
    tail.set_defaults(run=_tail)

    approve = commands.add_parser(
        "approve",
        help="an operator's manual approval of one event",
        description="Sign and send an approval of EVENT_ID to one VM of the event; Azure then "
        "starts the event for every VM in its Resources.",
    )
    approve.add_argument("event_id", metavar="EVENT_ID")
    approve.add_argument("--vm", required=True, metavar="NAME", help="the VM that applies it")
    _broker_options(approve)
    approve.add_argument("--signing-key", required=True, metavar="FILE", help="approver.key")
    approve.add_argument("--reason", default="manual approval", help="recorded with it")
    approve.add_argument("--decided-by", default=os.environ.get("USER") or "operator")
    approve.set_defaults(run=_approve)

    keygen = commands.add_parser(
        "keygen",
        help="write an Ed25519 key pair",
        description="Write approver.key (private, mode 0600, for the approver) and "
        "approver.pub (for the agents' trusted keys). Never overwrites.",
    )
    keygen.add_argument("--out", required=True, metavar="DIR")
    keygen.set_defaults(run=_keygen)

    demo = commands.add_parser(
        "demo",
        help="the whole system in one process, with a scenario",
        description="Run the IMDS simulator, a few agents, the approver and the audit "
        "together, play a scenario (a user reboot, a live migration, a preemption, a canceled "
        "redeploy), show the live timeline and a summary.",
    )
    demo.add_argument(
        "--broker",
        metavar="URL",
        help="default memory://demo (in-process); amqp://... runs the same over RabbitMQ",
    )
    demo.add_argument("--speed", type=float, default=60.0, help="time compression (default 60x)")
    demo.add_argument("--quiet", action="store_true", help="only the summary")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        result: int = asyncio.run(args.run(args))
    except ConfigError as exc:
        print(f"scheduled-events: {exc}", file=sys.stderr)
        return 2
    except TransportError as exc:
        print(f"scheduled-events: {exc}", file=sys.stderr)
        return 1
    except RelayError as exc:
        print(f"scheduled-events: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return result
