"""`relay_rabbitmq.py` reads users' passwords from files (`--password-file`, `--passwords-dir`)
and standard input: a password source it cannot take is said in one line, exit 1, before any
user is made; never a traceback, never a script that waits for ever or reads until memory
runs out.

rabbitmqctl is a stand-in here (a shell script that records its calls): what is tested is the
script's reading of its own inputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ._rabbitmq import SCRIPT, stand_in_rabbitmqctl


def _not_utf8(path: Path) -> None:
    path.write_bytes(b"\xffpassword\n")


def _fifo(path: Path) -> None:
    os.mkfifo(path)  # nobody writes to it: reading it would wait for ever


def _endless(path: Path) -> None:
    path.symlink_to("/dev/zero")  # reading it to the end would fill the memory


def _directory(path: Path) -> None:
    path.mkdir()


def _too_long(path: Path) -> None:
    path.write_bytes(b"x" * 100_000)


HOSTILE: dict[str, tuple[Callable[[Path], None], str]] = {
    "not-utf8": (_not_utf8, "is not UTF-8 text"),
    "fifo": (_fifo, "is not a regular file"),
    "dev-zero": (_endless, "is not a regular file"),
    "directory": (_directory, "is not a regular file"),
    "too-long": (_too_long, "holds more than 65,536 bytes"),
}


def _run(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    # 20 s, not the deploy tests' 120 s: the script must not wait on what it reads.
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], input=stdin, capture_output=True, timeout=20
    )


@pytest.mark.parametrize("source", ["--password-file", "--passwords-dir"])
@pytest.mark.parametrize("kind", list(HOSTILE), ids=list(HOSTILE))
def test_a_password_file_the_script_cannot_take_is_said_before_any_user_is_made(
    tmp_path: Path, source: str, kind: str
) -> None:
    make, said = HOSTILE[kind]
    fake, log = stand_in_rabbitmqctl(tmp_path)
    directory = tmp_path / "passwords"
    directory.mkdir()
    path = directory / "web-1"
    make(path)
    where = str(path) if source == "--password-file" else str(directory)
    result = _run("--rabbitmqctl", str(fake), "vm", "--vhost", "relay", source, where, "web-1")
    stderr = result.stderr.decode()
    assert result.returncode == 1, stderr
    assert "Traceback" not in stderr
    assert f"the password file {path} {said}" in stderr
    assert "add_user" not in log.read_text(encoding="utf-8").split()


def test_standard_input_that_is_not_utf8_is_said() -> None:
    result = _run(
        "--dry-run", "vm", "--vhost", "relay", "--password-stdin", "web-1", stdin=b"\xff\n"
    )
    stderr = result.stderr.decode()
    assert result.returncode == 1, stderr
    assert "Traceback" not in stderr
    assert "standard input is not UTF-8 text" in stderr


def test_a_readable_password_file_still_makes_the_user(tmp_path: Path) -> None:
    fake, log = stand_in_rabbitmqctl(tmp_path)
    secret = tmp_path / "web-1.password"
    secret.write_text("s3cret\n", encoding="utf-8")
    result = _run(
        "--rabbitmqctl", str(fake), "vm", "--vhost", "relay", "--password-file", str(secret),
        "web-1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()
    assert "add_user" in log.read_text(encoding="utf-8").split()
