"""The approver's stored state is input too: a row of the ledger or of the approver's own tables
that cannot be read (written by an older or newer version, by hand, or by anyone with INSERT on
the append-only ledger, where it stays for good) costs that row, with a warning saying which
one, never the approver: a standby that takes over, or the active one loading again after a
failed commit, goes on deciding."""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from consumers._approver import ApproverService
from consumers._db import open_database
from consumers._schema import ensure_schema
from schemas import Approval
from schemas.approvals import generate_signing_key
from schemas.transport import MemoryTransport

from ._factory import event, heartbeat, transition, vm


@pytest.fixture
async def transport():
    async with MemoryTransport(f"approver-state-{uuid.uuid4().hex}") as memory:
        yield memory


_INSERT_DECISION = (
    "INSERT INTO ledger_decisions (time, event_id, event_type, target, body) VALUES (?, ?, ?, ?, ?)"
)


async def _decisions_of(db, event_id: str) -> int:
    row = await db.fetchone("SELECT count(*) FROM ledger_decisions WHERE event_id = ?", event_id)
    return int(row[0])


@pytest.mark.parametrize(
    "body",
    [
        '{"note": "hello"}',  # no action
        '{"action": ["wait"], "reason": 3}',  # not text
        '"wait"',  # not an object
        "[[[[[[[[ not JSON",  # SQLite only: PostgreSQL's JSONB refuses it
    ],
)
async def test_an_unreadable_decision_in_the_ledger_does_not_stop_the_approver(
    transport, state_url, body, caplog
):
    """Before, the load read the newest decision of each open event with body["action"]:
    one row without it raised KeyError in every load, so the standby (and the active approver
    after any refused commit) failed on every message it handled: nothing was decided any
    more. The row is skipped with a warning naming it, and the newest readable decision of
    the event counts (so the same decision is not recorded again)."""
    now = datetime.now(UTC)
    key = generate_signing_key()
    platform = event("EVT-1", resources=("web-1",))
    async with open_database(state_url) as db:
        if db.dialect == "postgres" and body.startswith("[[["):
            pytest.skip("PostgreSQL stores only valid JSON in the ledger")
        await ensure_schema(db)
        first = ApproverService(transport, key, db=db, decided_by="first")
        await first.handle(heartbeat(vm("web-1"), at=now))
        await first.handle(transition("scheduled", platform, vm("web-1"), at=now))
        await first.commit()
        assert await _decisions_of(db, "EVT-1") == 1  # wait: no policy approves it
        await db.execute(
            _INSERT_DECISION, now + timedelta(seconds=1), "EVT-1", "Reboot", None, body
        )
        ((position,),) = await db.fetch("SELECT max(position) FROM ledger_decisions")

        standby = ApproverService(transport, key, db=db, decided_by="standby")
        user = event("EVT-2", source="User", resources=("web-2",))
        with caplog.at_level(logging.WARNING, logger="consumers"):
            await standby.handle(heartbeat(vm("web-2"), at=now))
        await standby.handle(transition("scheduled", user, vm("web-2"), at=now))
        later = now + timedelta(seconds=2)
        await standby.handle(transition("scheduled", platform, vm("web-1"), at=later))
        await standby.commit()
        assert await _decisions_of(db, "EVT-1") == 2  # the first wait and the odd row only
    assert [(d.event_id, d.action.value) for d in standby.decisions] == [("EVT-2", "approve")]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"decision {position} " in w and "EVT-1" in w for w in warnings), warnings


@pytest.mark.parametrize(
    ("body", "at"),
    [
        (b"not an approval", None),
        (b'{"approval_id": "x"}', None),  # JSON, not an approval
        (None, "yesterday"),  # SQLite only: PostgreSQL keeps a timestamptz
    ],
)
async def test_an_unreadable_stored_approval_does_not_stop_the_approver(
    transport, state_url, body, at, caplog
):
    """Before, Approval.from_bytes (and the time's parse) raised out of the load for a stored
    approval that is not one. It is skipped with a warning naming it; the approvals that read
    are known as before (the event approved is not approved again) and the rest is decided."""
    now = datetime.now(UTC)
    key = generate_signing_key()
    async with open_database(state_url) as db:
        if db.dialect == "postgres" and at is not None:
            pytest.skip("PostgreSQL keeps only valid times")
        await ensure_schema(db)
        first = ApproverService(transport, key, db=db, decided_by="first")
        approved = event("EVT-U", source="User", resources=("web-1",))
        await first.handle(heartbeat(vm("web-1"), at=now))
        await first.handle(transition("scheduled", approved, vm("web-1"), at=now))
        await first.commit()
        ((good,),) = await db.fetch("SELECT body FROM approver_approvals")
        await db.execute(
            "INSERT INTO approver_approvals (grp, approval_id, event_id, event_version, target, "
            "reply_channel, reply_key, body, state, at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            "approver", "odd-one", "EVT-U", "v", "web-1", "somewhere", "web-1",
            body if body is not None else bytes(good), "sending",
            at if at is not None else now + timedelta(seconds=1),
        )  # fmt: skip

        standby = ApproverService(transport, key, db=db, decided_by="standby")
        with caplog.at_level(logging.WARNING, logger="consumers"):
            await standby.handle(heartbeat(vm("web-2"), at=now))
        user = event("EVT-2", source="User", resources=("web-2",))
        await standby.handle(transition("scheduled", user, vm("web-2"), at=now))
        await standby.handle(
            transition("scheduled", approved, vm("web-1"), at=now + timedelta(seconds=2))
        )
        await standby.commit()
    assert [(d.event_id, d.action.value) for d in standby.decisions] == [("EVT-2", "approve")]
    assert Approval.from_bytes(bytes(good)).event_id == "EVT-U"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("odd-one" in w and "EVT-U" in w for w in warnings), warnings


async def test_an_unreadable_stored_message_is_skipped_and_named(transport, tmp_path, caplog):
    """A stored message that is not one (here not bytes at all) is skipped, and the line
    says which row it is."""
    url = f"sqlite:///{tmp_path / 'central.db'}"
    now = datetime.now(UTC)
    async with open_database(url) as db:
        await ensure_schema(db)
        await db.execute(
            "INSERT INTO approver_messages (grp, message_id, event_id, vm, raw) "
            "VALUES (?, ?, ?, ?, ?)",
            "approver", "m-1", "EVT-9", "web-9", 12,
        )  # fmt: skip
        ((position,),) = await db.fetch("SELECT max(position) FROM approver_messages")
        standby = ApproverService(transport, generate_signing_key(), db=db, decided_by="standby")
        user = event("EVT-2", source="User", resources=("web-2",))
        with caplog.at_level(logging.WARNING, logger="consumers"):
            await standby.handle(heartbeat(vm("web-2"), at=now))
        await standby.handle(transition("scheduled", user, vm("web-2"), at=now))
        await standby.commit()
    assert [(d.event_id, d.action.value) for d in standby.decisions] == [("EVT-2", "approve")]
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(f"message {position} " in m for m in messages), messages


async def test_a_hold_with_an_unreadable_time_still_holds_and_the_rest_is_decided(
    transport, tmp_path, caplog
):
    """The holds are read before every batch's first approval. Before, one hold whose time
    could not be read raised there: no event was approved any more. It is still a hold (an
    operator asked for it: the event is not approved), with its time unknown."""
    url = f"sqlite:///{tmp_path / 'central.db'}"
    now = datetime.now(UTC)
    async with open_database(url) as db:
        await ensure_schema(db)
        await db.execute(
            "INSERT INTO approver_holds (event_id, held_by, reason, at) VALUES (?, ?, ?, ?)",
            "EVT-H", "alice", "change freeze", "yesterday",
        )  # fmt: skip
        service = ApproverService(transport, generate_signing_key(), db=db)
        with caplog.at_level(logging.WARNING, logger="consumers"):
            await service.handle(heartbeat(vm("web-1"), at=now))
            for event_id, name in (("EVT-H", "web-1"), ("EVT-2", "web-2")):
                user = event(event_id, source="User", resources=(name,))
                await service.handle(transition("scheduled", user, vm(name), at=now))
        await service.commit()
        assert service.state is not None
        holds = await service.state.holds()
    assert [(d.event_id, d.action.value) for d in service.decisions] == [
        ("EVT-H", "wait"),
        ("EVT-2", "approve"),
    ]
    assert "held by alice (change freeze)" in service.decisions[0].reason
    assert holds["EVT-H"].at is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("EVT-H" in w and "yesterday" in w for w in warnings), warnings
