"""``python -m publisher`` / ``scheduled-events-agent``: the agent as a service.

Exit codes: 0 after a clean stop (SIGTERM, SIGINT), 2 for invalid settings (one line naming the
setting), 1 when the agent failed.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from schemas import ConfigError

from ._agent import Agent
from ._logging import configure_logging
from ._settings import parse_settings

__all__ = ["main"]

log = logging.getLogger("publisher")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = parse_settings(argv)
    except ConfigError as exc:
        print(f"scheduled-events-agent: invalid settings: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_format, settings.log_level)
    agent = Agent(settings)
    try:
        asyncio.run(agent.run(handle_signals=True))
    except ConfigError as exc:  # a trust key that is not a key, found when loading it
        print(f"scheduled-events-agent: invalid settings: {exc}", file=sys.stderr)
        return 2
    except Exception:
        log.exception("the agent failed; exiting with status 1")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
