"""The central commands' flags are input too: a value out of range (a port, a number of
seconds, nan or inf) or a secret file that is not text ends in one line saying what is wrong and
exit status 2, as every other flag error, before anything is set up; never a traceback."""

from __future__ import annotations

import pytest

from ._refusal import refused


@pytest.mark.parametrize("port", ["70000", "65536", "-1", "http", "nan"])
def test_a_health_port_outside_0_to_65535_is_refused_before_anything_is_set_up(
    tmp_path, capsys, port
):
    """Before, --health-port 70000 was taken, the service set up (broker, database), and
    bind() then raised OverflowError: a traceback."""
    err = refused(capsys, ["audit", "--broker", "memory://x", "--db", str(tmp_path / "a.db"),
                            "--health-port", port])  # fmt: skip
    assert f"argument --health-port: {port!r} is not a port (0 to 65535)" in err
    assert not (tmp_path / "a.db").exists()


def test_a_health_port_from_the_environment_is_checked_the_same(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SCHEDULED_EVENTS_HEALTH_PORT", "70000")
    err = refused(capsys, ["audit", "--broker", "memory://x", "--db", str(tmp_path / "a.db")])
    assert "argument --health-port: '70000' is not a port" in err


@pytest.mark.parametrize("grace", ["nan", "inf", "-inf", "0", "-3", "soon"])
def test_a_health_grace_must_be_a_finite_number_of_seconds_above_0(tmp_path, capsys, grace):
    """nan was refused; inf was taken (the service then never reported itself unhealthy)."""
    err = refused(capsys, ["audit", "--broker", "memory://x", "--db", str(tmp_path / "a.db"),
                            "--health-grace", grace])  # fmt: skip
    assert "argument --health-grace: " in err


@pytest.mark.parametrize("timeout", ["nan", "inf", "0", "-1", "1e400", "soon"])
def test_the_approve_timeout_must_be_a_finite_number_of_seconds_above_0(tmp_path, capsys, timeout):
    """Before, --timeout took any float: nan, inf or a negative reached asyncio.timeout after
    the approval was sent."""
    err = refused(capsys, ["approve", "8EE31A01-6A5F-4C1E-8E5A-7C2F0D1B9A33", "--vm", "web-1",
                            "--broker", "memory://x", "--signing-key", "k",
                            "--event-version", "a" * 32, "--timeout", timeout])  # fmt: skip
    assert "argument --timeout: " in err


@pytest.mark.parametrize("speed", ["nan", "inf", "0", "-60", "fast"])
def test_the_demo_speed_must_be_a_finite_number_above_0(capsys, speed):
    err = refused(capsys, ["demo", "--speed", speed])
    assert "argument --speed: " in err


@pytest.mark.parametrize("flag", ["--broker-file", "--db-file"])
def test_a_secret_file_that_is_not_utf8_is_refused_in_one_line(tmp_path, capsys, flag):
    """Before, a --broker-file or --db-file that was not UTF-8 raised UnicodeDecodeError."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"amqp://\xff\xfe@host/\n")
    argv = ["migrate", "--db-file", str(secret)]
    if flag == "--broker-file":
        argv = ["tail", "--broker-file", str(secret)]
    err = refused(capsys, argv)
    assert err.startswith(f"scheduled-events: {flag}: {secret} is not UTF-8")
