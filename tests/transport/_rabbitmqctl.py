"""Broker administration for the tests that need it: throwaway users, policies (``rabbitmqctl``).

A test that needs it is skipped with the reason where ``rabbitmqctl`` cannot be used (not
installed, not root, another node), and fails instead when ``CI`` is set: CI runs as root on the
broker's machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest

__all__ = ["BrokerUser", "rabbitmqctl", "require_rabbitmqctl", "throwaway_user"]

_TIMEOUT = 60.0


class RabbitmqctlError(RuntimeError):
    pass


async def rabbitmqctl(*args: str) -> str:
    """Run ``rabbitmqctl ARGS``; its output, or :class:`RabbitmqctlError` with its complaint."""
    executable = shutil.which("rabbitmqctl")
    if executable is None:
        raise RabbitmqctlError("rabbitmqctl is not installed")
    process = await asyncio.create_subprocess_exec(
        executable,
        "-q",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(_TIMEOUT):
            out, err = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise RabbitmqctlError(f"rabbitmqctl {' '.join(args)} took over {_TIMEOUT:g} s") from None
    if process.returncode != 0:
        text = (err or out).decode(errors="replace").strip()
        raise RabbitmqctlError(f"rabbitmqctl {args[0]} failed ({process.returncode}): {text}")
    return out.decode(errors="replace")


async def require_rabbitmqctl() -> None:
    """Skip (fail under ``CI``) unless ``rabbitmqctl`` can administer the test broker."""
    try:
        await rabbitmqctl("list_users")
    except (RabbitmqctlError, OSError) as exc:
        message = f"rabbitmqctl is not usable here ({exc}): run the tests as root on the broker"
        if os.environ.get("CI"):
            pytest.fail(f"CI needs rabbitmqctl. {message}", pytrace=False)
        pytest.skip(message)


@dataclass(frozen=True)
class BrokerUser:
    name: str
    password: str

    def url(self, amqp_url: str, vhost: str | None = None) -> str:
        """``amqp_url`` logged in as this user (on ``vhost`` when given)."""
        split = urlsplit(amqp_url)
        netloc = f"{self.name}:{self.password}@{split.hostname}:{split.port or 5672}"
        path = split.path if vhost is None else f"/{vhost}"
        return split._replace(netloc=netloc, path=path).geturl()


@contextlib.asynccontextmanager
async def throwaway_user(
    unique: str, permissions: Sequence[str] | None = (".*", ".*", ".*")
) -> AsyncIterator[BrokerUser]:
    """A user of its own on vhost ``/`` (``permissions``: configure, write, read; None: none),
    deleted afterwards."""
    await require_rabbitmqctl()
    user = BrokerUser(f"relay-test-{unique}", secrets.token_hex(12))
    await rabbitmqctl("add_user", user.name, user.password)
    try:
        if permissions is not None:
            await rabbitmqctl("set_permissions", "-p", "/", user.name, *permissions)
        yield user
    finally:
        await rabbitmqctl("delete_user", user.name)
