"""IMDS cannot crash, stall, swell or fool the agent: poison bodies are failed polls, a dripping
answer fails at the request's deadline, a huge one is refused as it arrives, an older document
(a lagging answer, a reset) is held back instead of diffed, and one malformed field does not
hide the other events. The simulator over HTTP, the in-memory broker."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from publisher.simulator import EventSpec, EventType, FaultSpec, Simulator
from schemas import MessageType
from schemas.channels import ChannelNames

from .harness import Recorder, eventually, recorder, running, settings_for, simulator_server


def _broker() -> tuple[str, ChannelNames]:
    unique = uuid.uuid4().hex[:8]
    return f"memory://hostile-{unique}", ChannelNames().suffixed(unique)


def _transitions(rec: Recorder, event_id: str) -> list[str]:
    return [m.kind.value for m in rec.transitions() if m.subject == event_id]


def _answer_always(sim: Simulator, document: dict[str, Any]) -> None:
    """From now on IMDS answers web-7 with ``document``, as sent (a fault's body)."""
    sim.clear_faults()
    sim.add_fault(
        FaultSpec(vm="web-7", endpoint="scheduledevents", body=json.dumps(document), times=10_000)
    )


def _freeze_document(sim: Simulator, incarnation: int, **fields: str) -> dict[str, Any]:
    """web-7's document, of this incarnation, with only its first event, changed by ``fields``
    (its ``EventId``, its ``NotBefore``...)."""
    template = sim.scheduled_events_document("web-7")
    event = dict(template["Events"][0], **fields)
    return dict(template, DocumentIncarnation=incarnation, Events=[event])


@pytest.mark.parametrize(
    "body",
    ["[" * 100_000, '{"DocumentIncarnation": 1, "Events": ' + "[" * 50_000, "\x00" * 1000, "{}"],
    ids=["deep-brackets", "deep-events", "nul-bytes", "no-events"],
)
async def test_a_poison_body_is_a_failed_poll_and_the_agent_goes_on(
    body: str, tmp_path: Path
) -> None:
    broker, channels = _broker()
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        sim = server.simulator
        settings = settings_for(server, "web-7", broker, channels, tmp_path, poll_interval=0.2)
        async with running(settings) as agent:
            sim.add_fault(FaultSpec(vm="web-7", endpoint="scheduledevents", body=body, times=3))
            await eventually(lambda: not sim.faults(), 10)
            event = sim.add_event(EventSpec(event_type=EventType.FREEZE, not_before_seconds=900))
            await rec.wait_kind(MessageType.SCHEDULED, within=10)
            errors = agent.metrics.registry.get_sample_value(
                "agent_imds_errors_total", {"kind": "garbage"}
            )
    assert errors == 3
    assert _transitions(rec, event.event_id) == ["scheduled"]  # nothing else invented


async def test_a_dripping_answer_fails_at_the_deadline_not_after_every_byte(
    tmp_path: Path,
) -> None:
    """One byte every 2 s restarted the per-read timeout for over 150 s: now the whole request
    has one deadline (imds_timeout)."""
    broker, channels = _broker()
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        sim = server.simulator
        settings = settings_for(
            server, "web-7", broker, channels, tmp_path, imds_timeout=1.0, poll_interval=0.2
        )
        async with running(settings) as agent:
            sim.add_fault(
                FaultSpec(vm="web-7", endpoint="scheduledevents", drip_seconds=2.0, times=1)
            )
            began = time.monotonic()
            await eventually(
                lambda: (
                    (
                        agent.metrics.registry.get_sample_value(
                            "agent_imds_errors_total", {"kind": "timeout"}
                        )
                        or 0
                    )
                    >= 1
                ),
                10,
            )
            failed_after = time.monotonic() - began
            event = sim.add_event(EventSpec(event_type=EventType.FREEZE, not_before_seconds=900))
            await rec.wait_kind(MessageType.SCHEDULED, within=10)
    assert failed_after < 3.0, failed_after
    assert _transitions(rec, event.event_id) == ["scheduled"]


async def test_a_huge_answer_is_refused_as_it_arrives_and_memory_stays_flat(
    tmp_path: Path,
) -> None:
    """A 50 MB body took the agent from 58 MB to 673 MB: now it is cut off at 1 MiB. The agent
    runs as its own process so its memory is its own."""
    broker, _ = _broker()
    async with simulator_server("web-7", rate_limit=0) as server:
        sim = server.simulator
        log = tmp_path / "agent.log"
        with log.open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "publisher",
                "--imds-url", server.vm_url("web-7"), "--broker", broker,
                "--state-dir", str(tmp_path / "state"), "--poll-interval", "0.3",
                "--imds-first-timeout", "5",
                stdout=asyncio.subprocess.DEVNULL, stderr=stderr,
                env={k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_EVENTS")},
            )  # fmt: skip
        try:
            await eventually(lambda: "agent ready" in log.read_text(), 30)
            agent = psutil.Process(process.pid)
            before = agent.memory_info().rss
            sim.add_fault(FaultSpec(vm="web-7", endpoint="scheduledevents", huge_mb=50, times=3))
            peak = before
            async with asyncio.timeout(30):
                while sim.faults():
                    peak = max(peak, agent.memory_info().rss)
                    await asyncio.sleep(0.02)
            await eventually(lambda: "1048576 taken" in log.read_text(), 10)
            await asyncio.sleep(0.5)
            peak = max(peak, agent.memory_info().rss)
            assert process.returncode is None, log.read_text()
        finally:
            process.terminate()
            await process.wait()
    assert (peak - before) / 2**20 < 15, f"{(peak - before) / 2**20:.1f} MiB more"


async def test_an_older_document_is_held_back_and_invents_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """IMDS served inc 3 (Started), then inc 2 (Scheduled) for a while, then inc 3 again: no
    second ``started``, no ``completed`` while it runs, and its real end later, once."""
    broker, channels = _broker()
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        sim = server.simulator
        settings = settings_for(server, "web-7", broker, channels, tmp_path, poll_interval=0.2)
        async with running(settings):
            event = sim.add_event(
                EventSpec(event_type=EventType.REBOOT, not_before_seconds=900, run_seconds=900)
            )
            await rec.wait_kind(MessageType.SCHEDULED)
            sim.start_event(event.event_id)
            await rec.wait_kind(MessageType.STARTED)
            with caplog.at_level(logging.WARNING, logger="publisher._watch"):
                sim.add_fault(FaultSpec(vm="web-7", endpoint="scheduledevents", stale=1, times=5))
                await eventually(lambda: not sim.faults(), 10)
                await asyncio.sleep(0.6)  # a few polls of the real document again
            sim.complete_event(event.event_id)
            await rec.wait_kind(MessageType.COMPLETED)
            await asyncio.sleep(0.5)
    assert _transitions(rec, event.event_id) == ["scheduled", "started", "completed"]
    assert "held back" in caplog.text


async def test_a_reset_to_nothing_is_not_taken_on_one_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Incarnation 0 with no events for a moment must not cancel every event; only a reset that
    persists (stale_polls over stale_seconds) is taken, and the log says so."""
    broker, channels = _broker()
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        sim = server.simulator
        settings = settings_for(
            server,
            "web-7",
            broker,
            channels,
            tmp_path,
            poll_interval=0.2,
            stale_polls=3,
            stale_seconds=1.5,
        )
        async with running(settings):
            events = [
                sim.add_event(EventSpec(event_type=EventType.FREEZE, not_before_seconds=900))
                for _ in range(3)
            ]
            await rec.wait_kind(MessageType.SCHEDULED, 3)
            sim.add_fault(FaultSpec(vm="web-7", endpoint="scheduledevents", reset=True, times=2))
            await eventually(lambda: not sim.faults(), 10)
            await asyncio.sleep(1.0)
            assert not rec.of(MessageType.CANCELED)  # a moment of nothing: held back
            with caplog.at_level(logging.WARNING, logger="publisher._watch"):
                sim.add_fault(
                    FaultSpec(vm="web-7", endpoint="scheduledevents", reset=True, times=40)
                )
                await rec.wait_kind(MessageType.CANCELED, 3, within=15)
    assert "taken as a reset of IMDS" in caplog.text
    assert sorted(m.subject or "" for m in rec.of(MessageType.CANCELED)) == sorted(
        e.event_id for e in events
    )


async def test_one_malformed_not_before_does_not_hide_the_other_events(tmp_path: Path) -> None:
    broker, channels = _broker()
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        sim = server.simulator
        settings = settings_for(server, "web-7", broker, channels, tmp_path, poll_interval=0.2)
        good = sim.add_event(EventSpec(event_type=EventType.FREEZE, not_before_seconds=900))
        document = sim.scheduled_events_document("web-7")
        bad = dict(document["Events"][0], EventId=str(uuid.uuid4()).upper(), NotBefore="soon")
        document["Events"].append(bad)
        document["DocumentIncarnation"] += 1
        _answer_always(sim, document)
        async with running(settings):
            await rec.wait_kind(MessageType.SCHEDULED, 2)
    by_id = {m.subject: m for m in rec.of(MessageType.SCHEDULED)}
    assert set(by_id) == {good.event_id, bad["EventId"]}
    carried = by_id[bad["EventId"]].data.event  # type: ignore[union-attr]
    assert carried is not None
    assert carried.not_before_text == "soon"
    assert not carried.not_before_valid


async def test_a_huge_malformed_not_before_is_carried_and_not_written_whole_to_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A NotBefore of 100,000 characters fits in a document the contract accepts: the event is
    published as sent, and the agent's warning quotes the start of it, not all of it."""
    broker, channels = _broker()
    caplog.set_level(logging.WARNING, logger="publisher._watch")
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        sim = server.simulator
        settings = settings_for(server, "web-7", broker, channels, tmp_path, poll_interval=0.2)
        sim.add_event(EventSpec(event_type=EventType.FREEZE, not_before_seconds=900))
        _answer_always(sim, _freeze_document(sim, 100, NotBefore="x" * 100_000))
        async with running(settings):
            await rec.wait_kind(MessageType.SCHEDULED, 1)
    (published,) = rec.of(MessageType.SCHEDULED)
    assert published.data.event.not_before_text == "x" * 100_000  # type: ignore[union-attr]
    warned = [r.getMessage() for r in caplog.records if "is not a date" in r.getMessage()]
    assert len(warned) == 1
    assert "100000 characters" in warned[0]
    assert len(warned[0]) < 1_000


async def test_a_bad_not_before_is_warned_about_while_listed_and_forgotten_once_gone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent warns once about an event whose NotBefore is not a date, and remembers that it
    did only while IMDS lists the event: an IMDS that keeps listing new such events must not
    grow the agent's memory for ever. So an event that comes back after it went is warned about
    again."""
    broker, channels = _broker()
    caplog.set_level(logging.WARNING, logger="publisher._watch")
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        sim = server.simulator
        settings = settings_for(server, "web-7", broker, channels, tmp_path, poll_interval=0.2)
        sim.add_event(EventSpec(event_type=EventType.FREEZE, not_before_seconds=900))
        first, second = (str(uuid.uuid4()).upper() for _ in range(2))

        def serve(event_id: str, incarnation: int) -> None:
            _answer_always(
                sim, _freeze_document(sim, incarnation, EventId=event_id, NotBefore="soon")
            )

        serve(first, 100)
        async with running(settings):
            await rec.wait_kind(MessageType.SCHEDULED, 1)
            serve(second, 101)  # the first is gone
            await rec.wait_kind(MessageType.SCHEDULED, 2)
            serve(first, 102)  # and back
            await rec.wait_kind(MessageType.SCHEDULED, 3)
    warned = [r.getMessage() for r in caplog.records if "is not a date" in r.getMessage()]
    assert [first in w for w in warned] == [True, False, True], warned


async def test_an_imds_error_says_whether_the_request_may_have_been_taken() -> None:
    """A POST StartRequests that went out and got no answer may have started the event; one
    that never went out, or that IMDS answered with an error, did not. Raw sockets on loopback
    stand in for the three ways IMDS can fail a request."""
    from publisher._imds import ImdsClient
    from schemas import ImdsError

    async def close_after_reading(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    done = asyncio.Event()

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await reader.readuntil(b"\r\n\r\n")
        await done.wait()
        writer.close()

    async def answer_503(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def failure(handler: object | None) -> ImdsError:
        done.clear()
        if handler is None:  # a port nothing listens on
            probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
            port = probe.sockets[0].getsockname()[1]
            probe.close()
            await probe.wait_closed()
            server = None
        else:
            server = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
            port = server.sockets[0].getsockname()[1]
        client = ImdsClient(f"http://127.0.0.1:{port}", timeout=0.5, first_timeout=0.5)
        try:
            with pytest.raises(ImdsError) as caught:
                await client.start_events(["E1"])
            return caught.value
        finally:
            await client.aclose()
            done.set()
            if server is not None:
                server.close()
                await server.wait_closed()

    refused = await failure(None)
    assert (refused.kind, refused.unanswered) == ("connection", False)
    dropped = await failure(close_after_reading)
    assert (dropped.kind, dropped.unanswered) == ("connection", True)
    timed_out = await failure(never_answer)
    assert (timed_out.kind, timed_out.unanswered) == ("timeout", True)
    answered = await failure(answer_503)
    assert answered.unanswered is False


async def test_a_long_document_or_a_nul_in_one_event_does_not_hide_this_vms_events(
    tmp_path: Path,
) -> None:
    """The document was read with the message contract's checks: at most 256 KiB (IMDS answers
    up to ``--imds-max-body``, 1 MiB) and no U+0000 anywhere. A placement group's document
    listing many neighbours' events, or one Description with a NUL in it, was garbage: the
    agent saw no event at all. Now the document is bounded by what the agent reads, and a NUL
    in a text is carried as U+FFFD (no consumer can store a NUL)."""
    broker, channels = _broker()
    async with simulator_server("web-7") as server, recorder(broker, channels) as rec:
        sim = server.simulator
        settings = settings_for(server, "web-7", broker, channels, tmp_path, poll_interval=0.2)
        mine = sim.add_event(EventSpec(event_type=EventType.FREEZE, not_before_seconds=900))
        document = sim.scheduled_events_document("web-7")
        own = document["Events"][0]
        own["Description"] = "Host\u0000maintenance"
        neighbour = dict(own, Resources=["web-8"], Description="x" * 1000)
        for _ in range(400):  # about 460 KB in all
            document["Events"].append(dict(neighbour, EventId=str(uuid.uuid4()).upper()))
        document["DocumentIncarnation"] += 1
        assert len(json.dumps(document)) > 400_000
        _answer_always(sim, document)
        async with running(settings):
            await rec.wait_kind(MessageType.SCHEDULED, 1)
    [scheduled] = rec.of(MessageType.SCHEDULED)
    assert scheduled.subject == mine.event_id
    carried = scheduled.data.event  # type: ignore[union-attr]
    assert carried is not None
    assert carried.description == "Host\ufffdmaintenance"
