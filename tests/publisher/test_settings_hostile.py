"""Every flag, variable and file the agent is given is input: a bad one is refused at start-up in
one line naming the setting, exit status 2 (a :class:`ConfigError`), never a traceback, and never
accepted only to end the agent later, at the first event or approval that uses it."""

from __future__ import annotations

import os
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
        # A byte that is not UTF-8 on the command line (Python keeps it as a lone surrogate):
        # taken before, the agent's state store could not save the hook's run at the first
        # transition, and the watcher ended the agent.
        "scheduled=/bin/echo \udcff",
        # A result names its hook's command: one this long could never be published.
        "scheduled=/bin/echo " + "x" * 5000,
    ],
    ids=[
        "unterminated-double",
        "unterminated-single",
        "trailing-escape",
        "empty",
        "nul",
        "not-utf8",
        "too-long",
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


def test_the_agent_refuses_a_hook_that_is_not_utf8_in_one_line() -> None:
    _refused_in_one_line(_cli("--hook", "scheduled=/bin/echo \udcff"), "hook")


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


# ----------------------------------------------------------------------- heartbeat interval


@pytest.mark.parametrize("seconds", ["3601", "86400", "1e300"])
def test_a_heartbeat_interval_beyond_an_hour_is_refused(seconds: str) -> None:
    """The agent declares its interval in its messages, and the contract refuses more than an
    hour (consumers count it live for 2.5 intervals). Before, 1e300 was taken: no heartbeat
    ever, and consumers called the idle VM silent after 150 s."""
    with pytest.raises(ConfigError, match="heartbeat_interval must be at most 3600"):
        parse_settings(["--broker", "memory://t", "--heartbeat-interval", seconds], {})


@pytest.mark.parametrize("seconds", ["0.06", "0.999", "1e-9"])
def test_a_heartbeat_interval_under_a_second_is_refused(seconds: str) -> None:
    """Every heartbeat of every VM goes to every consumer group: 0.06 typed for 60 was taken,
    and each VM sent 16 a second, a thousand times the load, to each of them."""
    with pytest.raises(ConfigError, match="heartbeat_interval must be at least 1 s"):
        parse_settings(["--broker", "memory://t", "--heartbeat-interval", seconds], {})


@pytest.mark.parametrize("seconds", ["1", "3600"])
def test_a_heartbeat_interval_from_a_second_to_an_hour_is_taken(seconds: str) -> None:
    settings = parse_settings(["--broker", "memory://t", "--heartbeat-interval", seconds], {})
    assert settings.heartbeat_interval == float(seconds)


def test_the_agent_refuses_a_heartbeat_interval_beyond_an_hour_in_one_line() -> None:
    _refused_in_one_line(_cli("--heartbeat-interval", "7200"), "heartbeat_interval")


# ------------------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:notaport",
        "http://127.0.0.1:99999",
        "http://127.0.0.1:-1",
        "http://127.0.0.1:0",  # was taken as port 80
        "http://[::1",
        "http://[not-an-address]/",
        "http://127.0.0.1/vm/a b",  # would be sent as is in the request line
        "http://127.0.0.1/vm/web-7\x7f",
        "http://127.0.0.1/vm/wéb",  # cannot go in a request line as is
        "http://127.0.0.1/vm?x=1",  # the agent appends /metadata/...: the query was dropped
        "http://127.0.0.1/vm#x",
    ],
)
def test_an_imds_url_the_agent_cannot_ask_is_refused(url: str) -> None:
    """Before, only the scheme and host were checked: the port was read at the first request
    (a ValueError, a traceback), a URL that was no URL raised inside the check itself."""
    with pytest.raises(ConfigError, match="imds_url"):
        parse_settings(["--broker", "memory://t", "--imds-url", url], {})


def test_an_imds_url_with_a_password_is_refused_without_saying_it() -> None:
    """IMDS asks for no login, and the URL is logged as given at every start."""
    with pytest.raises(ConfigError, match="imds_url") as refused:
        parse_settings(["--broker", "memory://t", "--imds-url", "http://u:s3cret@h/"], {})
    assert "s3cret" not in str(refused.value)


@pytest.mark.parametrize(
    "url", ["http://169.254.169.254", "https://imds.test:8443/vm/web-7/", "http://[::1]:8080/vm/x"]
)
def test_an_imds_url_of_any_usual_form_is_taken(url: str) -> None:
    assert parse_settings(["--broker", "memory://t", "--imds-url", url], {}).imds_url == url


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:notaport", "http://127.0.0.1:99999", "http://[::1"]
)
def test_the_agent_refuses_a_bad_imds_url_in_one_line(url: str) -> None:
    _refused_in_one_line(_cli("--imds-url", url), "imds_url")


@pytest.mark.parametrize(
    "broker",
    [
        "amqp://[::1",  # ValueError out of the settings
        "sb://[::1",
        "memory://[::1",
        "amqp://relay:s3cret@127.0.0.1:notaport/",  # these four: refused only when connecting
        "amqp://relay:s3cret@127.0.0.1:99999/",
        "amqp://relay:s3cret@127.0.0.1/?heartbeat=often",
        "amqp://relay:s3cret@127.0.0.1/?hartbeat=5",
        "sb://contoso:99999",
        "Endpoint=sb://[::1;SharedAccessKeyName=a;SharedAccessKey=s3cret",
        "amqp://relay:s3cret@127.0.0.1\x00:5672/",  # retried for ever
    ],
)
def test_a_broker_address_that_cannot_be_used_is_refused_at_start_up(broker: str) -> None:
    with pytest.raises(ConfigError, match="broker") as refused:
        parse_settings(["--broker", broker], {})
    assert "s3cret" not in str(refused.value)


def test_the_agent_refuses_a_broker_that_is_no_url_in_one_line() -> None:
    _refused_in_one_line(_cli("--broker", "amqp://[::1"), "broker")


@pytest.mark.parametrize("suffix", ["a/b", "x" * 65, "a b", "ä"])
def test_a_channel_suffix_that_is_no_entity_name_is_refused(suffix: str) -> None:
    with pytest.raises(ConfigError, match="channel_suffix"):
        parse_settings(["--broker", "memory://t", "--channel-suffix", suffix], {})


def test_a_metrics_host_with_a_control_character_is_refused() -> None:
    with pytest.raises(ConfigError, match="metrics_host"):
        parse_settings(["--broker", "memory://t", "--metrics-host", "127.0.0.1\x01"], {})


# ------------------------------------------------------------------------------------ files


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfepoll_interval = 1\n", "is not UTF-8"),
        (b"a = " + b"[" * 100_000, "is not valid TOML"),  # deeper than Python recurses
        (b"outbox_limit = " + b"9" * 5000 + b"\n", "is not valid TOML"),  # ValueError
        (b"# " + b"x" * (2 * 1024 * 1024) + b"\n", "larger than"),
    ],
)
def test_a_config_file_that_cannot_be_read_as_toml_is_refused(
    tmp_path: Path, content: bytes, message: str
) -> None:
    """Before, only OSError and TOMLDecodeError were turned into a ConfigError: a file that is
    not UTF-8, nested past the recursion limit or with an integer of more than 4,300 digits
    ended the agent in a traceback."""
    config = tmp_path / "agent.toml"
    config.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as refused:
        parse_settings(["--broker", "memory://t", "--config", str(config)], {})
    assert str(refused.value).startswith(f"config: {config}")


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_a_config_or_broker_file_that_is_not_a_regular_file_is_refused_unread(
    tmp_path: Path, kind: str
) -> None:
    """A FIFO nobody writes to blocked the start for ever; /dev/zero was read until memory ran
    out."""
    path = tmp_path / "file"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="not a regular file"):
        parse_settings(["--broker", "memory://t", "--config", str(path)], {})
    with pytest.raises(ConfigError, match=r"broker_file.*not a regular file"):
        parse_settings(["--broker-file", str(path)], {})


def test_a_broker_file_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "broker"
    secret.write_bytes(b"amqp://relay:s3cret\xff@rabbit/\n")
    with pytest.raises(ConfigError, match=r"broker_file.*not UTF-8") as refused:
        parse_settings(["--broker-file", str(secret)], {})
    assert "s3cret" not in str(refused.value)


@pytest.mark.parametrize("setting", ["state_dir", "trust_keys", "broker_file", "config"])
def test_a_file_name_with_a_nul_is_refused(tmp_path: Path, setting: str) -> None:
    """Only a TOML file can give one (flags and the environment cannot hold a NUL); the state
    dir's raised ValueError when the store was opened."""
    config = tmp_path / "agent.toml"
    config.write_text(f'{setting} = "{tmp_path}/a\\u0000b"\nbroker = "memory://t"\n')
    if setting == "config":
        config.write_text(f'broker_file = "{tmp_path}/a\\u0000b"\n')
        setting = "broker_file"
    if setting == "broker_file":
        config.write_text(config.read_text().replace('broker = "memory://t"\n', ""))
    with pytest.raises(ConfigError, match=setting):
        parse_settings(["--config", str(config)], {})


def test_the_agent_refuses_a_config_file_that_is_not_utf8_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_bytes(b"\xff\xfepoll_interval = 1\n")
    _refused_in_one_line(_cli("--config", str(config)), "config")
