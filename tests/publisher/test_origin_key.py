"""The VM's origin key (``state_dir/origin.key``) is a file in a directory others may write to:
what is there is read at most 64 KiB, as trust keys are, and only from a regular file; anything
else is a ConfigError naming the file and what to do (one line, exit status 2), not a read that
never ends, a blocked start or a traceback."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from publisher._origin import KEY_FILE, load_origin_key
from schemas import ConfigError


def _raw(key: object) -> bytes:
    public = key.public_key()  # type: ignore[attr-defined]
    raw: bytes = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw


def test_the_key_is_made_once_then_read_back(tmp_path: Path) -> None:
    made = load_origin_key(tmp_path)
    assert (tmp_path / KEY_FILE).stat().st_mode & 0o777 == 0o600
    assert _raw(load_origin_key(tmp_path)) == _raw(made)


def test_a_huge_origin_key_is_refused_without_reading_it(tmp_path: Path) -> None:
    """Before, the whole file was read (256 MiB here cost as much memory) before it was
    refused."""
    with (tmp_path / KEY_FILE).open("wb") as handle:
        handle.truncate(256 * 2**20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with pytest.raises(ConfigError, match="larger than") as refused:
        load_origin_key(tmp_path)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    assert grown < 16, f"{grown:.0f} MiB read to refuse one key file"
    assert str(tmp_path / KEY_FILE) in str(refused.value)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "directory"])
def test_an_origin_key_that_is_not_a_regular_file_is_refused_unread(
    tmp_path: Path, kind: str
) -> None:
    """A link to /dev/zero was read until memory ran out; a FIFO blocked the start."""
    path = tmp_path / KEY_FILE
    if kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    with pytest.raises(ConfigError, match="not a regular file") as refused:
        load_origin_key(tmp_path)
    assert str(refused.value).startswith(f"state_dir: {path}")


def test_a_dangling_link_is_a_config_error_not_a_traceback(tmp_path: Path) -> None:
    """It exists not as a file: the key was neither read (nothing there) nor made (os.open
    with O_EXCL raised FileExistsError out of the agent)."""
    (tmp_path / KEY_FILE).symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=str(tmp_path / KEY_FILE)):
        load_origin_key(tmp_path)


def test_a_key_file_that_holds_no_key_says_what_to_do(tmp_path: Path) -> None:
    (tmp_path / KEY_FILE).write_bytes(b"-----BEGIN PRIVATE KEY-----\ntorn")
    with pytest.raises(ConfigError, match="move it aside") as refused:
        load_origin_key(tmp_path)
    assert "\n" not in str(refused.value)


def test_a_key_that_cannot_be_made_is_a_config_error(tmp_path: Path) -> None:
    """(The store checks the state dir first; here it is a file, which no agent gets to.)"""
    state = tmp_path / "state"
    state.write_text("")
    with pytest.raises(ConfigError, match="cannot create"):
        load_origin_key(state)
