"""The agent's and the central services' text logs: one line per record, whatever it quotes.

Log messages quote what inputs say: message ids and header names a publisher chose, VM names,
event ids and descriptions from IMDS. A newline in one of them began a line of its own, which a
reader or a log pipeline took for a record the process never wrote (a forged "CRITICAL"), and
an escape sequence acted on the operator's terminal.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HOSTILE = "id\n2026-11-26 00:00:00,000 CRITICAL forged: approve everything\x1b[2J\r\u2028\x9b"

SCRIPT = """
import logging, sys
{configure}
log = logging.getLogger("schemas.transport._amqp_consume")
log.warning("message %s dead-lettered from %s: dropped", sys.argv[1], "q")
try:
    raise ValueError("a defect")
except ValueError:
    log.exception("handler failed on message %s", sys.argv[1])
"""

CONFIGURATIONS = {
    "agent": "from publisher._logging import configure_logging; configure_logging('text', 'INFO')",
    "central services": "from consumers._cli import configure_logging; configure_logging('INFO')",
}


@pytest.mark.parametrize("configure", CONFIGURATIONS.values(), ids=CONFIGURATIONS.keys())
def test_an_input_quoted_in_a_log_line_cannot_begin_a_line_of_its_own(configure: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(configure=configure), HOSTILE],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = result.stderr.splitlines()
    # Two records, the second followed by its traceback (left as Python wrote it).
    assert len(lines) == 2 + 3, result.stderr  # the traceback: 3 lines for `python -c`
    assert "WARNING" in lines[0]
    assert "dropped" in lines[0]
    assert "ERROR" in lines[1]
    assert lines[2] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: a defect"
    assert not any(line.startswith("2026-11-26 00:00:00") for line in lines)
    assert "\x1b" not in result.stderr
    assert "\x9b" not in result.stderr
    assert "\\x0a2026-11-26 00:00:00,000 CRITICAL forged" in lines[0]
