"""The cloud-init snippet that installs and starts the agent on a plain VM: valid cloud-config
(``cloud-init schema``, where cloud-init is installed: Debian's ``cloud-init`` package), the
unit it installs is deploy/systemd's, the broker secret is readable by root only."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ._paths import CLOUD_INIT, SYSTEMD

SNIPPET = CLOUD_INIT / "agent.yaml"


def _document() -> dict[str, Any]:
    return yaml.safe_load(SNIPPET.read_text())


def _schema(path: Path) -> subprocess.CompletedProcess[str]:
    cloud_init = shutil.which("cloud-init")
    if cloud_init is None:
        missing = "cloud-init is not installed (Debian: apt-get install cloud-init)"
        if os.environ.get("CI"):  # .ci/run installs it: the snippet is checked there for sure
            pytest.fail(f"CI needs cloud-init: {missing}", pytrace=False)
        pytest.skip(missing)
    return subprocess.run(
        [cloud_init, "schema", "--config-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_it_is_valid_cloud_config():
    assert SNIPPET.read_text().startswith("#cloud-config\n")
    result = _schema(SNIPPET)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Valid cloud-config" in result.stdout


def test_the_validator_catches_a_broken_one(tmp_path: Path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("#cloud-config\npackages: 5\nwrite_files: [{permissions: 600}]\n")
    assert _schema(broken).returncode != 0


def test_it_installs_the_unit_of_deploy_systemd_and_starts_it():
    files = {f["path"]: f for f in _document()["write_files"]}
    unit = files["/etc/systemd/system/scheduled-events-agent.service"]
    assert unit["content"] == (SYSTEMD / "scheduled-events-agent.service").read_text()
    # The secret: root only; the unit hands it to the agent as a credential.
    assert files["/etc/scheduled-events/broker"]["permissions"] == "0600"
    assert "LoadCredential=broker:/etc/scheduled-events/broker" in unit["content"]
    assert "/etc/scheduled-events/approver.pub" in files
    commands = [" ".join(map(str, c)) for c in _document()["runcmd"]]
    assert "python3 -m venv /opt/scheduled-events-relay" in commands
    assert any(c.startswith("/opt/scheduled-events-relay/bin/pip install") for c in commands)
    assert commands[-1] == "systemctl enable --now scheduled-events-agent.service"
