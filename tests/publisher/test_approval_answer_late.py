"""An event that runs and ends while this agent's POST for it is still unanswered ran: it is
reported ``completed``, never ``canceled``.

Found in a 10,000-VM run whose agents were starved of CPU: 190 Freezes that the agents' own
POSTs started were reported ``canceled``. The agent tells "ended" from "canceled" by whether it
started the event (a POST that succeeded, or went out unanswered); it recorded that only once
the POST's answer was read, and a starved agent read its next poll's answer (the event gone)
first. The intent it stores before the POST now counts: the POST may have gone out.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from publisher.simulator import EventSpec, EventState, EventType
from schemas import ChannelNames, LifecycleMessage, MessageType

from .conftest import Broker
from .harness import running, signed_approval
from .test_approvals import _outcome, _send, _web7

ANSWER_LATE = 4.0


@contextlib.asynccontextmanager
async def _answers_to_posts_held(target: str) -> AsyncIterator[str]:
    """A TCP proxy to ``target`` (an http:// URL) that passes requests at once but holds the
    answer to each POST for :data:`ANSWER_LATE` seconds: IMDS acts on the POST (the event
    starts), and its answer reaches the agent late, as the answers of a busy VM's agent do.
    The agent's URL for it is yielded."""
    split = urlsplit(target)
    host, port = split.hostname or "127.0.0.1", split.port or 80

    async def pump(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, held: list[bool], up: bool
    ) -> None:
        try:
            while chunk := await reader.read(65536):
                if up and chunk.startswith(b"POST "):
                    held[0] = True
                elif not up and held[0]:
                    held[0] = False
                    await asyncio.sleep(ANSWER_LATE)
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    tasks: set[asyncio.Task[None]] = set()

    async def serve(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(host, port)
        held = [False]
        for task in (
            asyncio.create_task(pump(client_r, server_w, held, True)),
            asyncio.create_task(pump(server_r, client_w, held, False)),
        ):
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    proxy_port = server.sockets[0].getsockname()[1]
    try:
        yield urlunsplit(split._replace(netloc=f"127.0.0.1:{proxy_port}"))
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


def _ends(messages: list[LifecycleMessage]) -> list[MessageType]:
    return [m.kind for m in messages if m.kind in (MessageType.COMPLETED, MessageType.CANCELED)]


async def test_an_event_that_ends_before_its_posts_answer_is_read_is_reported_completed(
    tmp_path: Path,
) -> None:
    unique = uuid.uuid4().hex[:6]
    broker = Broker(f"memory://late-{unique}", ChannelNames().suffixed(unique), "memory")
    # A Freeze that runs a tenth of a second once started, between two polls (every second):
    # it starts and ends well within the 4 s its POST's answer takes to come back.
    spec = EventSpec(
        event_type=EventType.FREEZE, resources=["web-7"], not_before_seconds=900, run_seconds=0.1
    )
    web7 = _web7(broker, tmp_path, spec)
    async with (
        web7 as (sim, rec, event, key, settings),
        _answers_to_posts_held(settings.imds_url) as late_url,
        running(replace(settings, imds_url=late_url, poll_interval=1.0)),
    ):
        await rec.wait_kind(MessageType.SCHEDULED, within=15)
        approval = signed_approval(sim, event.event_id, "web-7", key)
        await _send(broker, approval)
        outcome = await _outcome(rec, approval.approval_id)
        await rec.wait_for(lambda ms: bool(_ends(ms)), within=15)
    assert sim.get_event(event.event_id).state is EventState.COMPLETED
    assert _ends(rec.messages) == [MessageType.COMPLETED], "the event ran: it did not cancel"
    assert outcome.kind is MessageType.APPROVAL_APPLIED
