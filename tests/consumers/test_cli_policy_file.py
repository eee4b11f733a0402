"""A policy file is input too: one that cannot be read as a policy stops `approver --policy`
at start with one line saying why and exit status 2, never a traceback."""

from __future__ import annotations

import pytest

from consumers._cli import main
from consumers._policies import load_policy_file
from schemas import ConfigError

from ._refusal import refused

NOT_UTF8 = b"\xff\xfe[never]\n"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (NOT_UTF8, "is not UTF-8"),
        (b"a = " + b"[" * 100_000, "is not valid TOML"),  # nested past Python's recursion
        (b"[approve.freeze]\nmax_duration_seconds = " + b"9" * 5000, "is not valid TOML"),
    ],
)
def test_a_policy_file_that_cannot_be_read_as_toml_is_a_config_error(tmp_path, content, message):
    """Before, only OSError and TOMLDecodeError became a ConfigError: a file that is not UTF-8
    (UnicodeDecodeError), nested deeper than Python recurses (RecursionError) or with an
    integer of more than 4,300 digits (ValueError) ended `approver --policy` in a traceback."""
    path = tmp_path / "policy.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as refused:
        load_policy_file(path)
    assert str(path) in str(refused.value)


def test_a_policy_file_far_larger_than_any_policy_is_refused_unread(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_bytes(b"# " + b"x" * (2 * 1024 * 1024) + b"\n")
    with pytest.raises(ConfigError, match="larger than"):
        load_policy_file(path)


def test_the_approver_refuses_a_policy_file_that_is_not_utf8_in_one_line(tmp_path, capsys):
    assert main(["keygen", "--out", str(tmp_path / "keys")]) == 0
    path = tmp_path / "policy.toml"
    path.write_bytes(NOT_UTF8)
    key = str(tmp_path / "keys" / "approver.key")
    err = refused(capsys, ["approver", "--broker", "memory://x", "--signing-key", key,
                            "--policy", str(path)])  # fmt: skip
    assert err.startswith(f"scheduled-events: {path} is not UTF-8")
    assert err.count("\n") == 1
