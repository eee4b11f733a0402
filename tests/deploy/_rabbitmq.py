"""A throwaway vhost with the relay's users, made by deploy/rabbitmq/relay_rabbitmq.py on the
real RabbitMQ, for the least-privilege tests; deleted afterwards with everything in it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest

from schemas.channels import vm_word

from ._paths import RABBITMQ

SCRIPT = RABBITMQ / "relay_rabbitmq.py"
_TIMEOUT = 120


def rabbitmqctl_or_skip() -> str:
    """rabbitmqctl, usable by this process (it needs the node's Erlang cookie: root)."""
    found = shutil.which("rabbitmqctl") or (
        "/usr/sbin/rabbitmqctl" if Path("/usr/sbin/rabbitmqctl").exists() else None
    )
    problem = None
    if found is None:
        problem = "rabbitmqctl is not installed"
    else:
        try:
            result = subprocess.run(
                [found, "list_vhosts", "-q"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        except subprocess.TimeoutExpired:
            problem = "rabbitmqctl did not answer in 60 s"
        else:
            if result.returncode != 0:
                problem = f"rabbitmqctl cannot reach the node: {result.stderr.strip()[-200:]}"
    if problem:
        message = f"{problem} (the least-privilege tests run it as root on the broker's host)"
        if os.environ.get("CI"):
            pytest.fail(f"CI needs rabbitmqctl: {message}", pytrace=False)
        pytest.skip(message)
    assert found is not None
    return found


def run_script(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT,
        check=False,
    )


def vhost_command_on_the_broker(ctl: str) -> subprocess.CompletedProcess[str]:
    """``relay_rabbitmq.py vhost`` on the real broker, for a throwaway vhost deleted after."""
    vhost = f"relay-test-{uuid.uuid4().hex[:8]}"
    try:
        return run_script("vhost", "--vhost", vhost)
    finally:
        subprocess.run([ctl, "delete_vhost", vhost], capture_output=True, timeout=60, check=False)


def script_ok(*args: str, stdin: str | None = None) -> str:
    result = run_script(*args, stdin=stdin)
    assert result.returncode == 0, f"relay_rabbitmq.py {' '.join(args)}:\n{result.stderr}"
    return result.stdout


@dataclass
class RelayVhost:
    """The vhost, its users' passwords, and the broker's address."""

    vhost: str
    host: str
    port: int
    passwords_dir: Path
    unique: str
    users: list[str] = field(default_factory=list)

    def password(self, user: str) -> str:
        return (self.passwords_dir / user).read_text().splitlines()[0]

    def url(self, user: str, **options: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return (
            f"amqp://{quote(user, safe='')}:{quote(self.password(user), safe='')}"
            f"@{self.host}:{self.port}/{quote(self.vhost, safe='')}"
            + (f"?{query}" if query else "")
        )


@contextmanager
def relay_vhost(
    amqp_url: str,
    directory: Path,
    *,
    vms: tuple[str, ...] = (),
    scale_sets: tuple[str, ...] = (),
    approvers: tuple[str, ...] = (),
    audits: tuple[str, ...] = (),
    tails: tuple[str, ...] = (),
    bulk: bool = True,
) -> Iterator[RelayVhost]:
    """A new vhost made by the script (``--bulk``: one import; fast), deleted afterwards with
    its users, whatever happened."""
    ctl = rabbitmqctl_or_skip()
    unique = uuid.uuid4().hex[:8]
    split = urlsplit(amqp_url)
    relay = RelayVhost(
        vhost=f"relay-test-{unique}",
        host=split.hostname or "127.0.0.1",
        port=split.port or 5672,
        passwords_dir=directory / f"passwords-{unique}",
        unique=unique,
    )
    roles = (
        ("vm", vms, [vm_word(v) for v in vms]),
        ("scale-set", scale_sets, [vm_word(s) for s in scale_sets]),
        ("approver", approvers, list(approvers)),
        ("audit", audits, list(audits)),
        ("tail", tails, list(tails)),
    )
    try:
        script_ok("vhost", "--vhost", relay.vhost)
        for role, names, users in roles:
            if names:
                relay.users += users
                extra = ["--bulk"] if bulk else []
                script_ok(
                    role,
                    "--vhost",
                    relay.vhost,
                    "--passwords-dir",
                    str(relay.passwords_dir),
                    *extra,
                    *names,
                )
        yield relay
    finally:
        for command in (["delete_vhost", relay.vhost], *(["delete_user", u] for u in relay.users)):
            subprocess.run([ctl, *command], capture_output=True, text=True, timeout=60, check=False)


def stand_in_rabbitmqctl(
    tmp_path: Path, answers: Mapping[str, str] | None = None
) -> tuple[Path, Path]:
    """A stand-in rabbitmqctl (a shell script; the shared broker's answers are well formed):
    each command in ``answers`` (``list_users``, ``status``, ``eval``...) prints its answer,
    ``list_vhosts`` otherwise a vhost ``relay`` and the other listings none; every call
    succeeds and is written to the log returned."""
    fake, log = tmp_path / "rabbitmqctl", tmp_path / "calls.log"
    script = f'#!/bin/sh\necho "$1" >> "{log}"\n'
    for number, (command, answer) in enumerate((answers or {}).items()):
        text = tmp_path / f"answer-{number}"
        text.write_text(answer, encoding="utf-8")
        script += f'if [ "$1" = {command} ]; then cat "{text}"; exit 0; fi\n'
    script += (
        'if [ "$1" = list_vhosts ]; then echo \'[{"name": "relay"}]\'; exit 0; fi\n'
        'case "$1" in list_*) echo "[]";; esac\n'
        "exit 0\n"
    )
    fake.write_text(script, encoding="utf-8")
    fake.chmod(0o755)
    return fake, log
