"""``scheduled-events`` / ``python -m consumers``: the central services on the command line.

Every option can also be set as an environment variable ``SCHEDULED_EVENTS_<OPTION>`` (upper
case, ``-`` as ``_``: ``SCHEDULED_EVENTS_BROKER``, ``SCHEDULED_EVENTS_DB``), the same scheme as
the agent's. Secrets can come from files (``--broker-file``, ``--db-file``: the first line), for
systemd's ``LoadCredential=`` and Kubernetes secrets. A broker is ``memory://NAME`` (one
process), ``amqp://user:pass@host/vhost`` (RabbitMQ), or a Service Bus connection string.

Exit status: 0 done, 1 the broker or database failed (or an approval was refused), 2 bad input
or settings (one line saying what and what to do).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import os
import re
import signal
import socket
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from schemas import (
    DEFAULT_CHANNELS,
    ApprovalOutcomeMessage,
    ChannelNames,
    ConfigError,
    LifecycleMessage,
    MessageType,
    RelayError,
    ScheduledEvent,
    SchemaError,
    TransportError,
    event_version,
    load_signing_key,
)
from schemas._files import read_setting_file
from schemas.approvals import write_key_pair
from schemas.observability import HealthServer, LineFormatter, Registry
from schemas.origin import OriginVerifier
from schemas.transport import broker_kind, open_transport, redact

from ._approvals import ApprovalSender
from ._approver import ApproverService
from ._audit import open_ledger
from ._audit_service import AuditService
from ._db import open_database
from ._filters import MessageFilter
from ._origin import Origin, default_origin
from ._policies import PolicySet, load_policy_file
from ._schema import ensure_schema, grant
from ._stream import FleetStream
from ._timeline import entry_line, message_line, printable
from .console import add_console_commands

__all__ = ["main"]

log = logging.getLogger("consumers")

ENV_PREFIX = "SCHEDULED_EVENTS_"
#: An IMDS EventId is a GUID.
_EVENT_ID = re.compile(r"^[0-9A-Fa-f]{8}(-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}$")


#: The collector's thresholds in the long-running services (approver, audit, tail). Python's
#: defaults (700, 10, 10) collect the youngest objects every 700 allocations and promote what
#: survives, so a service holding a large fleet view (20,000 open events) pays for full passes
#: over it again and again. ``tests/benchmarks/approver_flood.py`` (20,000 open events, with
#: and without ``--default-collector``): 5,015 -> 6,208 msg/s with the SQLite state, 8,959 ->
#: 11,709 in memory.
SERVICE_GC_THRESHOLDS = (50_000, 20, 20)


def tune_collector() -> None:
    """Set the collector for a long-running service (see :data:`SERVICE_GC_THRESHOLDS`); the
    memory it costs is a few young objects more, collected a little later."""
    gc.set_threshold(*SERVICE_GC_THRESHOLDS)


def _channels(args: argparse.Namespace) -> ChannelNames:
    suffix: str | None = getattr(args, "channel_suffix", None)
    return DEFAULT_CHANNELS.suffixed(suffix) if suffix else DEFAULT_CHANNELS


#: The most of a secret file read: its first line is a URL or a connection string.
_MAX_SECRET_BYTES = 64 * 1024


def _secret(value: str | None, path: str | None, what: str) -> str | None:
    if value and path:
        raise ConfigError(f"give --{what} or --{what}-file, not both")
    if not path:
        return value
    try:
        # The first line is all that is used: a longer file is read no further.
        raw = read_setting_file(Path(path), _MAX_SECRET_BYTES, "the file")[:_MAX_SECRET_BYTES]
    except ConfigError as exc:
        raise ConfigError(f"--{what}-file: {exc}") from exc
    try:
        text = raw.decode().strip().splitlines()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--{what}-file: {path} is not UTF-8 (byte {exc.start} is not)") from exc
    if not text or not text[0].strip():
        raise ConfigError(f"--{what}-file: {path} is empty")
    return text[0].strip()


def _broker(args: argparse.Namespace) -> str:
    url = _secret(args.broker, getattr(args, "broker_file", None), "broker")
    if not url:
        raise ConfigError(
            f"no broker: give --broker URL (or --broker-file FILE, or set {ENV_PREFIX}BROKER)"
        )
    broker_kind(url)  # a clear error for a URL nobody understands
    return url


def _db(args: argparse.Namespace) -> str | None:
    return _secret(getattr(args, "db", None), getattr(args, "db_file", None), "db")


def _open_transport(args: argparse.Namespace, role: str) -> Any:
    return open_transport(
        _broker(args), _channels(args), name=f"scheduled-events {role} {socket.gethostname()}"
    )


def _origin(args: argparse.Namespace, url: str) -> Origin:
    """The origin check asked for (see :func:`_origin_and_verifier`)."""
    return _origin_and_verifier(args, url)[0]


def _origin_and_verifier(
    args: argparse.Namespace, url: str
) -> tuple[Origin, OriginVerifier | None]:
    """Who may speak for a VM (``--origin``, else the broker's default) and, for a signed
    origin, the verifier of Azure's attested data (``--attestation-ca``)."""
    chosen: str | None = getattr(args, "origin", None)
    origin = Origin(chosen) if chosen else default_origin(broker_kind(url))
    cas = getattr(args, "attestation_ca", None)
    if origin is not Origin.SIGNED:
        return origin, None
    if not cas:
        raise ConfigError(
            "origin signed (the default on Service Bus, where the broker names no sender): "
            "give --attestation-ca FILE, the CA Azure's attested data chains to, or --origin "
            "any on a namespace only trusted agents may write to"
        )
    inventory = getattr(args, "vm_inventory", None)
    return origin, OriginVerifier.from_files(
        [Path(c) for c in cas], Path(inventory) if inventory else None
    )


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


async def _with_health(
    args: argparse.Namespace, stream: FleetStream, run: Coroutine[Any, Any, None]
) -> None:
    """Serve ``/healthz`` and ``/metrics`` on ``--health-port`` while ``run`` runs: 503 with
    the reason once the broker link or the subscription has been down for longer than
    ``--health-grace`` (a reconnect that succeeds within it is not an outage)."""
    port: int | None = getattr(args, "health_port", None)
    if port is None:
        await run
        return
    grace: float = args.health_grace
    registry = Registry()
    counters = {
        name: registry.gauge(f"consumer_{name}", f"Stream messages: {name}", ["group"])
        for name in ("received", "handled", "duplicates", "dead_lettered", "forged", "conflicts")
    }
    loop = asyncio.get_running_loop()
    unsubscribed_since: float | None = None

    async def watch_subscription() -> None:
        nonlocal unsubscribed_since
        while True:
            if stream.subscribed:
                unsubscribed_since = None
            elif unsubscribed_since is None:
                unsubscribed_since = loop.time()
            await asyncio.sleep(0.25)

    def health() -> tuple[bool, dict[str, object]]:
        for name, gauge in counters.items():
            gauge.labels(stream.group).set(getattr(stream.stats, name))
        details: dict[str, object] = {"group": stream.group, "subscribed": stream.subscribed}
        details |= {name: getattr(stream.stats, name) for name in counters}
        link_down = stream.transport.link_down_for
        unsubscribed = None if unsubscribed_since is None else loop.time() - unsubscribed_since
        down = max((d for d in (link_down, unsubscribed) if d is not None), default=None)
        if down is not None:
            details["down_seconds"] = round(down, 1)
        if down is None or down <= grace:
            return True, details
        what = "the broker link" if link_down is not None else "the broker subscription"
        details["reason"] = (
            f"{what} has been down for {down:.0f} s (grace {grace:g} s); reconnecting, and "
            "healthy again once it is back"
        )
        return False, details

    server = HealthServer(registry, health, host=args.health_host, port=port)
    await server.start()
    watcher = asyncio.create_task(watch_subscription(), name="health-watch")
    try:
        await run
    finally:
        watcher.cancel()
        await server.close()


# ---------------------------------------------------------------------------------- commands


async def _approver(args: argparse.Namespace) -> int:
    tune_collector()
    key = load_signing_key(Path(args.signing_key))
    policies = load_policy_file(Path(args.policy)) if args.policy else PolicySet.default()
    url = _broker(args)
    db_url = _db(args)
    # Every file read before anything is set up: a bad one stops here, with nothing to undo.
    origin, verifier = _origin_and_verifier(args, url)
    db = open_database(db_url) if db_url else None
    async with _open_transport(args, "approver") as transport:
        if db is not None:
            await db.connect()
            await ensure_schema(db)
        try:
            service = ApproverService(
                transport,
                key,
                policies,
                group=args.group or "approver",
                decided_by=args.decided_by,
                db=db,
                origin=origin,
                verifier=verifier,
            )
            log.info(
                "approver on %s with %d policies; state in %s",
                redact(url),
                len(policies.policies),
                db.display if db is not None else "memory only",
            )
            await _until_signalled(_with_health(args, service.stream, service.run()), service.stop)
        finally:
            if db is not None:
                await db.close()
    return 0


async def _audit(args: argparse.Namespace) -> int:
    if args.audit_command == "history":
        return await _history(args)
    tune_collector()
    db_url = _db(args) or "audit.db"
    url = _broker(args)
    origin, verifier = _origin_and_verifier(args, url)  # its files before anything is set up
    async with _open_transport(args, "audit") as transport, open_ledger(db_url) as ledger:
        service = AuditService(
            transport, ledger, group=args.group or "audit", origin=origin, verifier=verifier
        )
        await _until_signalled(_with_health(args, service.stream, service.run()), service.stop)
        log.info("audit: %d messages appended", service.appended)
    return 0


async def _history(args: argparse.Namespace) -> int:
    db_url = _db(args) or "audit.db"
    # Reading must not create a database: a typo in --db says so instead of "nothing recorded".
    async with open_ledger(db_url, create=False) as ledger:
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


def _kinds(values: list[str] | None) -> list[MessageType] | None:
    if not values:
        return None
    known = {kind.value: kind for kind in MessageType}
    out = []
    for value in values:
        if value not in known:
            raise ConfigError(f"--type {value!r} is not a message type; known: {', '.join(known)}")
        out.append(known[value])
    return out


async def _tail(args: argparse.Namespace) -> int:
    tune_collector()
    wanted = MessageFilter.of(
        kinds=_kinds(args.type), event_type=args.event_type or None, vm=args.vm or None
    )
    async with _open_transport(args, "tail") as transport:
        # Transient: what tail reads goes away with it (a durable group would keep collecting).
        stream = FleetStream(transport, args.group or "tail", filter=wanted, transient=True)

        async def show() -> None:
            async with stream:
                async for message in stream:
                    if args.json:
                        print(_json_line(message), flush=True)
                    else:
                        print(message_line(message), flush=True)

        task = asyncio.ensure_future(show())

        def stop() -> None:
            task.cancel()

        await _until_signalled(_quietly(task), stop)
    return 0


def _json_line(message: LifecycleMessage) -> str:
    """The message's JSON on one line, every character outside printable ASCII escaped
    (``\\u009b``): the same JSON to a reader, and nothing a terminal acts on (JSON escapes
    only C0 controls; a C1 control, DEL or a bidi override in a VM's text would pass)."""
    text = json.dumps(json.loads(message.to_bytes()), separators=(",", ":"))
    return text.replace("\x7f", "\\u007f")


async def _quietly(task: asyncio.Future[None]) -> None:
    try:
        await task
    except asyncio.CancelledError:
        if not task.cancelled():
            raise


async def _known_version(args: argparse.Namespace) -> tuple[str, str]:
    """The version to approve and how it is described, from ``--event-version`` or the
    newest report of the event in ``--db``; :class:`ConfigError` when neither says."""
    db_url = _db(args)
    if db_url:
        async with open_ledger(db_url, create=False) as ledger:
            raw = await ledger.latest_event(args.event_id)
        if raw is None:
            raise ConfigError(
                f"approve: event {args.event_id} is not in {redact(db_url)}: check the id "
                "(`scheduled-events tail` shows live events), or pass --event-version"
            )
        event = ScheduledEvent.from_imds(raw)
        if not event.is_scheduled:
            raise ConfigError(
                f"approve: event {args.event_id} is {event.event_status} in the newest report: "
                "only a Scheduled event can be approved"
            )
        version = event_version(event)
        if args.event_version and args.event_version != version:
            raise ConfigError(
                f"approve: --event-version {args.event_version} is not the version the ledger "
                f"knows ({version}): the event changed; look at it again before approving"
            )
        duration = f", {event.duration_in_seconds} s" if event.duration_in_seconds >= 0 else ""
        return version, (
            f"{event.event_type}{duration}, NotBefore {event.not_before_text or '-'}, "
            f"Resources {', '.join(event.resources)}"
        )
    if args.event_version:
        return args.event_version, "as given with --event-version"
    raise ConfigError(
        f"approve: no version of event {args.event_id} is known: pass --db URL (the audit "
        "ledger, which knows the event as the agents reported it) or --event-version VERSION "
        "(as `tail --json` shows it in data.event_version), so the approval applies only to "
        "the version you judged"
    )


async def _approve(args: argparse.Namespace) -> int:
    if not _EVENT_ID.match(args.event_id):
        raise ConfigError(
            f"approve: {args.event_id!r} is not an EventId (IMDS EventIds are GUIDs, "
            "e.g. 8EE31A01-6A5F-4C1E-8E5A-7C2F0D1B9A33)"
        )
    key = load_signing_key(Path(args.signing_key))
    version, described = await _known_version(args)
    async with _open_transport(args, "approve") as transport:
        sender = ApprovalSender(transport, key, decided_by=args.decided_by)
        approval, address = sender.prepare(
            args.event_id, args.vm, event_version=version, reason=args.reason
        )
        if args.no_wait:
            await sender.send(approval, address)
            print(_sent_line(approval.approval_id, args.event_id, version, described, args.vm))
            return 0
        # Listen before sending, so the outcome cannot slip by.
        stream = FleetStream(
            transport,
            args.group or "approve",
            filter=MessageFilter.of(
                kinds=[MessageType.APPROVAL_APPLIED, MessageType.APPROVAL_REJECTED]
            ),
            transient=True,
        )
        async with stream:
            await sender.send(approval, address)
            print(_sent_line(approval.approval_id, args.event_id, version, described, args.vm))
            try:
                async with asyncio.timeout(args.timeout):
                    async for message in stream:
                        if (
                            isinstance(message, ApprovalOutcomeMessage)
                            and message.data.approval_id == approval.approval_id
                        ):
                            return _print_outcome(message)
            except TimeoutError:
                print(
                    f"no outcome from {args.vm} within {args.timeout:g} s: its agent may be "
                    f"down or slow; the approval stays queued until "
                    f"{approval.expires_at.isoformat()}",
                    file=sys.stderr,
                )
                return 1
    return 1


def _sent_line(approval_id: str, event_id: str, version: str, described: str, vm: str) -> str:
    # The description is the event as a VM reported it (the ledger's newest report).
    return (
        f"approval {approval_id} of event {event_id} version {printable(version)} "
        f"({printable(described)}) sent to {printable(vm)}"
    )


def _print_outcome(message: ApprovalOutcomeMessage) -> int:
    """The agent's answer, one line; what the VM wrote in it printed as text (see
    :func:`~consumers._timeline.printable`)."""
    data = message.data
    who = printable(message.vm.name)
    if data.applied:
        repeat = " (a repeat: it may have been applied before)" if data.repeat else ""
        dry = " [dry run: verified, not POSTed]" if data.dry_run else ""
        print(f"applied by {who} at {message.time.isoformat()}{repeat}{dry}")
        return 0
    print(f"rejected by {who}: {printable(data.reason)}: {printable(data.detail)}")
    return 1


async def _keygen(args: argparse.Namespace) -> int:
    try:
        private, public = write_key_pair(Path(args.out))
    except OSError as exc:
        raise ConfigError(
            f"keygen: cannot write the keys into {args.out}: {exc.strerror or exc}"
        ) from exc
    print(f"wrote {private} (keep it on the approver) and {public} (give it to the agents)")
    return 0


async def _migrate(args: argparse.Namespace) -> int:
    db_url = _db(args)
    if not db_url:
        raise ConfigError("migrate: give --db URL (or --db-file FILE)")
    async with open_database(db_url) as db:
        await ensure_schema(db)
        if args.grant_audit or args.grant_approver:
            await grant(db, audit=args.grant_audit, approver=args.grant_approver)
        print(f"schema of {db.display} is current")
    return 0


async def _demo(args: argparse.Namespace) -> int:
    try:
        from ._demo import run_demo
    except ImportError as exc:
        raise ConfigError(
            f"the demo needs the simulator ({exc.name} is missing): "
            "pip install 'scheduled-events-relay[simulator]'"
        ) from exc

    if args.log_level != "DEBUG":  # the timeline is the output; only problems are logged
        logging.getLogger().setLevel(logging.WARNING)

    result: int = await run_demo(
        args.broker or "memory://demo", speed=args.speed, quiet=args.quiet, console=args.console
    )
    return result


# ------------------------------------------------------------------------------------ parser


# Flag values are checked as they are parsed (argparse's one line and exit status 2), before
# anything is set up: a value the service would fail on later, or read as "never" (nan, inf),
# is refused here.


def _positive_number(text: str, what: str = "a number") -> float:
    """A finite number above 0 (float() also takes "nan", "inf" and "1e400")."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give {what} above 0 (finite)")
    return value


def _positive_seconds(text: str) -> float:
    return _positive_number(text, "a number of seconds")


def _port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535; bind() would refuse the rest only once the
    service is set up."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to 65535)")
    return value


def _broker_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--broker",
        metavar="URL",
        help=f"memory://NAME, amqp://user:pass@host:5672/vhost or a Service Bus connection "
        f"string (or ${ENV_PREFIX}BROKER)",
    )
    parser.add_argument(
        "--broker-file", metavar="FILE", help="read the broker URL from FILE (a secret)"
    )
    parser.add_argument(
        "--channel-suffix",
        metavar="SUFFIX",
        help="append SUFFIX to every exchange, queue and topic name, to run an isolated copy "
        "of the system on a shared broker (tests, side-by-side deployments); the agents must "
        "use the same suffix",
    )


def _db_options(parser: argparse.ArgumentParser, help: str, default: str | None = None) -> None:
    parser.add_argument("--db", metavar="URL", default=default, help=help)
    parser.add_argument("--db-file", metavar="FILE", help="read the database URL from FILE")


def _service_options(parser: argparse.ArgumentParser, default_group: str) -> None:
    parser.add_argument(
        "--group",
        metavar="NAME",
        help=f"the consumer group to read as (default: {default_group}); processes on one "
        "group share its messages",
    )
    parser.add_argument(
        "--origin",
        choices=[o.value for o in Origin],
        help="who may speak for a VM: vm-user (one broker user per VM, named after it; the "
        "default on RabbitMQ), scale-set-user (one per scale set), signed (an Azure-attested "
        "key of the VM's signs each message; the default on Service Bus), any (no check; the "
        "default on memory://). A message that fails is dead-lettered (origin-mismatch)",
    )
    parser.add_argument(
        "--attestation-ca",
        action="append",
        metavar="FILE",
        help="with --origin signed: the CA certificate(s) Azure's attested data chains to "
        "(PEM; repeatable)",
    )
    parser.add_argument(
        "--vm-inventory",
        metavar="FILE",
        help="with --origin signed: 'name,vmId' lines deciding which vmId each VM name has "
        "(else the first one seen by the process)",
    )
    parser.add_argument(
        "--health-port",
        type=_port,
        metavar="PORT",
        help="serve /healthz (503 with the reason once the broker has been unreachable for "
        "longer than --health-grace) and /metrics on PORT",
    )
    parser.add_argument(
        "--health-host", default="127.0.0.1", metavar="ADDR", help="address for --health-port"
    )
    parser.add_argument(
        "--health-grace",
        type=_positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="how long the broker may be unreachable before /healthz answers 503 (default 30)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scheduled-events",
        description="The central side of scheduled-events-relay: read the lifecycle messages "
        "of the whole fleet, approve events by policy, keep an audit ledger. Every option can "
        f"also be set as {ENV_PREFIX}<OPTION> (upper case, '-' as '_').",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    approver = commands.add_parser(
        "approver",
        help="the central approval service",
        description="Read the fleet stream (group 'approver', one active process at a time; "
        "start more for failover, sharing one --db), decide on every Scheduled event by "
        "policy, and send a signed approval, bound to the version of the event it judged, to "
        "one live VM of the event when the policy says so. Every decision is recorded in --db.",
    )
    _broker_options(approver)
    _service_options(approver, "approver")
    approver.add_argument("--signing-key", required=True, metavar="FILE", help="approver.key")
    approver.add_argument(
        "--policy",
        metavar="FILE",
        help="a policy TOML file (default: approve user-initiated events at once and Freeze "
        "events with 0 <= DurationInSeconds < 9; everything else waits for NotBefore)",
    )
    _db_options(
        approver,
        "where decisions are recorded and the state a standby needs lives (SQLite file, "
        "sqlite:///PATH or postgresql://...; the audit's database); without it a failover "
        "forgets",
    )
    approver.add_argument(
        "--decided-by", default="approver", metavar="NAME", help="the name put in approvals"
    )
    approver.set_defaults(run=_approver)

    audit = commands.add_parser(
        "audit",
        help="the append-only audit ledger, and its history",
        description="Without a subcommand: append every lifecycle message to the ledger "
        "(group 'audit'), as received. 'audit history' prints the timeline of a VM or an "
        "event, with the approver's decisions when they share the database.",
    )
    _broker_options(audit)
    _service_options(audit, "audit")
    _db_options(audit, "a SQLite file (default audit.db), sqlite:///PATH, or postgresql://...")
    audit_commands = audit.add_subparsers(dest="audit_command", metavar="history")
    history = audit_commands.add_parser("history", help="print the timeline of one VM or one event")
    history.add_argument(
        "--db", default=argparse.SUPPRESS, metavar="URL", help="the ledger to read"
    )
    history.add_argument(
        "--db-file", default=argparse.SUPPRESS, metavar="FILE", help="read the URL from FILE"
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
    tail.add_argument(
        "--type",
        action="append",
        metavar="TYPE",
        help=f"only this message type ({', '.join(k.value for k in MessageType)})",
    )
    tail.add_argument("--event-type", action="append", metavar="T", help="only this EventType")
    tail.add_argument("--vm", action="append", metavar="NAME", help="only from this VM")
    tail.add_argument("--json", action="store_true", help="print the CloudEvents JSON")
    tail.set_defaults(run=_tail)

    approve = commands.add_parser(
        "approve",
        help="an operator's manual approval of one event",
        description="Sign and send an approval of EVENT_ID, bound to the version of the event "
        "you judged (from --db, or --event-version), to one VM of the event; Azure then starts "
        "the event for every VM in its Resources. Waits for the agent's answer (applied or "
        "rejected, and why) unless --no-wait.",
    )
    approve.add_argument("event_id", metavar="EVENT_ID")
    approve.add_argument("--vm", required=True, metavar="NAME", help="the VM that applies it")
    _broker_options(approve)
    approve.add_argument("--signing-key", required=True, metavar="FILE", help="approver.key")
    _db_options(approve, "the audit ledger: the event's version is its newest report there")
    approve.add_argument(
        "--event-version",
        metavar="VERSION",
        help="the version of the event you judged (tail --json: data.event_version); the agent "
        "refuses the approval if the event changed since",
    )
    approve.add_argument("--reason", default="manual approval", help="recorded with it")
    approve.add_argument("--decided-by", default=os.environ.get("USER") or "operator")
    approve.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=60.0,
        help="seconds to wait for the outcome (default 60)",
    )
    approve.add_argument("--no-wait", action="store_true", help="send, do not wait for it")
    approve.add_argument(
        "--group",
        metavar="NAME",
        help="names the transient copy of the stream the outcome is awaited on (Service Bus: "
        "the subscription to read; default approve)",
    )
    approve.set_defaults(run=_approve)

    keygen = commands.add_parser(
        "keygen",
        help="write an Ed25519 key pair",
        description="Write approver.key (private, mode 0600, for the approver) and "
        "approver.pub (for the agents' trusted keys). Never overwrites.",
    )
    keygen.add_argument("--out", required=True, metavar="DIR")
    keygen.set_defaults(run=_keygen)

    migrate = commands.add_parser(
        "migrate",
        help="create or upgrade the central database's schema",
        description="Create or upgrade the schema (the audit ledger and the approver's state) "
        "as the database's owner; with PostgreSQL, grant least-privilege roles: the audit may "
        "only INSERT and SELECT the ledger, the approver also writes its own tables.",
    )
    _db_options(migrate, "the database (postgresql://OWNER@HOST/DB or a SQLite file)")
    migrate.add_argument("--grant-audit", metavar="ROLE", help="role the audit runs as")
    migrate.add_argument("--grant-approver", metavar="ROLE", help="role the approver runs as")
    migrate.set_defaults(run=_migrate)

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
    demo.add_argument(
        "--speed", type=_positive_number, default=60.0, help="time compression (default 60x)"
    )
    demo.add_argument("--quiet", action="store_true", help="only the summary")
    demo.add_argument(
        "--console",
        nargs="?",
        const="127.0.0.1:8600",
        metavar="HOST:PORT",
        help="also serve the operator console (default 127.0.0.1:8600), print its address and "
        "sign-in token, and keep everything running after the scenario until Ctrl-C",
    )
    demo.set_defaults(run=_demo)
    add_console_commands(commands)
    _environment_defaults(parser)
    return parser


def _environment_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option that takes a value defaults to ``SCHEDULED_EVENTS_<OPTION>`` when set."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _environment_defaults(sub)
            continue
        if not action.option_strings or action.nargs == 0:
            continue
        name = ENV_PREFIX + action.dest.upper()
        value = os.environ.get(name)
        if value is not None and action.default is not argparse.SUPPRESS:
            action.default = [value] if isinstance(action, argparse._AppendAction) else value
            action.required = False


def configure_logging(level: str) -> None:
    """The services' log on stderr: one line per record, whatever the inputs it quotes say
    (:class:`~schemas.observability.LineFormatter`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level), handlers=[handler])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        result: int = asyncio.run(args.run(args))
    except (ConfigError, SchemaError) as exc:
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
