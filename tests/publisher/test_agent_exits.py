"""A part of the agent that fails ends the agent: ``Agent.run`` returns (with the error) so that
a supervisor (systemd) starts it again, instead of hanging with no polling and no publishing.

On Python 3.11 ``asyncio.wait_for`` returns its result and drops a cancel that arrives as the
awaited work completes; a library may also turn a cancel into an error of its own. A task
group cancels each task once when one fails, and then waits for all of them: one cancel lost
held the group, and ``Agent.run``, for ever."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

from publisher._observability import Metrics
from publisher._outbox import OutboxPublisher
from publisher._state import StateStore
from schemas import (
    AgentData,
    AgentMessage,
    MessageType,
    ReplyAddress,
    VmIdentity,
)
from schemas.channels import ChannelNames
from schemas.transport import MemoryTransport, OutgoingMessage


def _heartbeat() -> AgentMessage:
    data = AgentData(
        vm=VmIdentity(name="web-7"),
        agent_version="t",
        reply_to=ReplyAddress(channel="approvals", key="web-7"),
    )
    return AgentMessage.build(
        MessageType.AGENT_HEARTBEAT, data, observed_at=datetime.now(UTC), instance="i"
    )


async def test_a_cancel_that_comes_as_a_publish_completes_stops_the_publisher() -> None:
    """The cancel reaches the publisher in the same turn of the loop as its publish's confirm:
    the publisher stops (before, wait_for returned the confirm, the cancel was lost and the
    publisher went back to waiting for work)."""
    unique = uuid.uuid4().hex[:8]
    runner: list[asyncio.Task[None]] = []

    class CancelledAsItConfirms(MemoryTransport):
        async def publish(self, message: OutgoingMessage) -> None:
            await super().publish(message)
            runner[0].cancel()  # the confirm is in: the cancel arrives with it

    store = await StateStore.open(None)
    transport = CancelledAsItConfirms(unique, ChannelNames().suffixed(unique))
    try:
        await transport.connect()
        await store.commit([_heartbeat()])
        outbox = OutboxPublisher(store, transport, Metrics())
        runner.append(asyncio.create_task(outbox.run()))
        done, _ = await asyncio.wait(runner, timeout=5)
        assert done, "the publisher went on after its cancel"
        assert runner[0].cancelled()
    finally:
        for task in runner:
            task.cancel()
        await transport.close()
        await store.close()
