"""Settings: flags > environment > TOML > defaults; a bad setting stops the agent at start with
a message naming it (exit code 2); --help lists the settings."""

from __future__ import annotations

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
        "SE_RELAY_CONFIG": str(config),
        "SE_RELAY_POLL_INTERVAL": "2",
        "SE_RELAY_BROKER": "memory://env",
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
        ([], {"SE_RELAY_IMDS_URL": "ftp://x"}, "imds_url"),
        (["--broker", "kafka://x"], {}, "broker"),
        (["--log-format", "xml"], {}, "log_format"),
        (["--imds-max-rps", "9"], {}, "imds_max_rps"),
        (["--trust-key", "/nonexistent.pub"], {}, "trust_keys"),
        (["--hook", "rebooted=/bin/true"], {}, "hook"),
        (["--api-version", "2015-01-01"], {}, "api_version"),
        ([], {"SE_RELAY_DRY_RUN": "perhaps"}, "dry_run"),
    ],
)
def test_an_invalid_setting_is_named(argv: list[str], env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        parse_settings(argv, env)


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
        "--log-format", "--config", "SE_RELAY_",
    ):  # fmt: skip
        assert flag in result.stdout


def test_cli_invalid_setting_exits_2_with_one_line() -> None:
    result = _cli("--poll-interval", "0")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "poll_interval" in result.stderr


def test_the_package_exports_what_it_lists() -> None:
    for name in publisher.__all__:
        assert hasattr(publisher, name), name
    public = {n for n in dir(publisher) if not n.startswith("_")}
    assert public - {"simulator"} <= set(publisher.__all__)
