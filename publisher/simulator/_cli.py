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

from ._config import SimulatorConfig
from ._errors import ScenarioError, SimulatorError
from ._identity import DEFAULT_SUBSCRIPTION_ID, Placement
from ._ledger import VM_NAME_PATTERN
from ._scenario import Scenario, load_scenario, shipped_scenarios
from ._scenario_runner import run_scenario
from ._server import serve
from ._simulator import Simulator

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m publisher.simulator",
        description=(
            "A simulated Azure IMDS serving Scheduled Events for a fleet of VMs. VM NAME answers"
            " at /vm/NAME/metadata/scheduledevents and /vm/NAME/metadata/instance; the first VM"
            " also at /metadata/...; the admin API is under /admin."
        ),
        epilog=(
            "The first line printed is 'listening on http://HOST:PORT'. Times in events,"
            " scenarios, faults and --first-call-delay are simulated seconds: --speed divides"
            " them. NotBefore is always a real wall-clock time."
        ),
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
    parser.add_argument(
        "--fleet",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="add N scale-set VMs named PREFIX_0 .. PREFIX_{N-1} (see --fleet-prefix)",
    )
    parser.add_argument(
        "--fleet-prefix",
        type=_vm_name,
        default="fleet",
        metavar="PREFIX",
        help="scale-set name for --fleet VMs (default %(default)s)",
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
        "--subscription-id",
        default=DEFAULT_SUBSCRIPTION_ID,
        help="subscriptionId in instance metadata (default %(default)s)",
    )
    parser.add_argument(
        "--resource-group", default="relay-sim-rg", help="resourceGroupName (default %(default)s)"
    )
    parser.add_argument("--location", default="westeurope", help="location (default %(default)s)")
    parser.add_argument(
        "--seed", type=int, default=None, help="make EventIds reproducible (default: random)"
    )
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="log level on stderr (default %(default)s; debug logs every request)",
    )
    return parser


def _vm_names(args: argparse.Namespace, scenario: Scenario | None) -> list[str]:
    names: list[str] = list(dict.fromkeys(args.vms))
    names += [f"{args.fleet_prefix}_{i}" for i in range(args.fleet)]
    if scenario is not None:
        names += scenario.vms
    names = list(dict.fromkeys(names))
    return names or [_DEFAULT_VM]


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
        names = _vm_names(args, scenario)
        if scenario is not None:
            scenario.check_vms(names)
        config = SimulatorConfig(
            speed=args.speed,
            rate_limit=args.rate_limit,
            first_call_delay=args.first_call_delay,
            placement=Placement(args.subscription_id, args.resource_group, args.location),
            seed=args.seed,
        )
        simulator = Simulator(config, vms=names)
    except SimulatorError as exc:
        parser.error(str(exc))  # exits with status 2
    try:
        return asyncio.run(_serve(simulator, args.host, args.port, scenario))
    except OSError as exc:
        print(f"error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return _EXIT_FAILURE


async def _serve(simulator: Simulator, host: str, port: int, scenario: Scenario | None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with serve(simulator, host, port) as server:
        print(f"listening on {server.base_url}", flush=True)
        log.info(
            "serving %d VM(s); %s also at %s/metadata/...",
            simulator.vm_count,
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
