"""`relay_rabbitmq.py` reads rabbitmqctl's JSON listings (vhosts, users, permissions) to decide
what to do: an answer it cannot read is said, with the command that gave it, and the script
stops with exit 1 before it creates or changes a user, never with a traceback.

rabbitmqctl is a stand-in here (a shell script): the shared broker's answers are well formed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ._rabbitmq import run_script, stand_in_rabbitmqctl

#: What a broken, mismatched or hostile rabbitmqctl may print for a listing.
UNREADABLE = {
    "not-json": "Listing vhosts ...\nrelay\n",
    "an-object": '{"name": "relay"}',
    "not-objects": '["relay", 1]',
    "cut-short": '[{"name": "rel',
    "deep": "[" * 100_000 + "]" * 100_000,
}


@pytest.mark.parametrize("listing", ["list_vhosts", "list_users"])
@pytest.mark.parametrize("answer", list(UNREADABLE.values()), ids=list(UNREADABLE))
def test_a_listing_the_script_cannot_read_stops_it_before_any_user_is_made(
    tmp_path: Path, listing: str, answer: str
) -> None:
    fake, log = stand_in_rabbitmqctl(tmp_path, {listing: answer})
    result = run_script(
        "--rabbitmqctl", str(fake), "vm", "--vhost", "relay", "--password-stdin", "web-1",
        stdin="secret\n",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout
    assert "Traceback" not in result.stderr
    said = f"rabbitmqctl {listing} answered what is not a JSON list of objects"
    assert said in result.stderr
    calls = log.read_text(encoding="utf-8").split()
    assert not {"add_user", "change_password", "set_permissions"} & set(calls), calls


def test_a_readable_listing_still_makes_the_user(tmp_path: Path) -> None:
    fake, log = stand_in_rabbitmqctl(tmp_path, {"list_users": '[{"user": "guest", "tags": []}]'})
    result = run_script(
        "--rabbitmqctl", str(fake), "vm", "--vhost", "relay", "--password-stdin", "web-1",
        stdin="secret\n",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    calls = log.read_text(encoding="utf-8").split()
    assert {"add_user", "set_permissions"} <= set(calls), calls


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("", "a name is empty"),
        ("  ", "a name is empty"),
        ("web\n1", "holds a control character"),
        ("w" * 201, "is 201 characters long: at most 200"),
    ],
    ids=["empty", "blank", "newline", "too-long"],
)
@pytest.mark.parametrize("command", ["vm", "scale-set", "delete-users"])
def test_a_user_name_that_is_a_mistake_is_refused_before_rabbitmqctl_runs(
    tmp_path: Path, command: str, name: str, said: str
) -> None:
    fake, log = stand_in_rabbitmqctl(tmp_path)
    source = [] if command == "delete-users" else ["--password-stdin"]
    result = run_script(
        "--rabbitmqctl", str(fake), command, "--vhost", "relay", *source, name, stdin="secret\n"
    )
    assert result.returncode == 2, result.stdout
    assert said in result.stderr
    assert not log.exists()  # no rabbitmqctl call at all
