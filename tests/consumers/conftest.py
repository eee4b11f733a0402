"""Fixtures of the consumer tests."""

from __future__ import annotations

import pytest

from tests._postgres import scratch_database


@pytest.fixture
async def postgres_url(postgres_dsn):
    """A database of this test's own, dropped afterwards."""
    async with scratch_database(postgres_dsn, "audit") as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def state_url(request, tmp_path):
    """The central services' database: a SQLite file, then a scratch PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'central.db'}"
    return request.getfixturevalue("postgres_url")
