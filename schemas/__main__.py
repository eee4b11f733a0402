"""``python -m schemas export [--check]``: write (or check) the exported contract files."""

from __future__ import annotations

import argparse
import sys

from ._errors import ConfigError
from .export import HERE, render_all, write_all


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except ConfigError as exc:
        print(f"python -m schemas: {exc}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m schemas",
        description="The wire contract of scheduled-events-relay.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser(
        "export",
        help="write schemas/jsonschema/*.json and schemas/asyncapi.yaml from the models",
    )
    export.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when a committed file differs from what the code gives",
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = [
            str(path)
            for path, text in render_all().items()
            if not (HERE / path).exists() or (HERE / path).read_text(encoding="utf-8") != text
        ]
        if stale:
            print("out of date (run `python -m schemas export`): " + ", ".join(stale))
            return 1
        print("the exported contract is up to date")
        return 0
    for path in write_all():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
