"""The agent's HTTP client and what it makes of IMDS's answers, byte by byte: an answer it
cannot read is a failed request (an :class:`~schemas.ImdsError`), never the agent's end. Raw
sockets on loopback (:mod:`.rawimds`) stand in for IMDS."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import pytest

from publisher import Agent, AgentSettings
from publisher._imds import POST_KEPT_IDLE, ImdsClient, with_retries
from publisher._poller import RequestLimiter
from schemas import ImdsError
from schemas._backoff import Backoff
from schemas.channels import ChannelNames

from .rawimds import Handler, ok, raw_server, read_request, requests

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


def _answering(scheduled_events: bytes) -> Handler:
    """An IMDS that knows the VM and answers every other request with ``scheduled_events``."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for head, _ in requests(reader):
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


async def test_every_request_imds_receives_went_through_the_limiter() -> None:
    """An IMDS that reads a request on a kept connection and drops it unanswered may have acted
    on it: the client does not send it again behind the limiter's back (before, IMDS received
    4 requests in one second against the agent's budget of 2). A poll is asked again on a new
    connection, through the limiter, as a request of its own."""
    received: list[float] = []
    dropped: list[float] = []

    async def answer_first_then_drop(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        # Answers the first request of each connection and keeps it; reads the next one and
        # drops the connection without a byte of answer.
        await read_request(reader)
        received.append(time.monotonic())
        writer.write(ok(DOCUMENT))
        await writer.drain()
        try:
            await read_request(reader)
            received.append(time.monotonic())
            dropped.append(received[-1])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    sent: list[str] = []
    failed: list[ImdsError] = []
    async with raw_server(answer_first_then_drop) as port:
        client = ImdsClient(
            f"http://127.0.0.1:{port}", timeout=2, first_timeout=2, on_request=sent.append
        )
        try:
            began = time.monotonic()
            while time.monotonic() - began < 3.0:
                try:
                    await client.scheduled_events()
                except ImdsError as exc:
                    failed.append(exc)
        finally:
            await client.aclose()
    peak = max(sum(1 for t in received if s <= t < s + 1.0) for s in received)
    assert len(received) == len(sent), f"IMDS received {len(received)}, the limiter let {sent}"
    assert peak <= 2, f"IMDS received {peak} requests in one second"
    assert dropped, "no request was dropped"
    assert not failed, f"a poll asked again on a new connection still failed: {failed[:1]}"


@pytest.mark.parametrize("idle", [0.0, 1.5], ids=["kept-connection", "own-connection"])
async def test_a_post_imds_received_and_dropped_may_have_started(idle: float) -> None:
    """A POST StartRequests that went out whole and got no answer may have started the event,
    even when IMDS takes no new connection after (before, the client sent it again, the new
    connection was refused, and the POST was reported as never sent): on the connection the
    last poll left a moment ago, as on one of its own (the poll's sat idle ``idle`` s)."""
    posts: list[bytes] = []
    connections: list[int] = []
    servers: list[asyncio.Server] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(connections))
        try:
            async for head, body in requests(reader):
                if head.startswith(b"GET"):  # answered, the connection kept
                    writer.write(ok(DOCUMENT))
                    await writer.drain()
                    continue
                servers[0].close()  # IMDS goes away for new connections
                posts.append(body)  # the POST arrived whole...
                break
        finally:
            writer.close()  # ...and the connection drops before any answer

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    servers.append(server)
    port = server.sockets[0].getsockname()[1]
    client = ImdsClient(f"http://127.0.0.1:{port}", timeout=2, first_timeout=2)
    try:
        await client.scheduled_events()
        await asyncio.sleep(idle)
        with pytest.raises(ImdsError) as caught:
            await client.start_events(["E1"])
    finally:
        await client.aclose()
        server.close()
    assert len(posts) == 1
    assert b"StartRequests" in posts[0]
    assert len(connections) == (1 if idle < POST_KEPT_IDLE else 2)
    assert caught.value.unanswered, f"a POST IMDS received is reported never sent: {caught.value}"


async def test_a_post_goes_on_the_polls_connection_unless_it_sat_idle() -> None:
    """An approval's POST mostly follows the poll it was checked on by a moment: it goes on that
    poll's connection (before, every POST opened one of its own: in a 2,000-VM fleet run on
    one machine that was about a second of a POST's 1.4-2.3 s, p50, in agents whose loop ran
    late). On a connection idle longer than ``POST_KEPT_IDLE`` (IMDS may be letting it go just
    then, and a POST is never sent twice) it goes on a new one, kept for the next poll."""
    seen: list[list[bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        mine: list[bytes] = []
        seen.append(mine)
        try:
            async for head, _ in requests(reader):
                mine.append(head.split(b" ", 1)[0])
                writer.write(ok(DOCUMENT if head.startswith(b"GET") else b""))
                await writer.drain()
        finally:
            writer.close()

    async with raw_server(handler) as port:
        # This test is about connections, not the VM's budget.
        client = ImdsClient(
            f"http://127.0.0.1:{port}", timeout=2, first_timeout=2, limiter=RequestLimiter(10)
        )
        try:
            await client.scheduled_events()
            await client.start_events(["E1"])  # right after the poll: on its connection
            await client.scheduled_events()
            await asyncio.sleep(POST_KEPT_IDLE + 0.3)
            await client.start_events(["E2"])  # the poll's connection sat idle: a new one
            await client.scheduled_events()  # on the POST's: no third connection
        finally:
            await client.aclose()
    assert seen == [[b"GET", b"POST", b"GET"], [b"POST", b"GET"]]


#: 2xx answers to a POST whose body the agent cannot or will not read.
TAKEN = {
    "200-large": b"HTTP/1.1 200 OK\r\nContent-Length: 2000000\r\n\r\n" + b" " * 2_000_000,
    "200-large-chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    + (b"10000\r\n" + b" " * 0x10000 + b"\r\n") * 20
    + b"0\r\n\r\n",
    "200-large-to-close": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b" " * 2_000_000,
    "200-garbled-chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "202-empty": b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n",
    "204": b"HTTP/1.1 204 No Content\r\n\r\n",
}


@pytest.mark.parametrize("answer", list(TAKEN.values()), ids=list(TAKEN))
async def test_a_post_answered_2xx_is_taken_whatever_its_body(answer: bytes) -> None:
    """A POST StartRequests that IMDS answers with a 2xx was taken, whatever the body that comes
    with it (the agent reads no more of it than it takes of any answer). Before, a 200 with a
    body over the 1 MiB the agent reads was a failure (too-large): POSTed twice more, all
    answered 200, and the approval reported imds-refused."""
    posts = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal posts
        while True:
            try:
                await read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            posts += 1
            writer.write(answer)
            try:
                await writer.drain()
            except ConnectionError:
                break
            if b"close" in answer:
                break
        writer.close()

    errors: list[ImdsError] = []
    async with raw_server(handler) as port:
        client = ImdsClient(f"http://127.0.0.1:{port}", timeout=3, first_timeout=3)
        try:
            # as ApprovalHandler._apply calls it
            await with_retries(
                lambda: client.start_events(["E1"]),
                what="POST StartRequests",
                backoff=Backoff(0.01, 0.02),
                attempts=3,
                on_error=errors.append,
            )
        finally:
            await client.aclose()
    assert not errors, [(e.kind, e.status, str(e)) for e in errors]
    assert posts == 1


def stall(seconds: float) -> None:
    """The event loop does nothing for ``seconds``, as a loaded VM's agent's may: what arrives
    on its sockets meanwhile (a connection closed by IMDS) is noticed only after."""
    time.sleep(seconds)


async def test_a_poll_on_a_connection_imds_let_go_while_the_agent_was_stalled_is_asked_again() -> (
    None
):
    """IMDS closes a connection left idle past its keep-alive; an agent whose event loop stalled
    (a VM under load, just when maintenance comes) finds out only by sending its next poll on
    it. That poll is asked again at once on a new connection, through the limiter (IMDS counts
    it), instead of failing, warning and backing off: a Freeze starts and ends within seconds.
    A POST, never sent twice (IMDS may have read it: see the tests above), goes on a connection
    of its own after such a stall (the kept one sat idle past ``POST_KEPT_IDLE``): before, it
    failed as "may have been taken" and the approval was looked at again and POSTed again after
    a backoff."""
    received: list[bytes] = []

    async def keep_alive_one_second(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            while True:
                try:
                    async with asyncio.timeout(1.0):  # the server's keep-alive
                        head, _ = await read_request(reader)
                except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                    break
                received.append(head.split(b" ", 2)[0])
                writer.write(ok(DOCUMENT))
                await writer.drain()
        finally:  # also when the thread's loop ends and cancels it: closed in that loop
            writer.close()

    # IMDS in a thread of its own: the test stalls its own loop, as a loaded agent's stalls.
    ready: asyncio.Queue[int] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    stop = threading.Event()

    def serve() -> None:
        async def main() -> None:
            async with raw_server(keep_alive_one_second) as port:
                loop.call_soon_threadsafe(ready.put_nowait, port)
                await asyncio.to_thread(stop.wait)

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    sent: list[str] = []
    try:
        port = await asyncio.wait_for(ready.get(), 5)
        client = ImdsClient(
            f"http://127.0.0.1:{port}", timeout=2, first_timeout=2, on_request=sent.append
        )
        try:
            await client.scheduled_events()
            stall(1.5)  # IMDS lets the idle connection go meanwhile
            document = await client.scheduled_events()
            assert document.events == ()
            stall(1.5)
            await client.start_events(["E1"])  # taken: not sent on the connection let go
        finally:
            await client.aclose()
    finally:
        stop.set()
        thread.join(5)
    # The first poll, the second on a new connection, the POST on one of its own.
    assert received == [b"GET", b"GET", b"POST"]
    # Both polls, the second's retry and the POST went through the limiter.
    assert sent == ["scheduledevents"] * 4
