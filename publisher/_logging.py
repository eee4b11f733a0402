"""Logging for the CLI: text for people, one JSON object per line for log pipelines."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

from schemas.observability import LineFormatter

__all__ = ["JsonFormatter", "configure_logging"]

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """``{"time", "level", "logger", "message", ...extra}``; exceptions as ``exc_info`` text."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = (
                    value if isinstance(value, str | int | float | bool | None) else repr(value)
                )
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(log_format: str = "text", level: str = "INFO") -> None:
    """Configure the root logger once, for the CLI (a library user configures their own)."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(LineFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs every request at INFO: once a second is noise.
    logging.getLogger("httpx").setLevel(logging.WARNING)
