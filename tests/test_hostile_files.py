"""Every file a central command is given (its signing key, policy, broker URL, attestation CA,
console users and session key; the IMDS simulator's topology and CA) may be what it should not
be: a FIFO nobody writes to, a link to ``/dev/zero``, a directory. Each is one line and exit 2
at once, as the agent's files are (``tests/publisher/test_settings_hostile.py``): before, the
command waited for ever on a FIFO, and read ``/dev/zero`` as a signing key until memory ran
out. Each command runs as the user runs it: a subprocess of the installed entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from consumers.console._users import Role, write_user
from schemas.approvals import write_key_pair

ROOT = Path(__file__).parents[1]

#: Each central command with one file flag at ``{bad}``; ``{key}``, ``{users}`` are good files.
COMMANDS = {
    "signing-key": ["approver", "--broker", "memory://x", "--signing-key", "{bad}"],
    "policy": ["approver", "--broker", "memory://x", "--signing-key", "{key}", "--policy", "{bad}"],
    "broker-file": ["approver", "--broker-file", "{bad}", "--signing-key", "{key}"],
    "attestation-ca": [
        "approver", "--broker", "memory://x", "--signing-key", "{key}", "--origin", "signed",
        "--attestation-ca", "{bad}",
    ],
    "approve-key": [
        "approve", "--broker", "memory://x", "--signing-key", "{bad}", "--vm", "web-1",
        "6513270E-269E-0D37-F2A7-4DE452E6B438",
    ],
    "console-users": ["console", "--broker", "memory://x", "--users", "{bad}"],
    "session-key": [
        "console", "--broker", "memory://x", "--users", "{users}", "--db", "sqlite:///{db}",
        "--session-key-file", "{bad}",
    ],
    # The IMDS simulator (``python -m publisher.simulator``): its fleet and its attestation CA.
    "simulator-topology": ["--simulator", "--topology", "{bad}"],
    "simulator-ca": [
        "--simulator", "--attestation-ca-cert", "{bad}", "--attestation-ca-key", "{key}",
    ],
}  # fmt: skip


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _endless(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _directory(path: Path) -> None:
    path.mkdir()


KINDS: dict[str, Callable[[Path], None]] = {
    "fifo": _fifo,
    "dev-zero": _endless,
    "directory": _directory,
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_file_that_is_not_a_regular_one_is_one_line_at_once(
    tmp_path: Path, command: str, kind: str
) -> None:
    key, _ = write_key_pair(tmp_path / "keys")
    users = tmp_path / "users"
    write_user(users, "ops", Role.VIEWER, "a password of some length", iterations=1000)
    bad = tmp_path / "bad"
    KINDS[kind](bad)
    db = tmp_path / "never-made.db"
    argv = [a.format(bad=bad, key=key, users=users, db=db) for a in COMMANDS[command]]
    module = "consumers"
    if argv[0] == "--simulator":
        module, argv = "publisher.simulator", argv[1:]
    result = subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True,
        text=True,
        timeout=30,  # a FIFO held the command for ever
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    if module == "consumers":
        assert len(lines) == 1, result.stderr
    # (The simulator says its usage first, as for any bad flag.)
    assert f"{bad} is not a regular file" in lines[-1]
    assert not db.exists()
