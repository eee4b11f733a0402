"""Reading the small files the agent is given (settings, secrets, its origin key)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["NotARegularFile", "read_regular_file"]


class NotARegularFile(OSError):
    """The path is a FIFO, a device, a directory...: nothing the agent reads."""


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
