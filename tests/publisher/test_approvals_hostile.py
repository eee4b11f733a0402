"""Hostile approvals: whatever a message on the VM's approvals queue holds, the agent refuses it
with a report, acks it and goes on applying the next one; one message never ends the agent (nor,
unacked and delivered again, every start after)."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from publisher.simulator import EventSpec, EventType
from schemas import (
    MAX_KEY_LENGTH,
    ApprovalOutcomeMessage,
    MessageType,
    RejectReason,
    key_id,
    new_approval,
)
from schemas.transport import open_transport
from schemas.wire import approval_message

from .conftest import Broker
from .harness import Recorder, running, signed_approval, version_of
from .test_approvals import _channels, _outcome, _send, _web7


def _outcomes(rec: Recorder, approval_id: str) -> list[ApprovalOutcomeMessage]:
    return [
        m
        for m in rec.messages
        if isinstance(m, ApprovalOutcomeMessage) and m.data.approval_id == approval_id
    ]


@pytest.mark.parametrize("mode", ["signed", "unsigned"])
async def test_an_approval_whose_times_have_no_utc_equivalent_is_refused_and_the_agent_goes_on(
    broker: Broker, tmp_path: Path, mode: str
) -> None:
    """A forged approval (the trusted key's id, which is public, and any signature) issued in
    year 1 at +01:00 has no time in UTC: computing its signed bytes raised OverflowError (so
    did refusing an unsigned one dated year 9999 at -01:00 as issued in the future). It ended
    the agent, and, never acked, it came back at the next start and ended that one too. It is
    refused and acked; the agent applies the next approval, and a restart does not see it."""
    unsigned = {"trust_keys": (), "accept_unsigned_approvals": True}
    spec = EventSpec(event_type=EventType.FREEZE, resources=["web-7"], not_before_seconds=900)
    async with _web7(broker, tmp_path, spec, **(unsigned if mode == "unsigned" else {})) as (
        sim,
        rec,
        event,
        key,
        settings,
    ):
        base = new_approval(
            event.event_id,
            "web-7",
            decided_by="mallory",
            event_version=version_of(sim, event.event_id),
        )
        fields = json.loads(base.to_bytes())
        if mode == "signed":
            fields |= {
                "issued_at": "0001-01-01T00:00:00+01:00",
                "expires_at": "0001-01-01T00:10:00+01:00",
                "key_id": key_id(key.public_key()),
                "signature": "AAAA",
            }
        else:
            fields |= {
                "issued_at": "9999-12-31T23:59:59-01:00",
                "expires_at": "9999-12-31T23:59:59-01:00",
            }
        forged = replace(approval_message(base), body=json.dumps(fields).encode())
        transport = open_transport(broker.url, broker.channels)
        async with transport:
            async with running(settings):
                await transport.send_approval(transport.reply_address("web-7"), forged)
                refused = await _outcome(rec, base.approval_id)
                assert refused.kind is MessageType.APPROVAL_REJECTED
                assert refused.data.reason == RejectReason.MALFORMED.value
                assert "outside years 1 to 9999 in UTC" in refused.data.detail
                good = signed_approval(sim, event.event_id, "web-7", key)
                if mode == "unsigned":
                    good = good.model_copy(update={"key_id": None, "signature": None})
                await transport.send_approval(
                    transport.reply_address("web-7"), approval_message(good)
                )
                assert (await _outcome(rec, good.approval_id)).data.applied
            # Acked: the next start does not get it again.
            async with running(settings):
                await rec.wait_kind(MessageType.AGENT_ONLINE, count=2, within=15)
                await asyncio.sleep(1.0)
        assert len(_outcomes(rec, base.approval_id)) == 1


@pytest.mark.parametrize("field", ["approval_id", "event_id", "vm"])
async def test_an_approval_with_an_id_over_the_contracts_bound_is_refused_as_malformed(
    tmp_path: Path, field: str
) -> None:
    """A forged approval with a 201-character id (or VM name) was read, refused, and the
    agent's report of it, which the contract bounds to 200 characters, failed validation and
    ended the agent. It is refused as malformed, saying why, and the agent goes on."""
    broker = Broker(f"memory://long-{uuid.uuid4().hex[:6]}", _channels("long"), "memory")
    spec = EventSpec(event_type=EventType.FREEZE, resources=["web-7"], not_before_seconds=900)
    async with _web7(broker, tmp_path, spec) as (sim, rec, event, key, settings):
        forged = new_approval(
            event.event_id, "web-7", decided_by="mallory", event_version="0" * 32
        ).model_copy(update={field: "a" * (MAX_KEY_LENGTH + 1)})
        async with running(settings):
            await _send(broker, forged)
            refused = await _outcome(rec, forged.approval_id[:MAX_KEY_LENGTH])
            assert refused.data.reason == RejectReason.MALFORMED.value
            assert f"at most {MAX_KEY_LENGTH} characters" in refused.data.detail
            good = signed_approval(sim, event.event_id, "web-7", key)
            await _send(broker, good)
            assert (await _outcome(rec, good.approval_id)).data.applied
