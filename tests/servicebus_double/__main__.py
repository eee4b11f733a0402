"""Run the Service Bus double standalone until SIGTERM or Ctrl-C.

    python -m tests.servicebus_double --port 0 --queue orders --session-queue work \\
        --topic events:audit,billing --lock-duration 5 --max-delivery-count 3

The first line on stdout is ``listening on HOST:PORT``; the second is the connection string.
With ``--control``, each line on stdin is a command, answered with one line on stdout:
``usage`` (the connections and links held, as JSON: see ``ServiceBusDouble.usage``) or
``restart-usage`` (a new measurement window; answers ``ok``). End of input stops the double,
so another process can measure a client that runs elsewhere.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from dataclasses import asdict
from types import FrameType

from . import STANDARD_MAX_MESSAGE_SIZE, EntityOptions, ServiceBusDouble

_LOGGER = logging.getLogger(__name__)


def _topic(spec: str) -> tuple[str, list[str]]:
    name, _, subs = spec.partition(":")
    subscriptions = [s for s in subs.split(",") if s]
    if not name or not subscriptions:
        raise argparse.ArgumentTypeError(f"expected TOPIC:SUB1,SUB2, got {spec!r}")
    return name, subscriptions


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.servicebus_double", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--queue", action="append", default=[], metavar="NAME")
    parser.add_argument("--session-queue", action="append", default=[], metavar="NAME")
    parser.add_argument(
        "--topic", action="append", default=[], type=_topic, metavar="NAME:SUB1,SUB2"
    )
    parser.add_argument(
        "--session-topic",
        action="append",
        default=[],
        type=_topic,
        metavar="NAME:SUB1,SUB2",
        help="a topic whose listed subscriptions require sessions",
    )
    parser.add_argument("--lock-duration", type=float, default=30.0, metavar="SECONDS")
    parser.add_argument("--max-delivery-count", type=int, default=10)
    parser.add_argument(
        "--duplicate-detection-window",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="0 turns duplicate detection off",
    )
    parser.add_argument(
        "--max-message-size",
        type=int,
        default=STANDARD_MAX_MESSAGE_SIZE,
        metavar="BYTES",
        help="the largest message the entities take (default: Standard's; 0: no limit)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="answer 'usage' and 'restart-usage' lines on stdin; stop at the end of stdin",
    )
    parser.add_argument("--log-level", default="WARNING")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    options = EntityOptions(
        lock_duration=args.lock_duration,
        max_delivery_count=args.max_delivery_count,
        duplicate_detection_window=args.duplicate_detection_window or None,
    )
    double = ServiceBusDouble(
        queues=args.queue,
        session_queues=args.session_queue,
        topics=dict(args.topic),
        session_topics=dict(args.session_topic),
        options=options,
        host=args.host,
        port=args.port,
        max_message_size=args.max_message_size,
    )
    stop = threading.Event()

    def _on_signal(signum: int, _frame: FrameType | None) -> None:
        _LOGGER.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    with double:
        print(f"listening on {args.host}:{double.port}", flush=True)
        print(double.connection_string, flush=True)
        if args.control:
            threading.Thread(target=_serve_control, args=(double, stop), daemon=True).start()
        while not stop.wait(0.5):
            pass
    return 0


def _serve_control(double: ServiceBusDouble, stop: threading.Event) -> None:
    for line in sys.stdin:
        command = line.strip()
        if command == "usage":
            print(json.dumps(asdict(double.usage())), flush=True)
        elif command == "restart-usage":
            double.restart_usage()
            print("ok", flush=True)
        elif command:
            print(json.dumps({"error": f"unknown command {command!r}"}), flush=True)
    stop.set()


if __name__ == "__main__":
    sys.exit(main())
