"""Shared fixtures: the real services tests talk to, and isolation between tests.

A test that needs RabbitMQ or PostgreSQL finds it from an environment variable with the local
default. Where the service is unreachable the test is skipped with the reason; when ``CI`` is
set it fails instead, saying which service and how to start it.
"""

from __future__ import annotations

import fcntl
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

AMQP_URL = os.environ.get("RELAY_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
POSTGRES_DSN = os.environ.get(
    "RELAY_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test"
)

_HOW_TO_START = {
    "RabbitMQ": "start it with `rabbitmq-server -detached`",
    "PostgreSQL": (
        "start it with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start`"
    ),
}


def _reachable(url: str, default_port: int) -> bool:
    split = urlsplit(url)
    try:
        with socket.create_connection(
            (split.hostname or "127.0.0.1", split.port or default_port), 2
        ):
            return True
    except OSError:
        return False


def require_service(name: str, url: str, default_port: int) -> None:
    if _reachable(url, default_port):
        return
    split = urlsplit(url)
    where = f"{split.hostname}:{split.port or default_port}"
    message = f"{name} is not reachable at {where}: {_HOW_TO_START[name]}"
    if os.environ.get("CI"):
        pytest.fail(f"CI needs {name}. {message}", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """The RabbitMQ test server's URL (``RELAY_TEST_AMQP_URL``)."""
    require_service("RabbitMQ", AMQP_URL, 5672)
    return AMQP_URL


@pytest.fixture(scope="session")
def postgres_dsn() -> str:
    """The PostgreSQL test server's DSN (``RELAY_TEST_POSTGRES_DSN``)."""
    require_service("PostgreSQL", POSTGRES_DSN, 5432)
    return POSTGRES_DSN


@pytest.fixture
def unique() -> str:
    """A short unique suffix for broker entity and database names owned by one test."""
    return uuid.uuid4().hex[:10]


@pytest.fixture(autouse=True)
def _isolated_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees settings from the developer's shell (the agent reads SE_RELAY_*)."""
    for name in list(os.environ):
        if name.startswith(("SE_RELAY_", "SCHEDULED_EVENTS_")):
            monkeypatch.delenv(name, raising=False)
    return


@pytest.fixture(autouse=True)
def _broker_wide_alone(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """A test marked ``broker_wide`` changes a setting of the whole RabbitMQ node for a while
    (one no test can scope to its own entities), so it runs while no other test of this run
    uses RabbitMQ, in any worker: it holds a lock file exclusively, every test that uses the
    broker (the ``amqp_url`` fixture) holds it shared. A gate before it lets the exclusive one
    in once the tests under way end (a steady stream of shared holders cannot starve it)."""
    alone = request.node.get_closest_marker("broker_wide") is not None
    if not alone and "amqp_url" not in request.fixturenames:
        yield
        return
    # The workers of one xdist run share the parent of their base temp directories.
    where = Path(tmp_path_factory.getbasetemp()).parent
    with (
        (where / "rabbitmq-gate.lock").open("a") as gate,
        (where / "rabbitmq.lock").open("a") as held,
    ):
        if alone:
            fcntl.flock(gate, fcntl.LOCK_EX)  # no new user of the broker from here on
            fcntl.flock(held, fcntl.LOCK_EX)  # once the ones under way are done
        else:
            fcntl.flock(gate, fcntl.LOCK_SH)
            fcntl.flock(held, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
