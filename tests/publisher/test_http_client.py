"""The agent's HTTP client and what it makes of IMDS's answers, byte by byte: an answer it
cannot read is a failed request (an :class:`~schemas.ImdsError`), never the agent's end. Raw
sockets on loopback (:mod:`.rawimds`) stand in for IMDS."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from publisher import Agent, AgentSettings
from publisher._imds import ImdsClient
from schemas import ImdsError
from schemas.channels import ChannelNames

from .rawimds import ok, raw_server, read_request

INSTANCE = json.dumps({"compute": {"name": "web-7", "vmId": str(uuid.uuid4())}}).encode()
DOCUMENT = json.dumps({"DocumentIncarnation": 1, "Events": []}).encode()

#: Answers no HTTP/1.1 client can read, each an IMDS bug (or a hostile proxy) could send.
GARBLED = {
    # "²00": str.isdigit() takes "²" (latin-1 0xb2), int() does not
    "superscript-status": b"HTTP/1.1 \xb200 OK\r\nContent-Length: 0\r\n\r\n",
    "long-status": b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n",
    "short-status": b"HTTP/1.1 20\r\nContent-Length: 0\r\n\r\n",
    "superscript-length": b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n",
    "huge-length": b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
    "superscript-chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\xb2\r\n",
}


def _answering(scheduled_events: bytes):  # type: ignore[no-untyped-def]
    """An IMDS that knows the VM and answers every other request with ``scheduled_events``."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head, _ = await read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            writer.write(ok(INSTANCE) if b"/metadata/instance" in head else scheduled_events)
            await writer.drain()
        writer.close()

    return handler


@pytest.mark.parametrize("answer", list(GARBLED.values()), ids=list(GARBLED))
async def test_an_answer_that_is_not_http_is_an_imds_error(answer: bytes) -> None:
    async with raw_server(_answering(answer)) as port:
        client = ImdsClient(f"http://127.0.0.1:{port}", timeout=2, first_timeout=2)
        try:
            with pytest.raises(ImdsError) as caught:
                await client.scheduled_events()
        finally:
            await client.aclose()
    assert caught.value.kind == "connection"
    assert caught.value.unanswered  # what IMDS made of the request is not known


async def test_a_garbled_status_line_is_a_failed_poll_and_the_agent_goes_on() -> None:
    """One bad answer from IMDS costs that poll: the watcher goes on polling (before, the
    ValueError of int("²00") ended the watcher, and with it the agent)."""
    async with raw_server(_answering(GARBLED["superscript-status"])) as port:
        unique = uuid.uuid4().hex[:8]
        settings = AgentSettings(
            imds_url=f"http://127.0.0.1:{port}",
            broker=f"memory://garbled-{unique}",
            channels=ChannelNames().suffixed(unique),
            state_dir=None,
            poll_interval=0.2,
            imds_first_timeout=3,
        )
        agent = Agent(settings)
        task = asyncio.create_task(agent.run())
        try:
            await asyncio.sleep(3)
            watch = [t for t in asyncio.all_tasks() if t.get_name() == "agent-watch"]
            assert not task.done(), f"the agent ended: {task.exception()!r}"
            assert watch, "the agent has no watcher"
            assert not watch[0].done(), "the watcher is gone"
            failed = agent.metrics.registry.get_sample_value(
                "agent_imds_errors_total", {"kind": "connection"}
            )
            assert (failed or 0) >= 2, "the bad answers are not failed polls"
        finally:
            agent.stop("test over")
            await asyncio.wait({task}, timeout=10)
