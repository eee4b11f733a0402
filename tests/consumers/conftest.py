"""Fixtures of the consumer tests."""

from __future__ import annotations

import pytest

from tests._postgres import scratch_database


@pytest.fixture
async def postgres_url(postgres_dsn):
    """A database of this test's own, dropped afterwards."""
    async with scratch_database(postgres_dsn, "audit") as url:
        yield url
