"""`relay_rabbitmq.py vhost` warns when the broker node may hold too few open files for a fleet.

Each agent holds a connection, and each VM's approvals queue (a durable classic queue) a file
while an approval waits in it. RabbitMQ runs with its process's ``ulimit -n``, often 1,024 (927
files, 832 of them connections): such a node has room for 832 agents' connections, its file
handle cache churns under a fleet's approvals (3.x: the busiest process by reductions of this
project's 2,000-VM fleet run), and classic queues v2 fail with ``emfile``. No vhost or
``rabbitmq.conf`` setting raises it, so the script says what to raise.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ._rabbitmq import (
    rabbitmqctl_or_skip,
    run_script,
    stand_in_rabbitmqctl,
    vhost_command_on_the_broker,
)

MIN_OPEN_FILES = 65536


@pytest.mark.rabbitmq
def test_the_vhost_command_says_how_to_raise_a_low_open_files_limit() -> None:
    ctl = rabbitmqctl_or_skip()
    status = json.loads(
        subprocess.run(
            [ctl, "status", "--formatter", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    )
    limit = status["file_descriptors"]["total_limit"]
    if limit >= MIN_OPEN_FILES:
        pytest.skip(f"this broker may hold {limit} open files already")
    result = vhost_command_on_the_broker(ctl)
    assert result.returncode == 0, result.stderr
    assert f"the broker node may hold {limit:,} open files" in result.stderr
    assert f"LimitNOFILE={MIN_OPEN_FILES}" in result.stderr
    assert "ready with 2 policies" in result.stdout


def _fake_rabbitmqctl(tmp_path: Path, status: str) -> Path:
    """A stand-in for rabbitmqctl (the shared broker's limit cannot be changed for one test):
    it accepts every call, answers ``status`` with ``status`` and the message size with 512 KiB."""
    fake, _ = stand_in_rabbitmqctl(tmp_path, {"status": status, "eval": "{ok,524288}"})
    return fake


def test_no_warning_when_the_node_may_hold_enough_open_files(tmp_path: Path) -> None:
    status = {"file_descriptors": {"total_limit": 1048476, "sockets_limit": 943538}}
    fake = _fake_rabbitmqctl(tmp_path, json.dumps(status))
    result = run_script("--rabbitmqctl", str(fake), "vhost", "--vhost", "relay")
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr
    assert "ready with 2 policies" in result.stdout


UNREADABLE = {
    "empty": "",
    "not-json": "not json",
    "no-limits": '{"file_descriptors": {}}',
    "a-list": "[1]",
    "infinite": '{"file_descriptors": {"total_limit": 1e400, "sockets_limit": 1}}',
    "deep": "[" * 100_000 + "]" * 100_000,
}


@pytest.mark.parametrize("status", list(UNREADABLE.values()), ids=list(UNREADABLE))
def test_a_status_the_script_cannot_read_is_said_and_the_vhost_still_made(
    tmp_path: Path, status: str
) -> None:
    fake = _fake_rabbitmqctl(tmp_path, status)
    result = run_script("--rabbitmqctl", str(fake), "vhost", "--vhost", "relay")
    assert result.returncode == 0, result.stderr
    assert "could not read the broker's open-files limit" in result.stderr
    assert "ready with 2 policies" in result.stdout


@pytest.mark.parametrize(
    ("vms", "warned"),
    [(5000, None), (9000, None), (10_000, "a fleet of 10,000 VMs needs about 21,024")],
    ids=["5000-vms", "9000-vms", "10000-vms"],
)
def test_the_fleet_size_sets_the_open_files_the_node_needs(
    tmp_path: Path, vms: int, warned: str | None
) -> None:
    """Two files a VM and 1,024 beside: a node that may hold 20,000 serves 9,000 VMs, not
    10,000 (without ``--vms`` it is warned about, below 65,536)."""
    status = {"file_descriptors": {"total_limit": 20_000, "sockets_limit": 17_000}}
    fake = _fake_rabbitmqctl(tmp_path, json.dumps(status))
    result = run_script("--rabbitmqctl", str(fake), "vhost", "--vhost", "relay", "--vms", str(vms))
    assert result.returncode == 0, result.stderr
    if warned is None:
        assert "warning" not in result.stderr
    else:
        assert warned in result.stderr
        assert f"LimitNOFILE={MIN_OPEN_FILES}" in result.stderr  # the usual limit covers it
    unsized = run_script("--rabbitmqctl", str(fake), "vhost", "--vhost", "relay")
    assert "the broker node may hold 20,000 open files" in unsized.stderr


@pytest.mark.parametrize("vms", ["0", "-5", "many", "20000000"])
def test_a_fleet_size_that_is_not_one_is_refused(tmp_path: Path, vms: str) -> None:
    fake = _fake_rabbitmqctl(tmp_path, "{}")
    result = run_script("--rabbitmqctl", str(fake), "vhost", "--vhost", "relay", "--vms", vms)
    assert result.returncode == 2
    assert "argument --vms" in result.stderr
