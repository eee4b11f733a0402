"""The fleet stream over the in-memory transport: typed messages, filters, dedupe, bad input
dead-lettered with its reason, failing handlers retried then dead-lettered, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from consumers import DeadLetterReason, DedupeWindow, FleetStream, MessageFilter
from schemas import LifecycleMessage, MessageType, TransitionMessage
from schemas.transport import MemoryTransport, OutgoingMessage
from schemas.wire import lifecycle_message

from ._factory import event, heartbeat, transition, vm


@pytest.fixture
async def transport():
    async with MemoryTransport(f"stream-{uuid.uuid4().hex}") as memory:
        yield memory


def raw(body: bytes, message_id: str = "raw") -> OutgoingMessage:
    return OutgoingMessage(body=body, message_id=message_id, content_type="application/json")


async def dead_letters(transport, group: str, count: int) -> list[Any]:
    out = []
    async with transport.dead_letters(group) as sub:
        async with asyncio.timeout(2):
            async for delivery in sub:
                out.append(delivery)
                await delivery.ack()
                if len(out) == count:
                    break
    return out


async def collect(stream: FleetStream, count: int) -> list[Any]:
    got = []
    async with asyncio.timeout(3):
        async for message in stream:
            got.append(message)
            if len(got) == count:
                break
    return got


async def test_iteration_yields_typed_messages_and_acks_them(transport):
    stream = FleetStream(transport, "audit")
    async with stream:
        web1 = vm("web-1")
        await transport.publish(lifecycle_message(transition("scheduled", event(), web1)))
        await transport.publish(lifecycle_message(heartbeat(web1)))
        got = await collect(stream, 2)
    assert isinstance(got[0], TransitionMessage)
    assert got[0].data.event.event_id == "EVT-1"
    assert [m.kind for m in got] == [MessageType.SCHEDULED, MessageType.AGENT_HEARTBEAT]
    assert transport.broker.depth("audit") == 0  # both acked, nothing comes back


async def test_bad_input_of_each_kind_is_dead_lettered_with_its_reason_and_good_ones_flow(
    transport,
):
    good = transition("started", event(status="Started"), vm("web-1"))
    envelope = json.loads(good.to_bytes())
    next_major = dict(envelope, schemaversion="2.0")
    foreign = dict(envelope, type="com.example.other")
    invalid = dict(envelope)
    del invalid["data"]
    stream = FleetStream(transport, "audit")
    async with stream:
        for body in (
            b"\xff not json",
            b"[1, 2]",
            json.dumps(next_major).encode(),
            json.dumps(foreign).encode(),
            json.dumps(invalid).encode(),
        ):
            await transport.publish(raw(body))
        await transport.publish(lifecycle_message(good))
        got = await collect(stream, 1)
    assert [m.id for m in got] == [good.id]
    dead = await dead_letters(transport, "audit", 5)
    reasons = [d.properties["dead_letter_reason"] for d in dead]
    assert reasons == ["not-json", "not-cloudevent", "version-mismatch", "unknown-type", "invalid"]
    assert "2.0" in str(dead[2].properties["dead_letter_description"])
    assert stream.stats.dead_lettered == 5


async def test_a_decoder_defect_costs_the_message_that_met_it_not_the_stream(
    transport, monkeypatch
):
    """The decoder promises SchemaError and nothing else; should a body meet a defect of it
    anyway (a schema version "\u00b2.1" raised ValueError before), the stream dead-letters that
    message and reads on, instead of stopping and meeting it again on every restart. A stand-in
    decoder raises here (what a defect looks like), as no known input makes the real one fail
    that way any more."""
    import consumers._stream as stream_module
    from schemas import decode as real_decode

    def flawed(body: bytes | str) -> LifecycleMessage:
        if b"defect" in (body if isinstance(body, bytes) else body.encode()):
            raise RuntimeError("a decoder defect")
        return real_decode(body)

    monkeypatch.setattr(stream_module, "decode", flawed)
    good = transition("started", event(status="Started"), vm("web-1"))
    stream = FleetStream(transport, "audit")
    async with stream:
        await transport.publish(raw(b'{"defect": true}', "poison"))
        await transport.publish(lifecycle_message(good))
        got = await collect(stream, 1)
    assert [m.id for m in got] == [good.id]
    [dead] = await dead_letters(transport, "audit", 1)
    assert dead.properties["dead_letter_reason"] == "invalid"
    assert "RuntimeError: a decoder defect" in str(dead.properties["dead_letter_description"])


async def test_an_unknown_type_of_our_own_prefix_is_skipped_not_dead_lettered(transport):
    good = heartbeat(vm("web-1"))
    newer = dict(
        json.loads(good.to_bytes()),
        type="io.github.scheduledeventsrelay.agent.metrics",
        id="newer-minor",
    )
    stream = FleetStream(transport, "audit")
    async with stream:
        await transport.publish(raw(json.dumps(newer).encode()))
        await transport.publish(lifecycle_message(good))
        got = await collect(stream, 1)
    assert [m.id for m in got] == [good.id]
    assert stream.stats.skipped_unknown == 1
    assert len(transport.broker.dead["audit"].ready) == 0


async def test_a_flood_of_unknown_types_costs_each_message_and_not_the_log_or_memory(
    transport, caplog
):
    """A newer minor's type is skipped with one warning. A sender inventing types, even with
    our prefix and before any origin check, must not get a warning (and a remembered type)
    for each one. A type name no version would send (20 KB, odd characters) is dead-lettered
    ``unknown-type``."""
    good = heartbeat(vm("web-1"))
    envelope = json.loads(good.to_bytes())
    prefix = "io.github.scheduledeventsrelay."
    invented = [prefix + f"agent.metrics-{n}" for n in range(100)]
    absurd = [prefix + "x" * 20_000 + str(n) for n in range(50)] + [prefix + "Agent Metrics!"]
    stream = FleetStream(transport, "audit")
    caplog.set_level(logging.WARNING, logger="consumers._stream")
    async with stream:
        for n, type_ in enumerate(invented + absurd):
            body = json.dumps(dict(envelope, type=type_, id=f"invented-{n}")).encode()
            await transport.publish(raw(body))
        await transport.publish(lifecycle_message(good))
        got = await collect(stream, 1)
    assert [m.id for m in got] == [good.id]
    assert stream.stats.skipped_unknown == len(invented)
    assert stream.stats.dead_lettered == len(absurd)
    dead = await dead_letters(transport, "audit", len(absurd))
    assert {d.properties["dead_letter_reason"] for d in dead} == {"unknown-type"}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) <= 25 + len(absurd), len(warnings)
    assert max(len(w) for w in warnings) < 2_000
    assert "agent.metrics-0" in warnings[0]


async def test_a_message_handled_already_reaches_the_handler_once(transport):
    stream = FleetStream(transport, "approver")
    seen: list[str] = []

    @stream.on(MessageType.SCHEDULED)
    async def scheduled(message: TransitionMessage) -> None:
        seen.append(message.id)
        if len(seen) == 2:
            stream.stop()

    first = transition("scheduled", event("EVT-1"), vm("web-1"))
    second = transition("scheduled", event("EVT-2"), vm("web-1"))
    await transport.declare_group("approver")
    for message in (first, first, first.with_sequence(7), second):  # an agent's repeats
        await transport.publish(lifecycle_message(message))
    async with asyncio.timeout(3):
        await stream.run()
    assert seen == [first.id, second.id]
    assert stream.stats.duplicates == 2


async def test_handlers_get_only_what_their_filters_ask_for(transport):
    stream = FleetStream(transport, "ops")
    reboots: list[str] = []
    web2: list[str] = []
    everything: list[MessageType] = []

    @stream.on(MessageType.STARTED, event_type="reboot")
    async def on_reboot(message: TransitionMessage) -> None:
        reboots.append(message.vm.name)

    @stream.on(vm="WEB-2", scale_set="pool")
    async def on_web2(message: TransitionMessage) -> None:
        web2.append(message.kind.value)

    @stream.on()
    async def on_any(message: TransitionMessage) -> None:
        everything.append(message.kind)
        if len(everything) == 4:
            stream.stop()

    await transport.declare_group("ops")
    msgs: list[LifecycleMessage] = [
        transition("started", event("E1", status="Started"), vm("web-1")),
        transition("started", event("E2", event_type="Freeze", status="Started"), vm("web-1")),
        transition("scheduled", event("E3"), vm("web-2", scale_set="pool")),
        heartbeat(vm("web-2", scale_set="pool")),
    ]
    for message in msgs:
        await transport.publish(lifecycle_message(message))
    async with asyncio.timeout(3):
        await stream.run()
    assert reboots == ["web-1"]
    assert web2 == ["scheduled", "agent.heartbeat"]
    assert len(everything) == 4


async def test_a_stream_filter_acks_what_it_does_not_want(transport):
    stream = FleetStream(transport, "g", filter=MessageFilter.of(resource_group="rg-db"))
    async with stream:
        await transport.publish(lifecycle_message(heartbeat(vm("web-1"))))
        wanted = heartbeat(vm("db-1", rg="rg-db"))
        await transport.publish(lifecycle_message(wanted))
        got = await collect(stream, 1)
    assert [m.id for m in got] == [wanted.id]
    assert stream.stats.filtered == 1


async def test_a_failing_handler_is_retried_then_dead_lettered_and_the_stream_goes_on(transport):
    stream = FleetStream(transport, "approver", max_attempts=3, retry_delay=0.001)
    calls: dict[str, int] = {}
    poison = transition("scheduled", event("POISON"), vm("web-1"))
    flaky = transition("scheduled", event("FLAKY"), vm("web-1"))
    after = transition("scheduled", event("AFTER"), vm("web-1"))

    @stream.on(MessageType.SCHEDULED)
    async def handle(message: TransitionMessage) -> None:
        event_id = message.data.event.event_id
        calls[event_id] = calls.get(event_id, 0) + 1
        if event_id == "POISON" and calls[event_id] == 3:
            stream.stop()  # after this last failure is settled
        if event_id == "POISON" or (event_id == "FLAKY" and calls[event_id] == 1):
            raise RuntimeError(f"cannot handle {event_id}")

    await transport.declare_group("approver")
    for message in (poison, flaky, after):
        await transport.publish(lifecycle_message(message))
    async with asyncio.timeout(5):
        await stream.run()
    assert calls == {"POISON": 3, "FLAKY": 2, "AFTER": 1}
    [dead] = await dead_letters(transport, "approver", 1)
    assert dead.properties["dead_letter_reason"] == DeadLetterReason.HANDLER_FAILED
    assert "cannot handle POISON" in str(dead.properties["dead_letter_description"])


async def test_stop_while_idle_returns_and_unhandled_messages_stay_queued(transport):
    stream = FleetStream(transport, "idle")

    @stream.on()
    async def handle(message: TransitionMessage) -> None:
        pass

    runner = asyncio.create_task(stream.run())
    await asyncio.sleep(0.05)
    stream.stop()
    async with asyncio.timeout(2):
        await runner
    await transport.publish(lifecycle_message(heartbeat(vm("web-1"))))
    assert transport.broker.depth("idle") == 1


async def test_leaving_the_iteration_with_an_error_returns_the_message(transport):
    message = heartbeat(vm("web-1"))
    await transport.declare_group("g")
    await transport.publish(lifecycle_message(message))

    async def fail_on_first() -> None:
        async with FleetStream(transport, "g") as stream:
            async for _ in stream:
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await fail_on_first()
    async with FleetStream(transport, "g") as again:
        got = await collect(again, 1)
    assert [m.id for m in got] == [message.id]


def test_the_dedupe_window_is_bounded_in_size_and_age():
    now = [0.0]
    window = DedupeWindow(size=3, ttl=10, clock=lambda: now[0])
    for name in "abcd":
        window.add(name)
    assert "a" not in window
    assert all(name in window for name in "bcd")
    now[0] = 11
    assert "b" not in window
    window.add("e")
    assert len(window) == 1


def test_the_stream_reads_every_envelope_with_the_one_decode():
    from schemas import decode

    from ._factory import hook, outcome

    ev = event("E", resources=("a", "b"))
    messages = [
        transition("scheduled", ev, vm("a")),
        heartbeat(vm("a")),
        hook(vm("a"), ev),
        outcome(vm("a"), ev, applied=False),
    ]
    for message in messages:
        body = message.to_bytes()
        assert decode(body) == message
    # A nested "type" seen first must not fool it: the envelope checks the real one.
    reordered = json.loads(messages[0].to_bytes())
    reordered = {"data": {"type": "io.github.scheduledeventsrelay.agent.online"}, **reordered}
    assert decode(json.dumps(reordered).encode()) == messages[0]


class _Commits:
    """A ``before_ack`` that records how many messages were handled at each commit."""

    def __init__(self) -> None:
        self.handled = 0
        self.at: list[int] = []
        self._committed = asyncio.Event()

    async def before_ack(self) -> None:
        self.at.append(self.handled)
        self._committed.set()

    async def wait_for(self, count: int, within: float) -> None:
        """Until a commit covered ``count`` messages."""
        async with asyncio.timeout(within):
            while not self.at or self.at[-1] < count:
                self._committed.clear()
                await self._committed.wait()


@contextlib.asynccontextmanager
async def _reading_a_backlog(
    transport, commits: _Commits, handler: Any, count: int, *, ack_max_delay: float
) -> AsyncIterator[FleetStream]:
    """A stream committing through ``commits``, running over ``count`` heartbeats waiting."""
    stream = FleetStream(
        transport,
        "approver",
        prefetch=256,
        before_ack=commits.before_ack,
        ack_max_delay=ack_max_delay,
    )
    stream.add_handler(handler)
    for index in range(count):
        await transport.publish(lifecycle_message(heartbeat(vm(f"web-{index}"))))
    task = asyncio.create_task(stream.run())
    try:
        yield stream
    finally:
        stream.stop()
        await task


async def test_a_backlog_is_committed_in_full_batches_and_a_lone_message_at_once(transport):
    """``before_ack`` (a commit) is group commit: while messages are waiting, one commit serves a
    full batch (``ack_batch``), not whatever the last 20 ms of handling gave, which made a
    durable approver commit ten times as often as needed and fall behind a fleet's burst. When
    the stream has nothing more to read, what it handled is committed at once."""
    commits = _Commits()

    async def handler(message: LifecycleMessage) -> None:
        commits.handled += 1
        await asyncio.sleep(0.001)  # a database round trip, say

    # ack_max_delay (the bound on how long a batch's first message waits behind a backlog) is
    # set long here, so that the batches' size shows whatever the machine's speed.
    async with _reading_a_backlog(transport, commits, handler, 640, ack_max_delay=5.0) as stream:
        await commits.wait_for(640, within=10)
        backlog = list(commits.at)
        await transport.publish(lifecycle_message(heartbeat(vm("web-lone"))))
        await commits.wait_for(641, within=1)
    assert stream.ack_batch == 128
    assert len(backlog) <= 6, f"{len(backlog)} commits for a backlog of 640: {backlog}"
    assert transport.broker.depth("approver") == 0


async def test_a_batch_waits_at_most_ack_max_delay_even_when_handling_never_yields(transport):
    """A handler that computes without awaiting keeps the stream from yielding to its flusher
    through a whole backlog; the batch is still committed ``ack_max_delay`` after its first
    message (a durable approver's decision is not committed, nor its approval sent, before)."""
    commits = _Commits()

    async def handler(message: LifecycleMessage) -> None:
        commits.handled += 1
        until = time.perf_counter() + 0.002
        while time.perf_counter() < until:  # 2 ms of CPU work, no await
            pass

    async with _reading_a_backlog(transport, commits, handler, 256, ack_max_delay=0.1):
        await commits.wait_for(256, within=10)
    sizes = [b - a for a, b in zip([0, *commits.at], commits.at, strict=False)]
    assert max(sizes) <= 60, f"batches of {sizes} messages at 2 ms each, 0.1 s at most"


async def test_an_idle_stream_sets_no_timer_while_it_has_nothing_to_commit(transport):
    """An idle consumer sleeps: its flusher waits until there is something to commit or ack.
    It woke every 20 ms instead, whether or not anything was handled, which cost an idle approver
    and audit about 2 % of a core each, and on a loaded machine a turn of the CPU 50 times a
    second beside the fleet's processes."""
    commits = _Commits()

    async def handler(message: LifecycleMessage) -> None:
        commits.handled += 1

    async with _reading_a_backlog(transport, commits, handler, 3, ack_max_delay=0.25):
        await commits.wait_for(3, within=5)
        await asyncio.sleep(0.1)  # the flush after the last one, and its ack
        loop = asyncio.get_running_loop()
        timers: list[float] = []
        call_at = loop.call_at

        def counting_call_at(when: float, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
            timers.append(when)
            return call_at(when, *args, **kwargs)

        loop.call_at = counting_call_at  # type: ignore[method-assign,assignment]
        try:
            await asyncio.sleep(1.0)  # one timer: this test's own
        finally:
            loop.call_at = call_at  # type: ignore[method-assign]
        assert len(timers) <= 2, f"{len(timers)} timers set in a second of idling"
        # And it still commits what comes next, at once.
        await transport.publish(lifecycle_message(heartbeat(vm("web-late"))))
        await commits.wait_for(4, within=1)
    assert transport.broker.depth("approver") == 0
