"""Reading the small files the agent and the central services are given (settings, secrets,
keys, policies): a regular file, read without blocking and never past a limit."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ._errors import ConfigError

__all__ = ["NotARegularFile", "read_regular_file", "read_setting_file", "read_setting_text"]


class NotARegularFile(OSError):
    """The path is a FIFO, a device, a directory...: nothing the agent or a command reads."""


def read_regular_file(path: Path, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of the regular file ``path`` (a link to one is fine: a secret
    mounted by Kubernetes is one), so a caller sees that a longer file is too long. Opened
    without blocking (a FIFO nobody writes to held the start for ever), never read past the
    limit (a link to ``/dev/zero`` was read until memory ran out). :class:`OSError` when it
    cannot be opened or read, :class:`NotARegularFile` when it is not a regular file."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise NotARegularFile(f"{path} is not a regular file")
        data = b""
        while len(data) <= limit:
            chunk = os.read(descriptor, limit + 1 - len(data))
            if not chunk:
                break
            data += chunk
        return data
    finally:
        os.close(descriptor)


def read_setting_file(path: Path, limit: int, what: str) -> bytes:
    """:func:`read_regular_file` for a file a command is given (``what``: "the signing key";
    empty: the path alone names it): at most ``limit + 1`` bytes (the caller says what a
    longer one is), :class:`ConfigError` naming it when it cannot be read or is not a regular
    file (a FIFO, ``/dev/zero``, a directory)."""
    named = f"{what} {path}" if what else str(path)
    try:
        return read_regular_file(path, limit)
    except NotARegularFile as exc:
        raise ConfigError(f"{named} is not a regular file") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read {named}: {exc.strerror or exc}") from exc


def read_setting_text(path: Path, limit: int, what: str, *, encoding: str = "utf-8") -> str:
    """:func:`read_setting_file` as text: :class:`ConfigError` naming it (``what``) when it
    holds more than ``limit`` bytes or is not UTF-8 (``encoding``: ``utf-8-sig`` drops a BOM)."""
    named = f"{what} {path}" if what else str(path)
    data = read_setting_file(path, limit, what)
    if len(data) > limit:
        size = f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit >> 10} KiB"
        raise ConfigError(f"{named} is larger than {size}")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{named} is not UTF-8 (byte {exc.start} is not)") from exc
