"""The console on the real servers: a transient copy of the stream on RabbitMQ (nothing left
behind), the approver's state, decisions and holds on PostgreSQL."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from consumers._approver_state import ApproverState
from consumers._audit import Ledger
from consumers._db import open_database
from consumers._schema import ensure_schema
from consumers.console._auth import Authenticator
from consumers.console._server import console_running
from consumers.console._service import ConsoleService
from consumers.console._sessions import SessionCodec
from consumers.console._users import UsersFile
from schemas import ChannelNames
from schemas.transport import MemoryBroker, open_transport
from schemas.transport.rabbitmq import RabbitMQTransport
from schemas.wire import lifecycle_message
from tests._postgres import scratch_database
from tests.consumers._factory import event, heartbeat, transition, vm

from ._stack import write_users
from .test_http import signed_in


@pytest.fixture
async def postgres_url(postgres_dsn):
    """A database of this test's own, dropped afterwards."""
    async with scratch_database(postgres_dsn, "console") as url:
        yield url


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_the_console_on_rabbitmq_and_postgresql(amqp_url, postgres_url, tmp_path):
    channels = ChannelNames().suffixed(f"console-{uuid.uuid4().hex[:8]}")
    auth = Authenticator(SessionCodec(b"p" * 32), users=UsersFile(write_users(tmp_path / "u")))
    now = datetime.now(UTC).replace(microsecond=0)
    identity = vm("web-1", scale_set="web", zone="2")
    ev = event("EVT-PG-1", resources=("web-1",), not_before=now + timedelta(minutes=15))
    async with (
        open_transport(amqp_url, channels) as publisher,
        open_transport(amqp_url, channels) as link,
        open_database(postgres_url) as db,
    ):
        assert isinstance(publisher, RabbitMQTransport)
        try:
            await ensure_schema(db)
            async with (
                console_running(link, db, auth, signing_key=None) as (console, server),
                httpx.AsyncClient(base_url=server.url, timeout=10) as client,
            ):
                started = time.monotonic()
                await publisher.publish(lifecycle_message(heartbeat(identity, at=now)))
                await publisher.publish(lifecycle_message(transition("scheduled", ev, identity)))
                while console.live.fleet.event("EVT-PG-1") is None:
                    assert time.monotonic() - started < 3, "the console never saw the event"
                    await asyncio.sleep(0.02)
                assert time.monotonic() - started < 1.0
                # The approver's decision, written to PostgreSQL, shows within a poll or two.
                await Ledger(db).append_decision(
                    "EVT-PG-1",
                    "wait",
                    "NotBefore applies",
                    decided_by="approver",
                    policy="default",
                    event_type="Reboot",
                )
                while "EVT-PG-1" not in console.live.decisions:
                    assert time.monotonic() - started < 5, "the decision never showed"
                    await asyncio.sleep(0.05)
                csrf = await signed_in(client, "alice")
                held = await client.post(
                    "/api/events/EVT-PG-1/hold",
                    json={"reason": "freeze window"},
                    headers={"X-CSRF-Token": csrf},
                )
                assert held.status_code == 200, held.text
                holds = await ApproverState(db, "approver").holds()
                assert holds["EVT-PG-1"].held_by == "alice"
                found = (await client.get("/api/history", params={"event_id": "EVT-PG-1"})).json()
                assert [e["kind"] for e in found["entries"]] == ["decision.wait", "decision.hold"]
        finally:
            await publisher.delete_topology(exchanges=True)


@pytest.mark.postgres
async def test_a_quiet_ledger_on_postgresql_does_not_grow_the_console(postgres_url):
    """On PostgreSQL each poll (every 0.5 s) reads the last 200 decisions again. One about an
    event the view no longer knows (over and pruned) was kept once more at every poll: memory
    grew while the ledger was quiet. It is kept once."""
    name = f"console-{uuid.uuid4().hex[:8]}"
    now = datetime.now(UTC).replace(microsecond=0)
    identity = vm("web-1")
    async with open_database(postgres_url) as db, open_transport(f"memory://{name}") as link:
        await ensure_schema(db)
        console = ConsoleService(link, db, signing_key=None)
        ev = event("EVT-OLD", resources=("web-1",), not_before=now + timedelta(minutes=15))
        console.live.apply(transition("scheduled", ev, identity, at=now))
        await Ledger(db).append_decision(
            "EVT-OLD",
            "wait",
            "NotBefore applies",
            decided_by="approver",
            policy="default",
            event_type="Reboot",
        )
        over = event("EVT-OLD", status="Completed", resources=("web-1",))
        console.live.apply(transition("completed", over, identity, at=now + timedelta(minutes=1)))
        await console._load_decisions()
        console.live.prune(now + timedelta(days=2))  # over and forgotten
        assert console.live.fleet.event("EVT-OLD") is None
        for _ in range(50):  # 25 s of polls, nothing new in the ledger
            await console._new_decisions()
        assert sum(len(waiting) for waiting in console.live._early.values()) <= 1
    MemoryBroker.discard(name)
