"""A PostgreSQL database of one test's or one benchmark run's own, dropped afterwards."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit


@contextlib.asynccontextmanager
async def scratch_database(server: str, prefix: str) -> AsyncIterator[str]:
    """The URL of a new database ``<prefix>_<random>`` on ``server`` (a user who may create
    databases), dropped with its connections when the block ends."""
    import asyncpg

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(server)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield urlunsplit(urlsplit(server)._replace(path=f"/{name}"))
    finally:
        admin = await asyncpg.connect(server)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()
