"""Every mistake a new user makes gets one line saying what and what to do, and exit 2 — never a
traceback. Each command runs as the user runs it: a subprocess of the installed entry points."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _run(
    *argv: str, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **(env or {})},
    )


def _one_line(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_keygen_into_a_place_it_cannot_write(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("")
    _one_line(_run("-m", "consumers", "keygen", "--out", str(target / "keys")), "keygen", "cannot")


def test_audit_history_of_a_directory_or_a_missing_database(tmp_path: Path) -> None:
    _one_line(
        _run("-m", "consumers", "audit", "history", "--db", "/tmp/", "--vm", "a"),
        "not a database file",
    )
    missing = tmp_path / "typo.db"
    _one_line(
        _run("-m", "consumers", "audit", "history", "--db", str(missing), "--vm", "a"),
        "no database",
    )
    assert not missing.exists()  # reading never creates one


def test_tail_with_a_type_that_does_not_exist() -> None:
    _one_line(
        _run("-m", "consumers", "tail", "--broker", "memory://x", "--type", "bogus"),
        "bogus",
        "scheduled",
    )


def test_approve_with_an_event_id_that_is_not_one(tmp_path: Path) -> None:
    _one_line(
        _run(
            "-m", "consumers", "approve", "not-a-guid", "--vm", "web-7",
            "--broker", "memory://x", "--signing-key", str(tmp_path / "k"),
        ),
        "not an EventId",
    )  # fmt: skip


def test_a_policy_naming_an_event_type_that_does_not_exist(tmp_path: Path) -> None:
    from consumers import load_policy_file
    from schemas import ConfigError

    policy = tmp_path / "policy.toml"
    policy.write_text('[never]\nevent_types = ["Terminat"]\n')
    with pytest.raises(ConfigError, match=r"'Terminat' is not an EventType.*Terminate"):
        load_policy_file(policy)
    policy.write_text('[never]\nevent_types = ["terminate"]\nunknown_event_types = ["Hibernate"]\n')
    vetoes = load_policy_file(policy)
    assert vetoes.policies  # case does not matter; a deliberate unknown type is taken


def test_the_agent_with_an_imds_url_that_answers_404(tmp_path: Path) -> None:
    """The simulator is served in a child process; the agent is pointed at a path it lacks."""
    server = subprocess.Popen(
        [sys.executable, "-m", "publisher.simulator", "--port", "0", "--vm", "web-7"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    try:
        assert server.stdout is not None
        url = ""
        for _ in range(50):
            line = server.stdout.readline()
            if line.startswith("listening on http://"):
                url = line.split()[-1] + "/vm/web-7"
                break
        assert url, "the simulator did not say where it listens"
        result = _run(
            "-m", "publisher", "--broker", "memory://x", "--state-dir", str(tmp_path),
            "--imds-url", f"{url}/nowhere", "--imds-first-timeout", "5",
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(10)
        if server.stdout is not None:
            server.stdout.close()
    _one_line(result, "imds_url", "404", "check --imds-url")


def _without(tmp_path: Path, *modules: str) -> dict[str, str]:
    """An environment in which ``modules`` cannot be imported, as when an extra is missing."""
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in modules)
    (tmp_path / "sitecustomize.py").write_text(f"import sys; {blocked}" + "\n")
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}


def test_export_check_without_the_dev_extra(tmp_path: Path) -> None:
    result = _run("-m", "schemas", "export", "--check", env=_without(tmp_path, "yaml"))
    _one_line(result, "[dev]")


def test_the_demo_without_the_simulator_extra(tmp_path: Path) -> None:
    result = _run("-m", "consumers", "demo", env=_without(tmp_path, "starlette", "uvicorn"))
    _one_line(result, "[simulator]")
