"""The users file (PBKDF2 hashes in Django's format), sessions (signed cookies) and the brake
on guessing passwords."""

from __future__ import annotations

import base64
import hashlib
import io
import time

import pytest

from consumers.__main__ import main
from consumers.console._sessions import SessionCodec, SignInBrake, Throttle, load_session_key
from consumers.console._users import Role, UsersFile, hash_password, verify_password, write_user
from schemas import ConfigError


def test_the_hash_is_django_pbkdf2_sha256_and_verifies_in_constant_time():
    stored = hash_password("correct horse", iterations=1000)
    algorithm, iterations, salt, digest = stored.split("$")
    assert (algorithm, iterations) == ("pbkdf2_sha256", "1000")
    expected = hashlib.pbkdf2_hmac("sha256", b"correct horse", salt.encode(), 1000)
    assert base64.b64decode(digest) == expected
    assert verify_password("correct horse", stored)
    assert not verify_password("correct horsE", stored)
    assert not verify_password("x", "-")
    assert not verify_password("x", "md5$1$a$b")
    assert hash_password("same", iterations=1000) != hash_password("same", iterations=1000)


def test_the_users_file_roles_and_proxy_only_users(tmp_path):
    path = tmp_path / "users"
    assert write_user(path, "alice", Role.OPERATOR, "alice-password", iterations=1000) is False
    write_user(path, "bob", Role.VIEWER, "bob-password", iterations=1000)
    write_user(path, "carol@example.com", Role.OPERATOR, None)
    assert path.stat().st_mode & 0o777 == 0o600
    lines = path.read_text().splitlines()
    assert lines[0].startswith("#")
    assert lines[3] == "carol@example.com:operator:-"
    users = UsersFile(path)
    assert len(users) == 3
    alice = users.check("ALICE", "alice-password")  # names are case-insensitive
    assert alice is not None
    assert alice.role is Role.OPERATOR
    assert users.check("alice", "bob-password") is None
    assert users.check("nobody", "alice-password") is None
    assert users.check("carol@example.com", "") is None  # no password: proxy only
    carol = users.get("carol@example.com")
    assert carol is not None
    assert carol.role is Role.OPERATOR
    # Replaced in place; the file is read again when it changes.
    assert write_user(path, "alice", Role.VIEWER, "new-password", iterations=1000) is True
    changed = users.check("alice", "new-password")
    assert changed is not None
    assert changed.role is Role.VIEWER
    assert users.check("alice", "alice-password") is None


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("alice", "expected NAME:ROLE:HASH"),
        ("alice:admin:-", "is not operator or viewer"),
        ("alice:viewer:plain-text-password", "is not pbkdf2_sha256"),
        ("ali\x1b[2Kce:viewer:-", "control character"),
    ],
)
def test_a_bad_users_file_says_which_line(tmp_path, line, said):
    path = tmp_path / "users"
    path.write_text(f"# users\n{line}\n")
    with pytest.raises(ConfigError, match=rf"{path}:2: .*{said}"):
        UsersFile(path)


def test_console_user_reads_the_password_from_stdin(tmp_path, monkeypatch, capsys):
    path = tmp_path / "users"
    monkeypatch.setattr("sys.stdin", io.StringIO("s3cret-enough\n"))
    argv = ["console-user", str(path), "alice", "--role", "operator", "--iterations", "1000"]
    assert main(argv) == 0
    assert "added alice (operator, password set)" in capsys.readouterr().out
    assert UsersFile(path).check("alice", "s3cret-enough") is not None
    monkeypatch.setattr("sys.stdin", io.StringIO("short\n"))
    assert main(["console-user", str(path), "bob"]) == 2
    assert "at least 8 characters" in capsys.readouterr().err
    assert main(["console-user", str(path), "dan:x", "--no-password"]) == 2
    assert "no colon" in capsys.readouterr().err
    assert main(["console-user", str(path), "carol", "--no-password"]) == 0
    carol = UsersFile(path).get("carol")
    assert carol is not None
    assert carol.role is Role.VIEWER


def test_a_session_cookie_is_signed_and_expires():
    codec = SessionCodec(b"a" * 32, lifetime=60)
    session, cookie = codec.issue("alice", Role.OPERATOR, "password")
    assert codec.read(cookie) == session
    version, payload, mac = cookie.split(".")
    forged_payload = payload[:-2] + ("AA" if payload[-2:] != "AA" else "BB")
    assert codec.read(f"{version}.{forged_payload}.{mac}") is None
    assert codec.read(cookie + "x") is None
    assert codec.read("v1.e30.AAAA") is None
    assert SessionCodec(b"b" * 32).read(cookie) is None  # another key
    codec.revoke(session)
    assert codec.read(cookie) is None
    expired = SessionCodec(b"a" * 32, lifetime=-1)
    assert expired.read(expired.issue("alice", Role.OPERATOR, "password")[1]) is None
    assert session.operator_name == "alice"
    shared, _ = codec.issue("bob", Role.OPERATOR, "token")
    assert shared.operator_name == "bob (shared token)"


def test_the_session_key_file(tmp_path):
    assert len(load_session_key(None)) == 32
    short = tmp_path / "short"
    short.write_text("tiny")
    with pytest.raises(ConfigError, match="too short"):
        load_session_key(short)
    good = tmp_path / "key"
    good.write_text("x" * 44 + "\n")
    assert load_session_key(good) == b"x" * 44


def test_the_throttle_brakes_after_repeated_failures():
    throttle = Throttle(limit=3, window=0.3)
    for _ in range(3):
        assert throttle.retry_after("ip:1", "name:alice") == 0
        throttle.failed("ip:1", "name:alice")
    assert throttle.retry_after("ip:1") > 0
    assert throttle.retry_after("name:alice") > 0
    assert throttle.retry_after("ip:2", "name:bob") == 0
    time.sleep(0.35)
    assert throttle.retry_after("ip:1", "name:alice") == 0
    throttle.failed("ip:1")
    throttle.succeeded("ip:1")
    assert throttle.retry_after("ip:1") == 0


def test_an_absurd_iteration_count_is_refused_with_its_line(tmp_path, capsys):
    """Every sign-in of an unknown name costs as many PBKDF2 rounds as the costliest user: one
    line of 2,000,000,000 rounds (a typo, or a hostile file) would pin a thread for half an
    hour per anonymous attempt. The file is refused at start, naming the line; console-user
    does not write one."""
    key = base64.b64encode(b"\0" * 32).decode()
    path = tmp_path / "users"
    path.write_text(f"# users\nbob:viewer:pbkdf2_sha256$2000000000$somesalt${key}\n")
    with pytest.raises(ConfigError, match=rf"{path}:2: .*2,000,000,000 PBKDF2 iterations"):
        UsersFile(path)
    assert not verify_password("x", f"pbkdf2_sha256$2000000000$somesalt${key}")
    argv = ["console-user", str(tmp_path / "other"), "carol", "--iterations", "20000000"]
    assert main([*argv, "--no-password"]) == 2
    assert "--iterations 20000000: from 1 to 10,000,000" in capsys.readouterr().err


def test_sign_outs_are_remembered_in_bounded_memory_and_stay_signed_out():
    """Every sign-out is remembered until the session would have expired. Behind the OIDC
    proxy a mere viewer makes a session per request and signs it out, in a loop: what the
    console remembers stays bounded (per user, and in all), and no session signed out ever
    holds again; when a bound is reached the oldest sessions of that user (or, past the bound
    on users, everybody's oldest) are signed out with them, never one let back in."""
    codec = SessionCodec(b"a" * 32, max_per_user=8, max_users=50)
    _, alice_cookie = codec.issue("alice", Role.OPERATOR, "password")
    mallory = [codec.issue("mallory", Role.VIEWER, "proxy") for _ in range(3000)]
    for session, _ in mallory:
        codec.revoke(session)
    assert codec.remembered() <= 8 + 1
    assert all(codec.read(cookie) is None for _, cookie in mallory)
    assert codec.read(alice_cookie) is not None  # another user's session is untouched
    fresh, fresh_cookie = codec.issue("mallory", Role.VIEWER, "proxy")
    assert codec.read(fresh_cookie) == fresh  # signing out again and again locks nobody out
    # A name per sign-out (a shared token lets anyone pick one): bounded in all too.
    names = [codec.issue(f"ops-{n}", Role.OPERATOR, "token") for n in range(500)]
    for session, _ in names:
        codec.revoke(session)
    assert codec.remembered() <= 50 * (8 + 1)
    assert all(codec.read(cookie) is None for _, cookie in names)
    later, later_cookie = codec.issue("bob", Role.OPERATOR, "password")
    assert codec.read(later_cookie) == later


def test_the_brake_counts_an_ipv6_client_by_its_64():
    """A site hands out IPv6 addresses from its /64 freely: a new address per guess is still
    the same client."""
    brake = SignInBrake(per_name=2, per_address=3)
    for n in range(3):
        brake.attempt(f"2001:db8::{n + 1}", f"user-{n}")
    assert brake.retry_after("2001:db8::ffff", "someone") > 0
    assert brake.retry_after("2001:db8:0:1::1", "someone") == 0
    assert brake.retry_after("192.0.2.1", "someone") == 0
    assert brake.delay("user-0") == 0
