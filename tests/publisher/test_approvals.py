"""Approvals in: signed ones are applied (POST StartRequests), every bad one is rejected with its
reason and never POSTed, and the outcome is published before the delivery is acked."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from publisher import AgentSettings
from publisher._state import STATE_FILE, StateStore
from publisher.simulator import EventInfo, EventSpec, EventState, EventType, FaultSpec, Simulator
from schemas import (
    Approval,
    ApprovalOutcomeMessage,
    MessageType,
    RejectReason,
    load_signing_key,
    new_approval,
    sign,
)
from schemas.approvals import write_key_pair
from schemas.transport import open_transport
from schemas.wire import approval_message

from .conftest import Broker
from .harness import (
    Recorder,
    recorder,
    running,
    settings_for,
    signed_approval,
    simulator_server,
    version_of,
)


def _posts(server, vm: str) -> list[str]:
    return [r.path for r in server.simulator.requests(vm=vm) if r.method == "POST"]


async def _send(broker: Broker, approval: Approval, to_vm: str = "web-7") -> None:
    transport = open_transport(broker.url, broker.channels)
    async with transport:
        await transport.send_approval(transport.reply_address(to_vm), approval_message(approval))


async def _outcome(rec: Recorder, approval_id: str) -> ApprovalOutcomeMessage:
    def found(messages) -> bool:
        return any(
            isinstance(m, ApprovalOutcomeMessage) and m.data.approval_id == approval_id
            for m in messages
        )

    messages = await rec.wait_for(found, within=15)
    (outcome,) = [
        m
        for m in messages
        if isinstance(m, ApprovalOutcomeMessage) and m.data.approval_id == approval_id
    ]
    return outcome


async def test_a_signed_approval_is_applied_and_reported(broker: Broker, tmp_path: Path) -> None:
    private, public = write_key_pair(tmp_path / "keys")
    key = load_signing_key(private)
    async with (
        simulator_server("web-7", "web-8") as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        sim = server.simulator
        event = sim.add_event(
            EventSpec(event_type=EventType.REBOOT, resources=["web-7"], not_before_seconds=900)
        )
        settings = settings_for(
            server, "web-7", broker.url, broker.channels, tmp_path / "state", trust_keys=(public,)
        )
        async with running(settings):
            approval = sign(
                new_approval(
                    event.event_id,
                    "web-7",
                    decided_by="test",
                    event_version=version_of(server.simulator, event.event_id),
                ),
                key,
            )
            # A forged copy with the same id first: rejected, and it does not shadow the real one.
            forged = approval.model_copy(update={"decided_by": "mallory"})
            await _send(broker, forged)
            assert (await _outcome(rec, approval.approval_id)).data.reason == "bad-signature"
            rec.messages.clear()
            await _send(broker, approval)
            outcome = await _outcome(rec, approval.approval_id)
            assert outcome.kind is MessageType.APPROVAL_APPLIED
            assert outcome.data.applied
            assert not outcome.data.dry_run
            await sim.wait_for_state(event.event_id, EventState.STARTED, within=5)
            assert [a.vm for a in sim.get_event(event.event_id).approvals] == ["web-7"]
            # Polling is fast after an approval: the start is seen well within a second.
            await rec.wait_kind(MessageType.STARTED, within=2)
            # The same approval again (a redelivery): acked, not applied twice.
            await _send(broker, approval)
            await rec.wait_kind(MessageType.STARTED, within=2)
        assert len(_posts(server, "web-7")) == 1
        assert len(rec.of(MessageType.APPROVAL_APPLIED)) == 1


async def test_bad_approvals_are_rejected_with_their_reason_and_never_posted(
    broker: Broker, tmp_path: Path
) -> None:
    private, public = write_key_pair(tmp_path / "keys")
    key = load_signing_key(private)
    other_private, _ = write_key_pair(tmp_path / "other")
    stranger = load_signing_key(other_private)
    async with (
        simulator_server("web-7", "web-8") as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        sim = server.simulator
        scheduled = sim.add_event(
            EventSpec(event_type=EventType.FREEZE, resources=["web-7"], not_before_seconds=900)
        )
        started = sim.add_event(
            EventSpec(event_type=EventType.REDEPLOY, resources=["web-7"], not_before_seconds=900)
        )
        settings = settings_for(
            server, "web-7", broker.url, broker.channels, tmp_path / "state", trust_keys=(public,)
        )
        async with running(settings):
            sim.start_event(started.event_id)
            good = new_approval(
                scheduled.event_id,
                "web-7",
                decided_by="test",
                event_version=version_of(server.simulator, scheduled.event_id),
            )
            tampered = sign(good, key).model_copy(update={"reason": "changed after signing"})
            past = datetime.now(UTC) - timedelta(hours=1)
            cases = {
                RejectReason.BAD_SIGNATURE: tampered,
                RejectReason.UNKNOWN_KEY: sign(_fresh(good), stranger),
                RejectReason.MISSING_SIGNATURE: _fresh(good),
                RejectReason.EXPIRED: sign(
                    new_approval(
                        scheduled.event_id,
                        "web-7",
                        decided_by="test",
                        now=past,
                        ttl=timedelta(minutes=59, seconds=50),
                        event_version=version_of(server.simulator, scheduled.event_id),
                    ),
                    key,
                ),
                RejectReason.NOT_FOR_THIS_VM: sign(
                    new_approval(
                        scheduled.event_id,
                        "web-8",
                        decided_by="test",
                        event_version=version_of(server.simulator, scheduled.event_id),
                    ),
                    key,
                ),
                RejectReason.EVENT_NOT_SCHEDULED: sign(
                    new_approval(
                        started.event_id,
                        "web-7",
                        decided_by="test",
                        event_version=version_of(server.simulator, started.event_id),
                    ),
                    key,
                ),
                RejectReason.EVENT_NOT_FOUND: sign(
                    new_approval(
                        str(uuid.uuid4()).upper(),
                        "web-7",
                        decided_by="test",
                        event_version=version_of(server.simulator, str(uuid.uuid4()).upper()),
                    ),
                    key,
                ),
            }
            for reason, approval in cases.items():
                await _send(broker, approval)  # all to web-7's queue, whoever they name
                outcome = await _outcome(rec, approval.approval_id)
                assert outcome.kind is MessageType.APPROVAL_REJECTED, reason
                assert outcome.data.reason == reason.value
                assert outcome.data.detail
            malformed = approval_message(good)
            transport = open_transport(broker.url, broker.channels)
            async with transport:
                from dataclasses import replace

                await transport.send_approval(
                    transport.reply_address("web-7"),
                    replace(malformed, body=b"{not json", message_id="garbled"),
                )
            outcome = await _outcome(rec, "garbled")
            assert outcome.data.reason == RejectReason.MALFORMED.value
        assert _posts(server, "web-7") == []
        assert sim.get_event(scheduled.event_id).state is EventState.SCHEDULED


async def test_without_a_trust_key_the_agent_is_observe_only(tmp_path: Path) -> None:
    private, _ = write_key_pair(tmp_path / "keys")
    broker = Broker("memory://observe", _channels("observe"), "memory")
    async with (
        simulator_server("web-7") as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        event = server.simulator.add_event(
            EventSpec(event_type=EventType.FREEZE, not_before_seconds=900)
        )
        settings = settings_for(server, "web-7", broker.url, broker.channels, None)
        async with running(settings):
            approval = sign(
                new_approval(
                    event.event_id,
                    "web-7",
                    decided_by="t",
                    event_version=version_of(server.simulator, event.event_id),
                ),
                load_signing_key(private),
            )
            await _send(broker, approval)
            outcome = await _outcome(rec, approval.approval_id)
        assert outcome.data.reason == RejectReason.OBSERVE_ONLY.value
        assert _posts(server, "web-7") == []


async def test_unsigned_approvals_only_with_accept_unsigned(tmp_path: Path) -> None:
    broker = Broker("memory://unsigned", _channels("unsigned"), "memory")
    async with (
        simulator_server("web-7") as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        event = server.simulator.add_event(
            EventSpec(event_type=EventType.FREEZE, not_before_seconds=900)
        )
        settings = settings_for(
            server, "web-7", broker.url, broker.channels, None, accept_unsigned_approvals=True
        )
        async with running(settings):
            wrong_vm = new_approval(
                event.event_id,
                "web-8",
                decided_by="t",
                event_version=version_of(server.simulator, event.event_id),
            )
            await _send(broker, wrong_vm)
            assert (await _outcome(rec, wrong_vm.approval_id)).data.reason == "not-for-this-vm"
            approval = new_approval(
                event.event_id,
                "web-7",
                decided_by="t",
                event_version=version_of(server.simulator, event.event_id),
            )
            await _send(broker, approval)
            assert (await _outcome(rec, approval.approval_id)).data.applied
        assert len(_posts(server, "web-7")) == 1


async def test_dry_run_verifies_and_reports_but_never_posts(tmp_path: Path) -> None:
    private, public = write_key_pair(tmp_path / "keys")
    broker = Broker("memory://dry", _channels("dry"), "memory")
    async with (
        simulator_server("web-7") as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        event = server.simulator.add_event(
            EventSpec(event_type=EventType.FREEZE, not_before_seconds=900)
        )
        settings = settings_for(
            server, "web-7", broker.url, broker.channels, None, trust_keys=(public,), dry_run=True
        )
        async with running(settings):
            approval = sign(
                new_approval(
                    event.event_id,
                    "web-7",
                    decided_by="t",
                    event_version=version_of(server.simulator, event.event_id),
                ),
                load_signing_key(private),
            )
            await _send(broker, approval)
            outcome = await _outcome(rec, approval.approval_id)
        assert outcome.data.applied
        assert outcome.data.dry_run
        assert _posts(server, "web-7") == []
        assert server.simulator.get_event(event.event_id).state is EventState.SCHEDULED


def _channels(name: str):
    from schemas.channels import ChannelNames

    return ChannelNames().suffixed(f"{name}-{uuid.uuid4().hex[:6]}")


def _fresh(approval: Approval) -> Approval:
    return approval.model_copy(update={"approval_id": str(uuid.uuid4())})


@contextlib.asynccontextmanager
async def _web7(
    broker: Broker, tmp_path: Path, spec: EventSpec, **changes: Any
) -> AsyncIterator[tuple[Simulator, Recorder, EventInfo, Any, AgentSettings]]:
    """web-7 on a simulator with ``spec``'s event, a recorder of the stream, the approver's
    signing key, and web-7's agent settings (trusting that key) with ``changes``."""
    private, public = write_key_pair(tmp_path / "keys")
    key = load_signing_key(private)
    async with (
        simulator_server("web-7") as server,
        recorder(broker.url, broker.channels) as rec,
    ):
        event = server.simulator.add_event(spec)
        settings = settings_for(
            server, "web-7", broker.url, broker.channels, tmp_path / "state", trust_keys=(public,)
        )
        yield server.simulator, rec, event, key, replace(settings, **changes)


async def _approve_a_short_freeze(
    broker: Broker,
    tmp_path: Path,
    *,
    run_seconds: float,
    poll_interval: float,
    fast_poll_seconds: float | None = None,
    post_fault: FaultSpec | None = None,
    imds_timeout: float | None = None,
) -> tuple[list[str], EventState, ApprovalOutcomeMessage]:
    """A Freeze of ``run_seconds`` on web-7, approved once the agent (polling every
    ``poll_interval``, fast polling as by default unless ``fast_poll_seconds``) reported it,
    with ``post_fault`` injected on its POSTs: the transitions reported, the event's state in
    the simulator and the agent's outcome of the approval."""
    changes: dict[str, Any] = {"poll_interval": poll_interval}
    if fast_poll_seconds is not None:
        changes["fast_poll_seconds"] = fast_poll_seconds
    if imds_timeout is not None:
        changes["imds_timeout"] = imds_timeout
    spec = EventSpec(
        event_type=EventType.FREEZE,
        resources=["web-7"],
        not_before_seconds=900,
        duration_in_seconds=5,
        run_seconds=run_seconds,
    )
    async with _web7(broker, tmp_path, spec, **changes) as (sim, rec, event, key, settings):
        async with running(settings):
            await rec.wait_kind(MessageType.SCHEDULED, within=15)
            if post_fault is not None:
                sim.add_fault(post_fault)
            approval = signed_approval(sim, event.event_id, "web-7", key)
            await _send(broker, approval)
            outcome = await _outcome(rec, approval.approval_id)
            await rec.wait_for(
                lambda ms: any(m.kind in (MessageType.COMPLETED, MessageType.CANCELED) for m in ms),
                within=20,
            )
        reported = [m.kind.value for m in rec.transitions()]
        return reported, sim.get_event(event.event_id).state, outcome


async def test_an_event_it_started_that_ran_between_two_polls_is_reported_completed(
    broker: Broker, tmp_path: Path
) -> None:
    """With a slow poll and no fast polling (as a 10,000-VM fleet may run), a short Freeze this
    agent approved starts and ends between two polls: IMDS never shows it Started. The agent's
    own StartRequests succeeded, so the event ran: it is reported completed, not canceled."""
    reported, state, outcome = await _approve_a_short_freeze(
        broker, tmp_path, run_seconds=1, poll_interval=4.0, fast_poll_seconds=0.0
    )
    assert outcome.data.applied
    assert state is EventState.COMPLETED
    assert reported == ["scheduled", "completed"]


async def test_an_event_whose_post_went_unanswered_is_reported_completed_when_it_vanishes(
    broker: Broker, tmp_path: Path
) -> None:
    """IMDS takes the POST but its answer never comes back in time (a loaded host): every
    attempt times out, so the agent cannot say the approval was applied, and reports it was
    not. The event it may have started then runs and ends between two polls: it is reported
    ``completed``, as for a POST that succeeded, never ``canceled`` (Azure did not cancel it),
    and the outcome says IMDS may have taken the request."""
    reported, state, outcome = await _approve_a_short_freeze(
        broker,
        tmp_path,
        run_seconds=1,
        poll_interval=4.0,
        fast_poll_seconds=0.0,
        # each POST is taken 3 s late, after the agent's 0.5 s timeout, and after the look at
        # the event before its last retry (about 1.7 s after the first POST): no poll sees it
        # start
        post_fault=FaultSpec(vm="web-7", method="POST", delay_seconds=3.0, times=10),
        imds_timeout=0.5,
    )
    assert state is EventState.COMPLETED
    assert reported == ["scheduled", "completed"]
    assert not outcome.data.applied
    assert outcome.data.detail is not None
    assert "may have" in outcome.data.detail


async def test_after_an_approval_a_slow_poll_turns_fast_at_once_and_sees_the_event_start(
    broker: Broker, tmp_path: Path
) -> None:
    """With a slow poll (one every 5 s, as a large fleet may run) the agent POSTs an approval
    right after the fresh look it asked for, and so after the watcher planned its next poll 5 s
    away. Polling must turn fast from the POST on, not 5 s later: a Freeze of 2 s starts and
    ends within those 5 s, and its start would never be seen."""
    reported, _, outcome = await _approve_a_short_freeze(
        broker,
        tmp_path,
        run_seconds=2,
        poll_interval=5.0,  # fast polling as by default
    )
    assert outcome.data.applied
    assert reported == ["scheduled", "started", "completed"]


async def _requests_around_an_approval(
    broker: Broker,
    tmp_path: Path,
    *,
    poll_interval: float,
    after_poll: float,
    changed_after_poll: bool = False,
) -> tuple[list[str], ApprovalOutcomeMessage]:
    """A Reboot on web-7 (the agent polling every ``poll_interval``), approved ``after_poll``
    seconds after one of the agent's polls: the agent's IMDS requests from that poll on, up to
    its POST if it made one ("GET" or "POST" each), and the outcome.

    The approval is decided before that poll, unless ``changed_after_poll``: then Azure changes
    the event right after the poll (a longer Reboot), and only then does an approver that had
    not seen the change yet decide, on the version before it."""
    spec = EventSpec(event_type=EventType.REBOOT, resources=["web-7"], not_before_seconds=900)
    web7 = _web7(broker, tmp_path, spec, poll_interval=poll_interval)
    async with web7 as (sim, rec, event, key, settings):
        transport = open_transport(broker.url, broker.channels)
        async with running(settings), transport:
            await rec.wait_kind(MessageType.SCHEDULED, within=15)
            judged = version_of(sim, event.event_id)
            approval = signed_approval(sim, event.event_id, "web-7", key)
            seen = len(sim.requests(vm="web-7"))
            while len(sim.requests(vm="web-7")) == seen:  # noqa: ASYNC110 - the simulator's log
                await asyncio.sleep(0.01)
            poll = len(sim.requests(vm="web-7")) - 1
            if changed_after_poll:
                sim.update_event(event.event_id, duration_in_seconds=600)
                approval = sign(
                    new_approval(event.event_id, "web-7", decided_by="test", event_version=judged),
                    key,
                )
            await asyncio.sleep(after_poll)
            await transport.send_approval(
                transport.reply_address("web-7"), approval_message(approval)
            )
            outcome = await _outcome(rec, approval.approval_id)
        methods = [r.method for r in sim.requests(vm="web-7")[poll:]]
        return methods[: methods.index("POST") + 1 if "POST" in methods else 2], outcome


async def test_an_approval_soon_after_a_poll_is_posted_at_once_on_that_polls_document(
    broker: Broker, tmp_path: Path
) -> None:
    """An approval decided before the agent's last poll began, arriving within a second of that
    poll, is checked against its document and POSTed at once: no GET of its own, and so no wait
    for a slot in the VM's IMDS budget (two requests in any second). Before, it asked for
    another GET, and its POST, the third request within a second, waited for the first poll to
    leave the window: up to a second later, on a document no fresher than this one."""
    requests, outcome = await _requests_around_an_approval(
        broker, tmp_path, poll_interval=1.0, after_poll=0.1
    )
    assert outcome.data.applied
    assert requests == ["GET", "POST"]


async def test_an_approval_long_after_the_last_poll_is_checked_against_a_new_one(
    broker: Broker, tmp_path: Path
) -> None:
    """An approval that arrives more than a second after the last poll (here 1.5 s, polling
    every 5 s) is checked against a poll made for it before the POST, never against the older
    document."""
    requests, outcome = await _requests_around_an_approval(
        broker, tmp_path, poll_interval=5.0, after_poll=1.5
    )
    assert outcome.data.applied
    assert requests == ["GET", "GET", "POST"]


async def test_an_approval_decided_after_the_last_poll_is_checked_against_a_new_one(
    broker: Broker, tmp_path: Path
) -> None:
    """However recent the last poll, an approval decided after it began is checked against a
    new one: the event changed in between (Azure lengthened it right after the poll), the
    approval names the version before, and it is refused, never POSTed, as the approver's
    judgement of the old version says nothing of the new one."""
    requests, outcome = await _requests_around_an_approval(
        broker, tmp_path, poll_interval=5.0, after_poll=0.1, changed_after_poll=True
    )
    assert outcome.data.reason == "event-changed"
    assert requests == ["GET", "GET"]


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("still valid", "applied"),
        ("expired", RejectReason.EXPIRED.value),
        ("now --dry-run", "dry run"),
        ("key removed", RejectReason.OBSERVE_ONLY.value),
        ("event changed", "not posted"),
        ("event unreadable", "unreadable"),
    ],
)
async def test_an_intent_whose_post_may_not_have_gone_out_is_posted_at_start_only_if_still_valid(
    tmp_path: Path, case: str, expected: str
) -> None:
    """The agent stored its intent to apply an approval, then stopped before the POST went
    out: at its next start the event is still Scheduled, at the version approved. The POST it
    makes then is a new POST: made only on every check a fresh approval passes, never when the
    approval has expired since (a Redeploy announced days ahead), when the agent now runs with
    --dry-run or without the approver's key (observe-only: "every approval will be refused"),
    or when the event changed after it was judged. Before, it was POSTed with no check (but
    for the event's version)."""
    broker = Broker(f"memory://intent-{uuid.uuid4().hex[:6]}", _channels("intent"), "memory")
    spec = EventSpec(
        event_type=EventType.REDEPLOY, resources=["web-7"], not_before_seconds=3 * 86400
    )
    async with _web7(broker, tmp_path, spec) as (sim, rec, event, key, settings):
        version = version_of(sim, event.event_id)
        issued = datetime.now(UTC) - timedelta(hours=3 if case == "expired" else 0)
        approval = sign(
            new_approval(
                event.event_id, "web-7", decided_by="policy", event_version=version, now=issued
            ),
            key,
        )
        # What the agent did before its POST (then it stopped).
        store = await StateStore.open(settings.state_dir)
        await store.record_intent(
            approval.approval_id, event.event_id, version, approval.to_bytes()
        )
        await store.close()
        if case == "now --dry-run":
            settings = replace(settings, dry_run=True)
        if case == "key removed":
            settings = replace(settings, trust_keys=())
        if case == "event changed":
            sim.update_event(event.event_id, duration_in_seconds=600)
        if case == "event unreadable":
            # IMDS lists it with a duration that is no number: the agent cannot say where it
            # is, so no POST, and the report says why (not "the event is gone").
            (served,) = sim.scheduled_events_document("web-7")["Events"]
            body = {
                "DocumentIncarnation": sim.incarnation("web-7") + 1,
                "Events": [dict(served, DurationInSeconds="soon")],
            }
            sim.add_fault(
                FaultSpec(
                    vm="web-7", endpoint="scheduledevents", method="GET", times=100_000,
                    body=json.dumps(body),
                )
            )  # fmt: skip
        async with running(settings):
            outcome = await _outcome(rec, approval.approval_id)
    posts = _posts_to(sim, "web-7")
    if expected == "applied":
        assert outcome.kind is MessageType.APPROVAL_APPLIED
        assert len(posts) == 1
        return
    assert posts == [], f"{case}: POSTed at start"
    assert sim.get_event(event.event_id).state is EventState.SCHEDULED
    if expected == "not posted":
        return
    if expected == "unreadable":
        assert "listed by IMDS but unreadable" in outcome.data.detail
        return
    if expected == "dry run":
        assert outcome.data.dry_run
        assert "not POSTed" in outcome.data.detail
    else:
        assert outcome.kind is MessageType.APPROVAL_REJECTED
        assert outcome.data.reason == expected
        assert "may have gone out" in outcome.data.detail


def _posts_to(sim: Simulator, vm: str) -> list[str]:
    return [r.path for r in sim.requests(vm=vm) if r.method == "POST"]


@pytest.mark.parametrize("changed", [False, True], ids=["unchanged", "changed"])
async def test_a_post_is_retried_only_on_a_new_look_at_the_event(
    tmp_path: Path, changed: bool
) -> None:
    """IMDS answers 503 to the POST (not taken); before the retry the agent looks at the event
    again, on a poll begun after the failure: unchanged, it POSTs again and the approval is
    applied; changed by Azure in between (a 10-minute Reboot instead of a 30 s one), the retry
    is not made and the approval is refused ``event-changed``, as it would be had it arrived
    then. Before, the retry started the changed event, which the approver never judged."""
    broker = Broker(f"memory://retry-{uuid.uuid4().hex[:6]}", _channels("retry"), "memory")
    spec = EventSpec(
        event_type=EventType.REBOOT,
        resources=["web-7"],
        not_before_seconds=900,
        duration_in_seconds=30,
    )
    web7 = _web7(broker, tmp_path, spec)
    async with web7 as (sim, rec, event, key, settings), running(settings):
        await rec.wait_kind(MessageType.SCHEDULED, within=15)
        approval = signed_approval(sim, event.event_id, "web-7", key)
        sim.add_fault(FaultSpec(vm="web-7", method="POST", status=503, times=1))
        await _send(broker, approval)
        async with asyncio.timeout(10):
            while not _posts_to(sim, "web-7"):  # noqa: ASYNC110 - the simulator's log
                await asyncio.sleep(0.005)
        if changed:
            sim.update_event(event.event_id, duration_in_seconds=600)
        outcome = await _outcome(rec, approval.approval_id)
    requests = [r.method for r in sim.requests(vm="web-7")]
    after_failure = requests[requests.index("POST") + 1 :]
    if changed:
        assert outcome.data.reason == RejectReason.EVENT_CHANGED.value
        assert [a.vm for a in sim.get_event(event.event_id).approvals] == []
        assert "POST" not in after_failure
    else:
        assert outcome.data.applied
        assert [a.vm for a in sim.get_event(event.event_id).approvals] == ["web-7"]
        assert "GET" in after_failure[: after_failure.index("POST")]


async def _intent_left_by_a_stop(
    sim: Simulator, event: EventInfo, key: Any, settings: AgentSettings
) -> Approval:
    """An approval of ``event`` for web-7 (signed with ``key``, at the version the simulator
    shows), whose intent web-7's store holds as the agent left it when it stopped before its
    POST."""
    version = version_of(sim, event.event_id)
    approval = sign(
        new_approval(event.event_id, "web-7", decided_by="policy", event_version=version), key
    )
    assert settings.state_dir is not None
    store = await StateStore.open(settings.state_dir)
    await store.record_intent(approval.approval_id, event.event_id, version, approval.to_bytes())
    await store.close()
    return approval


async def test_an_unreadable_stored_intent_does_not_stop_the_agent_at_each_start(
    tmp_path: Path,
) -> None:
    """The agent reconciles its stored approval intents when it starts. One row of the wrong
    shape (a body stored as text, a time that is no number: a file edited by hand, or damaged)
    raised out of the reconciling, which ended the agent, at every start. Now that row is left
    as it is with an error naming it, and the others are reconciled."""
    broker = Broker(f"memory://intent-{uuid.uuid4().hex[:6]}", _channels("intent"), "memory")
    spec = EventSpec(
        event_type=EventType.REDEPLOY, resources=["web-7"], not_before_seconds=3 * 86400
    )
    async with _web7(broker, tmp_path, spec) as (sim, rec, event, key, settings):
        approval = await _intent_left_by_a_stop(sim, event, key, settings)
        assert settings.state_dir is not None
        with sqlite3.connect(settings.state_dir / STATE_FILE) as db:
            db.execute(
                "INSERT INTO approval_intents (approval_id, event_id, event_version, body, at) "
                "VALUES ('damaged', 'EVT-X', 'v', 'text, not bytes', 'no time')"
            )
        async with running(settings):  # its exit awaits the agent: an agent that failed raises
            outcome = await _outcome(rec, approval.approval_id)
            await asyncio.sleep(0.5)
    assert outcome.kind is MessageType.APPROVAL_APPLIED  # the readable one was reconciled
