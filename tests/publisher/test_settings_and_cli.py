"""Settings: flags > environment > TOML > defaults; a bad setting stops the agent at start with
a message naming it (exit code 2); --help lists the settings."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import publisher
from publisher import AgentSettings, HookSpec, parse_settings
from schemas import ConfigError
from schemas.transitions import TransitionKind


def test_flags_beat_environment_beat_toml(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        'poll_interval = 3.0\nbroker = "memory://toml"\nall-events = true\nlog_format = "json"\n'
    )
    env = {
        "SCHEDULED_EVENTS_CONFIG": str(config),
        "SCHEDULED_EVENTS_POLL_INTERVAL": "2",
        "SCHEDULED_EVENTS_BROKER": "memory://env",
    }
    settings = parse_settings(["--broker", "memory://flag"], env)
    assert settings.broker == "memory://flag"
    assert settings.poll_interval == 2.0
    assert settings.all_events is True
    assert settings.log_format == "json"
    assert settings.imds_url == "http://169.254.169.254"


def test_repeatable_flags_and_channel_suffix(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pub", tmp_path / "b.pub"
    a.write_text("x")
    b.write_text("y")
    settings = parse_settings(
        [
            "--trust-key", str(a), "--trust-key", str(b),
            "--hook", "started,scheduled=/bin/echo hi",
            "--channel-suffix", "t1",
            "--state-dir", str(tmp_path),
            "--broker", "memory://t",
        ],
        {},
    )  # fmt: skip
    assert settings.trust_keys == (a, b)
    assert settings.hooks == (
        HookSpec(frozenset({TransitionKind.STARTED, TransitionKind.SCHEDULED}), "/bin/echo hi"),
    )
    assert settings.channels.events_exchange == "scheduled-events-t1"
    assert settings.state_dir == tmp_path


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--poll-interval", "fast"], {}, "poll_interval"),
        (["--poll-interval", "-1"], {}, "poll_interval"),
        ([], {"SCHEDULED_EVENTS_IMDS_URL": "ftp://x"}, "imds_url"),
        (["--broker", "kafka://x"], {}, "broker"),
        (["--log-format", "xml"], {}, "log_format"),
        (["--imds-max-rps", "9"], {}, "imds_max_rps"),
        (["--trust-key", "/nonexistent.pub"], {}, "trust_keys"),
        (["--hook", "rebooted=/bin/true"], {}, "hook"),
        (["--api-version", "2015-01-01"], {}, "api_version"),
        ([], {"SCHEDULED_EVENTS_DRY_RUN": "perhaps"}, "dry_run"),
    ],
)
def test_an_invalid_setting_is_named(argv: list[str], env: dict[str, str], named: str) -> None:
    if "--broker" not in argv:
        argv = [*argv, "--broker", "memory://t"]
    with pytest.raises(ConfigError, match=named):
        parse_settings(argv, env)


def test_there_is_no_default_broker_and_a_secret_may_come_from_a_file(tmp_path: Path) -> None:
    """A publish on memory:// with nobody listening is lost: the agent never picks it alone."""
    with pytest.raises(ConfigError, match="--broker"):
        parse_settings([], {})
    secret = tmp_path / "broker"
    secret.write_text("amqp://vm1:s3cret@rabbit/prod\n")
    assert (
        parse_settings(["--broker-file", str(secret)], {}).broker == "amqp://vm1:s3cret@rabbit/prod"
    )
    with pytest.raises(ConfigError, match="not both"):
        parse_settings(["--broker-file", str(secret), "--broker", "memory://x"], {})
    with pytest.raises(ConfigError, match="broker_file"):
        parse_settings(["--broker-file", str(tmp_path / "missing")], {})


def test_trust_keys_and_unsigned_approvals_are_refused_together(tmp_path: Path) -> None:
    key = tmp_path / "a.pub"
    key.write_text("x")
    with pytest.raises(ConfigError, match="accept_unsigned_approvals"):
        parse_settings(
            ["--broker", "memory://t", "--trust-key", str(key), "--accept-unsigned-approvals"], {}
        )


def test_an_unknown_toml_key_is_named(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text("pol_interval = 1\n")
    with pytest.raises(ConfigError, match="pol_interval"):
        parse_settings(["--config", str(config)], {})


def test_the_summary_hides_the_broker_password() -> None:
    settings = AgentSettings(broker="amqp://relay:s3cret@rabbit:5672/", state_dir=None)
    summary = settings.summary()
    assert "s3cret" not in str(summary)
    assert summary["broker"] == "amqp://relay:***@rabbit:5672/"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "publisher", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
    )


def test_cli_help_lists_the_settings() -> None:
    result = _cli("--help")
    assert result.returncode == 0
    for flag in (
        "--imds-url", "--broker", "--state-dir", "--poll-interval", "--trust-key",
        "--accept-unsigned-approvals", "--dry-run", "--all-events", "--metrics-port",
        "--log-format", "--config", "SCHEDULED_EVENTS_",
    ):  # fmt: skip
        assert flag in result.stdout


def test_cli_invalid_setting_exits_2_with_one_line() -> None:
    result = _cli("--poll-interval", "0", "--broker", "memory://t")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "poll_interval" in result.stderr
    result = _cli()
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "--broker" in result.stderr


@pytest.mark.parametrize("where", ["file", "unwritable", "proc"])
def test_a_state_dir_the_agent_cannot_use_is_one_line_and_exit_2(
    tmp_path: Path, where: str
) -> None:
    prefix: list[str] = []
    if where == "file":
        state = tmp_path / "a-file"
        state.write_text("")
        expected = "is a file"
    elif where == "unwritable":
        # A state dir inside a directory nobody may write to. Root writes anywhere, so as root
        # the agent runs without the capabilities that override file permissions, as a
        # hardened unit would (and stays root: it can still read a clone in a private
        # directory, which another user could not).
        parent = tmp_path / "read-only"
        parent.mkdir(mode=0o555)
        state = parent / "state"
        if os.getuid() == 0:
            if not shutil.which("setpriv"):
                pytest.skip("running as root without setpriv: cannot drop the override")
            prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
        expected = "Permission denied"
    else:
        state = Path("/proc/self/agent-state")
        expected = "kernel file system"
    result = subprocess.run(
        [
            *prefix, sys.executable, "-m", "publisher", "--broker", "memory://t",
            "--state-dir", str(state), "--imds-url", "http://127.0.0.1:9",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "state_dir" in result.stderr
    assert expected in result.stderr


def test_the_package_exports_what_it_lists() -> None:
    for name in publisher.__all__:
        assert hasattr(publisher, name), name
    public = {n for n in dir(publisher) if not n.startswith("_")}
    assert public - {"simulator"} <= set(publisher.__all__)
