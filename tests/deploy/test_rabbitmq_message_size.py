"""`relay_rabbitmq.py vhost` warns when the broker accepts messages far larger than the relay's.

A consumer holds up to its prefetch of messages in memory before it can refuse one over the
contract's 256 KiB, and RabbitMQ's default ``max_message_size`` is 128 MiB (3.x): a hostile VM
could make the approver buffer gigabytes. The limit is a node setting (``rabbitmq.conf``), which
the script cannot set for one vhost: it says what to set.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from ._rabbitmq import rabbitmqctl_or_skip, run_script, vhost_command_on_the_broker

LIMIT = 512 * 1024


@pytest.mark.rabbitmq
def test_the_vhost_command_names_the_setting_when_the_broker_accepts_huge_messages() -> None:
    ctl = rabbitmqctl_or_skip()
    answer = subprocess.run(
        [ctl, "eval", "application:get_env(rabbit, max_message_size)."],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    found = re.fullmatch(r"\{ok,\s*(\d+)\}", answer)
    if found and int(found.group(1)) <= LIMIT:
        pytest.skip(f"this broker already refuses messages over {LIMIT} bytes ({answer})")
    result = vhost_command_on_the_broker(ctl)
    assert result.returncode == 0, result.stderr
    assert f"set `max_message_size = {LIMIT}` in rabbitmq.conf" in result.stderr
    assert "ready with 2 policies" in result.stdout


def test_no_warning_when_the_broker_refuses_large_messages(tmp_path: Path) -> None:
    # A stand-in for rabbitmqctl (no real node can be reconfigured here: the broker is shared
    # with every other test): it accepts every call, and answers the setting with 512 KiB.
    fake = tmp_path / "rabbitmqctl"
    fake.write_text(
        '#!/bin/sh\nif [ "$1" = eval ]; then echo "{ok,524288}"; fi\nexit 0\n', encoding="utf-8"
    )
    fake.chmod(0o755)
    result = run_script("--rabbitmqctl", str(fake), "vhost", "--vhost", "relay")
    assert result.returncode == 0, result.stderr
    assert "max_message_size" not in result.stderr
    assert "ready with 2 policies" in result.stdout
