"""``python -m publisher`` / ``scheduled-events-agent``: the agent as a service.

Exit codes: 0 after a clean stop (SIGTERM, SIGINT), 2 for invalid settings or a place the agent
cannot work with (one line naming the setting and what to check: a broker that refuses the
login, a state dir that is a file, an IMDS URL that answers 404...), 1 when the agent failed.
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


def _config_error(exc: BaseException) -> ConfigError | None:
    """The ConfigError behind ``exc`` (a task group wraps its tasks' errors), if any."""
    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _config_error(inner)
            if found is not None:
                return found
    return None


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
    except BaseException as exc:
        config = _config_error(exc)
        if config is not None:
            print(f"scheduled-events-agent: {config}", file=sys.stderr)
            return 2
        if isinstance(exc, KeyboardInterrupt):
            return 130
        if isinstance(exc, Exception):
            log.exception("the agent failed; exiting with status 1")
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
