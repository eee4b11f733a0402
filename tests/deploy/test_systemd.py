"""The systemd units: each one passes ``systemd-analyze verify``, and the agent's sandbox rates
at most 2.0 in ``systemd-analyze security`` (where systemd-analyze is installed; skipped with
the reason elsewhere).

``verify`` checks the unit against an alternate root (``--root``): a copy of this machine's
system units (so ``multi-user.target`` and friends resolve) plus an executable stub where the
unit's ``ExecStart`` points, because ``verify`` also checks that the command exists and the
real one is installed by pip on the target VM, not here. ``verify`` exits 0 on a setting it
ignores ("Failed to parse ..., ignoring"), so the tests also require it to print nothing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ._paths import SYSTEMD

UNITS = sorted(SYSTEMD.glob("*.service"))
AGENT = SYSTEMD / "scheduled-events-agent.service"
MAX_EXPOSURE = 2.0
_SYSTEM_UNITS = (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))


def _systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    return found


def _settings(unit: Path) -> dict[str, list[str]]:
    """The unit's settings, continuation lines joined (enough for these units)."""
    text = unit.read_text().replace("\\\n", " ")
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        settings.setdefault(key.strip(), []).append(" ".join(value.split()))
    return settings


def test_the_three_units_are_there():
    assert [unit.name for unit in UNITS] == [
        "scheduled-events-agent.service",
        "scheduled-events-approver.service",
        "scheduled-events-audit.service",
    ]


@pytest.mark.parametrize("unit", UNITS, ids=lambda unit: unit.stem)
def test_unit_verifies(unit: Path, tmp_path: Path):
    analyze = _systemd_analyze()
    system_units = next((p for p in _SYSTEM_UNITS if p.is_dir()), None)
    if system_units is None:
        pytest.skip("no system unit directory to verify against")
    root = tmp_path / "root"
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copy(unit, root / "etc/systemd/system" / unit.name)
    for command in _settings(unit)["ExecStart"]:
        executable = root / command.split()[0].lstrip("-@:+!").lstrip("/")
        executable.parent.mkdir(parents=True, exist_ok=True)
        executable.write_text("#!/bin/sh\n")
        executable.chmod(0o755)

    result = subprocess.run(
        [analyze, "verify", "--man=no", f"--root={root}", unit.name],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout + result.stderr == "", "verify complained:\n" + result.stderr


def _exposure(unit: Path) -> float:
    analyze = _systemd_analyze()
    result = subprocess.run(
        [analyze, "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert found, result.stdout + result.stderr
    return float(found.group(1))


def test_agent_security_exposure_is_at_most_2():
    exposure = _exposure(AGENT)
    print(f"systemd-analyze security --offline=true {AGENT.name}: {exposure}")
    assert exposure <= MAX_EXPOSURE


@pytest.mark.parametrize("unit", UNITS[1:], ids=lambda unit: unit.stem)
def test_central_units_are_as_tight_as_the_agent(unit: Path):
    assert _exposure(unit) <= MAX_EXPOSURE


@pytest.mark.parametrize("unit", UNITS, ids=lambda unit: unit.stem)
def test_unit_has_the_required_protections(unit: Path):
    settings = _settings(unit)
    one = {key: values[-1] for key, values in settings.items()}
    assert one["DynamicUser"] == "yes"
    assert one["ProtectSystem"] == "strict"
    assert one["NoNewPrivileges"] == "yes"
    assert set(one["RestrictAddressFamilies"].split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}
    assert one["Restart"] == "on-failure"
    assert one["RestartPreventExitStatus"] == "2"  # a bad configuration does not loop
    # Secrets arrive as credentials: every file flag points into the credentials directory,
    # and no secret sits in the environment.
    exec_start = one["ExecStart"]
    for flag in ("--broker-file", "--signing-key", "--db-file", "--trust-key"):
        for value in re.findall(rf"{flag} (\S+)", exec_start):
            assert value.startswith("%d/"), f"{flag} {value} is not a credential"
    credentials = {value.split(":")[0] for value in settings["LoadCredential"]}
    assert "broker" in credentials
    assert "--broker " not in exec_start
    assert not any(
        "BROKER" in value or "PASSWORD" in value for value in settings.get("Environment", [])
    )


def test_agent_keeps_state_and_drains_before_it_is_killed():
    one = {key: values[-1] for key, values in _settings(AGENT).items()}
    assert one["StateDirectory"] == "scheduled-events-agent"
    assert "--state-dir %S/scheduled-events-agent" in one["ExecStart"]
    assert {"broker", "approver.pub"} <= {
        value.split(":")[0] for value in _settings(AGENT)["LoadCredential"]
    }
    # The agent drains its outbox for up to 10 s on SIGTERM (its default drain timeout).
    assert one["KillSignal"] == "SIGTERM"
    assert _seconds(one["TimeoutStopSec"]) >= 10 + 10
    assert "--metrics-port 9464" in one["ExecStart"]


def _seconds(span: str) -> float:
    found = re.fullmatch(r"(\d+)(s|min)?", span)
    assert found, span
    return float(found.group(1)) * (60 if found.group(2) == "min" else 1)
