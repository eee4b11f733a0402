"""Small helpers the transport tests share: messages to send, bounded receives."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from schemas.transport import Delivery, OutgoingMessage

__all__ = ["assert_nothing", "outgoing", "receive"]


def outgoing(
    body: str = "hello",
    *,
    routing_key: str = "scheduled.Reboot.vm-1",
    properties: dict[str, str | int | float | bool] | None = None,
    ttl_seconds: float | None = None,
) -> OutgoingMessage:
    return OutgoingMessage(
        body=body.encode(),
        message_id=uuid.uuid4().hex,
        content_type="application/json",
        routing_key=routing_key,
        properties=properties or {"vm": "vm-1"},
        ttl_seconds=ttl_seconds,
    )


async def receive(subscription: Any, within: float = 5.0) -> Delivery:
    """The next delivery, or a test failure after ``within`` seconds."""
    try:
        async with asyncio.timeout(within):
            delivery: Delivery = await anext(subscription)
    except TimeoutError:
        raise AssertionError(f"no message within {within} s") from None
    return delivery


async def assert_nothing(subscription: Any, seconds: float = 0.5) -> None:
    """Nothing arrives within ``seconds`` (the subscription must already be started)."""
    task = asyncio.ensure_future(anext(subscription))
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if done:
        delivery = task.result()
        raise AssertionError(f"unexpected message {delivery.message_id}: {delivery.body!r}")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
