"""``python -m publisher.simulator`` (script ``scheduled-events-simulator``); see ``--help``.

Serving needs the ``[simulator]`` extra: without Starlette or uvicorn this says what to install,
in one line, and exits 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]

_EXTRA = "pip install 'scheduled-events-relay[simulator]'"
_EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the simulator's CLI; returns the exit status."""
    try:
        from ._cli import main as cli
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in ("starlette", "uvicorn"):
            raise
        print(
            f"error: the IMDS simulator needs its extra ({missing} is missing): {_EXTRA}",
            file=sys.stderr,
        )
        return _EXIT_USAGE
    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
