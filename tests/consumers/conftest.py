"""Fixtures of the consumer tests."""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit, urlunsplit

import pytest


@pytest.fixture
async def postgres_url(postgres_dsn):
    """A database of this test's own, dropped afterwards."""
    import asyncpg

    name = f"audit_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(postgres_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    split = urlsplit(postgres_dsn)
    yield urlunsplit(split._replace(path=f"/{name}"))
    admin = await asyncpg.connect(postgres_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()
