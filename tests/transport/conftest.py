"""The ``backend`` fixture: every contract test runs once per registered broker."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from ._rabbitmqctl import BrokerUser, throwaway_user
from .backends import BACKENDS, Backend


@pytest.fixture(
    params=[pytest.param(name, marks=marks, id=name) for name, (_, marks) in BACKENDS.items()]
)
async def backend(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Backend]:
    factory, _ = BACKENDS[request.param]
    async with factory(request, unique) as instance:
        yield instance


@pytest.fixture
async def alice(unique: str) -> AsyncIterator[BrokerUser]:
    """A RabbitMQ user of the test's own (a VM's login), removed afterwards."""
    async with throwaway_user(f"alice-{unique}") as user:
        yield user
