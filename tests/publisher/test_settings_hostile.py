"""Every flag, variable and file the agent is given is input: a bad one is refused at start-up in
one line naming the setting, exit status 2 (a :class:`ConfigError`), never a traceback, and never
accepted only to end the agent later, at the first event or approval that uses it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from publisher import HookSpec, parse_settings
from schemas import ConfigError


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The agent as a service, with a place to work in memory and IMDS nowhere (the tests here
    are refused before it is asked)."""
    return subprocess.run(
        [sys.executable, "-m", "publisher", "--broker", "memory://t", "--state-dir", "",
         "--imds-first-timeout", "1", "--imds-url", "http://127.0.0.1:9", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip


def _refused_in_one_line(result: subprocess.CompletedProcess[str], named: str) -> None:
    assert result.returncode == 2, result.stderr[-500:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert named in result.stderr


# ------------------------------------------------------------------------------------ hooks


@pytest.mark.parametrize(
    "text",
    [
        'scheduled=/bin/echo "unterminated',
        "scheduled=/bin/echo 'unterminated",
        "scheduled=/bin/echo trailing\\",
        "scheduled=''",  # quoting that leaves no program to run
        "scheduled=/bin/echo a\x00b",  # no program can be given a NUL
    ],
)
def test_a_hook_command_that_cannot_be_run_is_refused_when_parsed(text: str) -> None:
    """Before, only KIND=COMMAND was checked: an unbalanced quote was accepted, and the agent
    died at the hook's first run (shlex.split raised out of the hook runner)."""
    with pytest.raises(ConfigError, match="hook"):
        HookSpec.parse(text)


def test_a_hook_with_an_unbalanced_quote_is_refused_from_a_flag_the_environment_and_toml(
    tmp_path: Path,
) -> None:
    bad = 'scheduled=/bin/echo "x'
    with pytest.raises(ConfigError, match="hook"):
        parse_settings(["--broker", "memory://t", "--hook", bad], {})
    with pytest.raises(ConfigError, match="hook"):
        parse_settings(["--broker", "memory://t"], {"SCHEDULED_EVENTS_HOOKS": bad})
    config = tmp_path / "agent.toml"
    config.write_text("hook = ['scheduled=/bin/echo \"x']\n")  # a TOML literal string
    with pytest.raises(ConfigError, match="hook"):
        parse_settings(["--broker", "memory://t", "--config", str(config)], {})
    # A quoted argument that closes is a command like any other.
    spec = HookSpec.parse("""scheduled=/bin/echo "two words" 'and one'""")
    assert spec.command == """/bin/echo "two words" 'and one'"""


def test_the_agent_refuses_a_hook_with_an_unbalanced_quote_in_one_line() -> None:
    _refused_in_one_line(_cli("--hook", 'scheduled=/bin/echo "x'), "hook")


# ------------------------------------------------------------------- approval max lifetime


@pytest.mark.parametrize("seconds", ["86401", "1e12", "1e14", "1e300"])
def test_an_approval_max_lifetime_beyond_a_day_is_refused(seconds: str) -> None:
    """Before, any finite positive number was taken: from about 2.5e11 s, issued_at plus the
    lifetime lies past year 9999, and the agent's approvals task died (OverflowError) at its
    first approval. An approval answers an event whose notice is minutes: a day is plenty."""
    with pytest.raises(ConfigError, match="approval_max_lifetime"):
        parse_settings(["--broker", "memory://t", "--approval-max-lifetime", seconds], {})


def test_an_approval_max_lifetime_of_up_to_a_day_is_taken() -> None:
    settings = parse_settings(["--broker", "memory://t", "--approval-max-lifetime", "86400"], {})
    assert settings.approval_max_lifetime == 86400.0


def test_the_agent_refuses_a_huge_approval_max_lifetime_in_one_line() -> None:
    _refused_in_one_line(_cli("--approval-max-lifetime", "1e12"), "approval_max_lifetime")
