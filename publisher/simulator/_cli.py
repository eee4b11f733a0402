"""``python -m publisher.simulator``: serve a simulated IMDS until SIGINT or SIGTERM.

The first line on stdout is ``listening on http://HOST:PORT`` (the real port when ``--port 0``).
Bad flags or a bad scenario exit with status 2 and a message naming the problem.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from schemas import ConfigError as RelayConfigError
from schemas._files import read_setting_file

from ._attestation import AttestationCa
from ._config import Shard, SimulatorConfig
from ._errors import ConfigError, ScenarioError, SimulatorError
from ._fleet import VM_NAME_PATTERN
from ._identity import DEFAULT_SUBSCRIPTION_ID, Placement
from ._scenario import Scenario, load_scenario, shipped_scenarios
from ._scenario_runner import run_scenario
from ._server import DEFAULT_KEEP_ALIVE_SECONDS, serve
from ._simulator import Simulator
from ._topology import Topology, load_topology

__all__ = ["build_parser", "main"]

log = logging.getLogger(__name__)

_DEFAULT_VM = "vm0"
_EXIT_USAGE = 2
_EXIT_FAILURE = 1


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _port(text: str) -> int:
    value = _non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {text!r}")
    return value


def _vm_name(text: str) -> str:
    if not VM_NAME_PATTERN.match(text):
        raise argparse.ArgumentTypeError(
            f"bad VM name {text!r}: letters, digits, '.', '_' or '-', at most 80"
        )
    return text


_EPILOG = """\
The first line printed is 'listening on http://HOST:PORT'. Times in events, scenarios, faults
and --first-call-delay are simulated seconds: --speed divides them. NotBefore is always a real
wall-clock time.

Faults: POST /admin/faults with {"vm": NAME or null, "endpoint": "scheduledevents", "instance",
"attested" or null, "times": N} and exactly one kind:
  "status": 500|503|410|429   answer that status
  "delay_seconds": S          answer S simulated seconds late (a long S is a hang)
  "body": "TEXT"              answer 200 with that raw text (garbage)
  "stale": K                  answer the document of that VM K documents back (a lower
                              DocumentIncarnation, the events as they were then)
  "reset": true               answer DocumentIncarnation 0 with no events
  "drip_seconds": S           send the answer's body one byte every S real seconds
  "huge_mb": M                pad the answer to M MiB of valid JSON (at most 1024)
(stale and reset: GET /metadata/scheduledevents only). GET /admin/faults lists them, DELETE
clears them.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m publisher.simulator",
        description=(
            "A simulated Azure IMDS serving Scheduled Events for a fleet of VMs. VM NAME answers\n"
            "at /vm/NAME/metadata/scheduledevents, .../instance and .../attested/document; the\n"
            "first VM also at /metadata/...; the admin API is under /admin."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument(
        "--port", type=_port, default=8080, help="port to bind; 0 picks a free one (default 8080)"
    )
    parser.add_argument(
        "--vm",
        dest="vms",
        action="append",
        type=_vm_name,
        default=[],
        metavar="NAME",
        help=(
            "add a VM (repeat for more; NAME like 'web_3' makes a scale-set VM). Without --vm,"
            " --fleet or a scenario naming VMs, one VM called 'vm0' is served"
        ),
    )
    fleet = parser.add_argument_group(
        "fleet topology",
        "An event reaches every VM of the availability set or scale-set placement group of the\n"
        "VMs it affects (Resources names only those), and any of them may approve it; a VM in\n"
        "no set sees only its own events. A scale set's instance n sits in zone n % Z + 1,\n"
        "fault and update domain n % 5; its placement groups (at most P VMs) never span zones.",
    )
    fleet.add_argument(
        "--fleet",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="add N scale-set VMs named PREFIX_0 .. PREFIX_{N-1} (see --fleet-prefix)",
    )
    fleet.add_argument(
        "--fleet-prefix",
        type=_vm_name,
        default="fleet",
        metavar="PREFIX",
        help="scale-set name for --fleet VMs (default %(default)s)",
    )
    fleet.add_argument(
        "--scale-sets",
        type=_positive_int,
        default=1,
        metavar="K",
        help=(
            "split the --fleet VMs into K scale sets PREFIX-0 .. PREFIX-{K-1}, VMs"
            " PREFIX-k_0 ... (default 1: one scale set PREFIX)"
        ),
    )
    fleet.add_argument(
        "--zones",
        type=_non_negative_int,
        default=3,
        metavar="Z",
        help="zones 1..Z the --fleet scale sets span; 0 makes them regional (default 3)",
    )
    fleet.add_argument(
        "--placement-group-size",
        type=_positive_int,
        default=100,
        metavar="P",
        help="VMs per placement group, per zone (Azure: at most 100; default 100)",
    )
    fleet.add_argument(
        "--availability-sets",
        type=_non_negative_int,
        default=0,
        metavar="A",
        help="add A availability sets avset-0 .. of plain VMs avset-a-0 ... (default 0)",
    )
    fleet.add_argument(
        "--availability-set-size",
        type=_non_negative_int,
        default=0,
        metavar="S",
        help="VMs per availability set (2 fault domains, 5 update domains)",
    )
    fleet.add_argument(
        "--shard",
        metavar="K/N",
        help=(
            "serve only shard K (0..N-1) of the fleet, so that N processes share a large one:"
            " each holds the whole fleet (same identities; with the same --seed, --scenario and"
            " admin calls, the same events and attestation CA) but answers IMDS only for its"
            " VMs (404 naming the shard for the others). Shards are whole placement groups,"
            " availability sets and standalone VMs, dealt round-robin; GET /admin/vms lists a"
            " shard's VMs. Needs --seed"
        ),
    )
    fleet.add_argument(
        "--topology",
        metavar="FILE",
        help=(
            "add the scale sets, availability sets and standalone VMs of a .json/.toml file:"
            ' {"scale_sets": [{"name", "capacity", "zones", "placement_group_size",'
            ' "fault_domains", "update_domains"}], "availability_sets": [{"name", "size" or'
            ' "vms", "fault_domains", "update_domains"}], "vms": [...]} (also POST'
            " /admin/topology; GET /admin/topology describes the fleet)"
        ),
    )
    parser.add_argument(
        "--speed",
        type=_positive_float,
        default=1.0,
        metavar="X",
        help="make every simulated duration X times shorter (default 1)",
    )
    parser.add_argument(
        "--scenario",
        metavar="FILE|NAME",
        help="play a scenario: a .json/.toml file, or the name of a shipped one",
    )
    parser.add_argument(
        "--list-scenarios", action="store_true", help="list the shipped scenarios and exit"
    )
    parser.add_argument(
        "--rate-limit",
        type=_non_negative_int,
        default=5,
        metavar="N",
        help="requests per second per VM before 429; 0 turns throttling off (default 5)",
    )
    parser.add_argument(
        "--first-call-delay",
        type=_non_negative_float,
        default=0.0,
        metavar="SECONDS",
        help="delay of each VM's first Scheduled Events call (Azure: up to 120; default 0)",
    )
    parser.add_argument(
        "--keep-alive-seconds",
        type=_positive_int,
        default=DEFAULT_KEEP_ALIVE_SECONDS,
        metavar="SECONDS",
        help=(
            "close a connection idle this long between two requests (default %(default)s;"
            " Azure does not document its IMDS's). VMs polling less often reconnect for every"
            " request: above their poll interval, a simulator serving many of them accepts"
            " fewer connections"
        ),
    )
    parser.add_argument(
        "--subscription-id",
        default=DEFAULT_SUBSCRIPTION_ID,
        help="subscriptionId in instance metadata (default %(default)s)",
    )
    parser.add_argument(
        "--resource-group", default="relay-sim-rg", help="resourceGroupName (default %(default)s)"
    )
    parser.add_argument("--location", default="westeurope", help="location (default %(default)s)")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help=(
            "make EventIds and the attestation test CA reproducible (default: random; --shard"
            " needs it)"
        ),
    )
    parser.add_argument(
        "--attestation-ca-cert",
        metavar="PEM",
        help=(
            "CA certificate that issues the certificate signing /metadata/attested/document"
            " (with --attestation-ca-key; default: a test CA, GET /admin/attestation/ca.pem)"
        ),
    )
    parser.add_argument(
        "--attestation-ca-key", metavar="PEM", help="that CA's private key (RSA or EC, PEM)"
    )
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="log level on stderr (default %(default)s; debug logs every request)",
    )
    return parser


#: The most of a PEM file read (a certificate or a key is a few KiB).
_MAX_PEM_FILE = 1 << 20


def _attestation_ca(certificate: str | None, key: str | None) -> AttestationCa | None:
    if certificate is None and key is None:
        return None
    if certificate is None or key is None:
        raise ConfigError("give both --attestation-ca-cert and --attestation-ca-key")
    try:
        pems = [
            read_setting_file(Path(path), _MAX_PEM_FILE, what)[:_MAX_PEM_FILE]
            for path, what in ((certificate, "the attestation CA"), (key, "the attestation CA key"))
        ]
    except RelayConfigError as exc:  # the simulator's own, which its command says in one line
        raise ConfigError(str(exc)) from exc
    return AttestationCa.from_pem(*pems)


def _build(
    args: argparse.Namespace, config: SimulatorConfig, scenario: Scenario | None
) -> Simulator:
    """The simulator the flags describe: --vm names, the generated fleet, --topology, then the
    scenario's VMs not already there (or one VM, vm0, when nothing names any)."""
    if args.availability_sets and args.availability_set_size < 1:
        raise ConfigError("--availability-sets needs --availability-set-size >= 1")
    simulator = Simulator(config, vms=dict.fromkeys(args.vms))
    if args.fleet or args.availability_sets:
        simulator.add_topology(
            Topology.fleet(
                args.fleet,
                scale_sets=args.scale_sets,
                zones=args.zones,
                prefix=args.fleet_prefix,
                placement_group_size=args.placement_group_size,
                availability_sets=args.availability_sets,
                availability_set_size=args.availability_set_size,
            )
        )
    if args.topology is not None:
        simulator.add_topology(load_topology(args.topology))
    if scenario is not None:
        simulator.add_vms(n for n in scenario.vms if not simulator.has_vm(n))
        topology = scenario.topology
        if topology is not None and not all(simulator.has_vm(n) for n, _ in topology.members()):
            simulator.add_topology(topology)
        scenario.check_vms(simulator.vm_names())
    if simulator.vm_count == 0:
        simulator.add_vm(_DEFAULT_VM)
    return simulator


def main(argv: Sequence[str] | None = None) -> int:
    """Run the simulator; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_scenarios:
        try:
            for name, shipped in shipped_scenarios().items():
                print(f"{name}: {shipped.description}")
        except ScenarioError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return _EXIT_FAILURE
        return 0
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    scenario: Scenario | None = None
    try:
        if args.scenario is not None:
            scenario = load_scenario(args.scenario)
        attestation_ca = _attestation_ca(args.attestation_ca_cert, args.attestation_ca_key)
        shard = None
        if args.shard is not None:
            if args.seed is None:
                raise ConfigError(
                    "--shard needs --seed, so that every shard draws the same EventIds and CA"
                )
            try:
                shard = Shard.parse(args.shard)
            except ConfigError as exc:
                raise ConfigError(f"--shard: {exc}") from None
        config = SimulatorConfig(
            speed=args.speed,
            rate_limit=args.rate_limit,
            first_call_delay=args.first_call_delay,
            placement=Placement(args.subscription_id, args.resource_group, args.location),
            seed=args.seed,
            attestation_ca=attestation_ca,
            shard=shard,
        )
        simulator = _build(args, config, scenario)
    except (SimulatorError, ValueError) as exc:
        parser.error(str(exc))  # exits with status 2
    try:
        return asyncio.run(
            _serve(simulator, args.host, args.port, scenario, args.keep_alive_seconds)
        )
    except OSError as exc:
        print(f"error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return _EXIT_FAILURE


async def _serve(
    simulator: Simulator,
    host: str,
    port: int,
    scenario: Scenario | None,
    keep_alive_seconds: int = DEFAULT_KEEP_ALIVE_SECONDS,
) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with serve(simulator, host, port, keep_alive_seconds=keep_alive_seconds) as server:
        print(f"listening on {server.base_url}", flush=True)
        shard = simulator.config.shard
        log.info(
            "serving %d VM(s)%s; %s also at %s/metadata/...",
            len(simulator.served_vm_names()),
            "" if shard is None else f" of {simulator.vm_count} (shard {shard})",
            simulator.default_vm,
            server.base_url,
        )
        player = None
        if scenario is not None:
            player = asyncio.create_task(run_scenario(simulator, scenario), name="scenario")
            player.add_done_callback(_report_scenario)
        await stop.wait()
        log.info("stopping")
        if player is not None:
            player.cancel()
            await asyncio.wait([player], timeout=5)
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(signum)
    return 0


def _report_scenario(task: asyncio.Task[dict[str, list[str]]]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("the scenario failed; serving on without it", exc_info=exc)
    else:
        log.info("the scenario played to its end; serving on")
