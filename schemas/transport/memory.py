"""The in-memory transport: a real broker inside one process, for the demo and for tests.

Same semantics as the networked ones: each consumer group gets its own copy of the stream,
the consumers of a group compete, a retried message comes back with ``delivery_count + 1``, an
unsettled one returns to its queue when its consumer closes, dead letters keep their reason and
name the original sender. What is published while no group exists is kept (RabbitMQ's
catch-all queue) and handed, unchanged, to the first group declared. A message over
:attr:`MemoryBroker.max_message_bytes` is refused for good (:class:`MessageRefused`), as Service
Bus refuses one over 256 KB. Transports opened on the same URL (``memory://NAME``) share one
broker; nothing survives the process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar

from .._errors import MessageRefused, TransportError
from ..channels import DEFAULT_CHANNELS, ChannelNames, ReplyAddress
from ._base import AsyncResource, OutgoingMessage, PropertyValue

__all__ = [
    "DEAD_LETTER_DESCRIPTION",
    "DEAD_LETTER_REASON",
    "ORIGINAL_SENDER",
    "MemoryBroker",
    "MemoryTransport",
]

log = logging.getLogger(__name__)

DEAD_LETTER_REASON = "dead_letter_reason"
DEAD_LETTER_DESCRIPTION = "dead_letter_description"
#: A dead letter's property naming who published the original (its ``sender``), where known.
ORIGINAL_SENDER = "original_sender"
#: A transient subscription's own queue is named ``<group><TRANSIENT_INFIX><id>``.
TRANSIENT_INFIX = ".transient."


@dataclass(slots=True)
class _Stored:
    message: OutgoingMessage
    delivery_count: int = 0
    expires_at: float | None = None
    #: The user of the transport that published it (``memory://USER@NAME``).
    sender: str | None = None


@dataclass(slots=True)
class _Queue:
    name: str
    ready: deque[_Stored] = field(default_factory=deque)
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)
    active_exclusive: object | None = None
    exclusive_waiters: deque[asyncio.Future[None]] = field(default_factory=deque)

    def put(self, stored: _Stored, *, front: bool = False) -> None:
        if front:
            self.ready.appendleft(stored)
        else:
            self.ready.append(stored)
        self._wake(self.waiters)

    def take(self) -> _Stored | None:
        now = time.monotonic()
        while self.ready:
            stored = self.ready.popleft()
            if stored.expires_at is not None and stored.expires_at <= now:
                log.debug(
                    "memory queue %s: message %s expired", self.name, stored.message.message_id
                )
                continue
            return stored
        return None

    async def get(self) -> _Stored:
        while True:
            stored = self.take()
            if stored is not None:
                return stored
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)

    async def acquire_exclusive(self, owner: object) -> None:
        while self.active_exclusive is not None and self.active_exclusive is not owner:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.exclusive_waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self.exclusive_waiters:
                    self.exclusive_waiters.remove(waiter)
        self.active_exclusive = owner

    def release_exclusive(self, owner: object) -> None:
        if self.active_exclusive is owner:
            self.active_exclusive = None
            self._wake(self.exclusive_waiters)

    @staticmethod
    def _wake(waiters: deque[asyncio.Future[None]]) -> None:
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class MemoryBroker:
    """The shared state behind every :class:`MemoryTransport` opened on one name."""

    _registry: ClassVar[dict[str, MemoryBroker]] = {}

    def __init__(self, name: str, *, max_message_bytes: int = 256 * 1024) -> None:
        self.name = name
        #: The largest body taken; a larger one is refused, as Service Bus Standard does.
        self.max_message_bytes = max_message_bytes
        #: Every copy of the stream: the groups' queues and the transient subscriptions' ones.
        self.groups: dict[str, _Queue] = {}
        self.dead: dict[str, _Queue] = {}
        self.vms: dict[str, _Queue] = {}
        #: What was published while no queue took the stream, for the first group declared.
        self.unrouted = _Queue("unrouted")
        self.published = 0
        self.transient_count = 0

    @classmethod
    def named(cls, name: str) -> MemoryBroker:
        broker = cls._registry.get(name)
        if broker is None:
            broker = cls._registry[name] = MemoryBroker(name)
        return broker

    @classmethod
    def discard(cls, name: str) -> None:
        cls._registry.pop(name, None)

    def group(self, group: str) -> _Queue:
        queue = self.groups.get(group)
        if queue is None:
            queue = self.groups[group] = _Queue(f"group:{group}")
            self.dead[group] = _Queue(f"dead:{group}")
            self._release_unrouted()
        return queue

    def route(self, stored: _Stored) -> None:
        """A copy for every queue of the stream; kept aside when there is none."""
        queues = list(self.groups.values())
        if not queues:
            self.unrouted.put(stored)
            return
        for queue in queues:
            queue.put(replace(stored))

    def _release_unrouted(self) -> None:
        # A group exists now: what waited goes to the stream as it was published.
        kept = len(self.unrouted.ready)
        if kept:
            log.info("memory broker %s: %d message(s) kept for the first group", self.name, kept)
        while (stored := self.unrouted.take()) is not None:
            self.route(stored)

    def vm(self, vm: str) -> _Queue:
        key = vm.casefold()
        queue = self.vms.get(key)
        if queue is None:
            queue = self.vms[key] = _Queue(f"vm:{vm}")
        return queue

    def depth(self, group: str) -> int:
        queue = self.groups.get(group)
        return 0 if queue is None else len(queue.ready)


class _MemoryDelivery:
    def __init__(self, subscription: _MemorySubscription, stored: _Stored) -> None:
        self._subscription = subscription
        self._stored = stored
        self._settled = False

    @property
    def body(self) -> bytes:
        return self._stored.message.body

    @property
    def message_id(self) -> str:
        return self._stored.message.message_id

    @property
    def content_type(self) -> str:
        return self._stored.message.content_type

    @property
    def routing_key(self) -> str:
        return self._stored.message.routing_key

    @property
    def properties(self) -> Mapping[str, PropertyValue]:
        return self._stored.message.properties

    @property
    def delivery_count(self) -> int:
        return self._stored.delivery_count

    @property
    def sender(self) -> str | None:
        return self._stored.sender

    def _settle(self) -> None:
        if self._settled:
            raise TransportError(f"message {self.message_id} was settled already")
        self._settled = True
        self._subscription.unsettled.discard(self)

    async def ack(self) -> None:
        self._settle()

    async def retry(self) -> None:
        self._settle()
        self._stored.delivery_count += 1
        self._subscription.queue.put(self._stored)

    async def dead_letter(self, reason: str, description: str) -> None:
        self._settle()
        dead = self._subscription.dead_queue
        if dead is None:
            log.warning(
                "message %s dead-lettered from %s, which has no dead-letter queue: dropped (%s)",
                self.message_id,
                self._subscription.queue.name,
                reason,
            )
            return
        properties = dict(self._stored.message.properties)
        properties[DEAD_LETTER_REASON] = reason
        properties[DEAD_LETTER_DESCRIPTION] = description
        # The sender the broker knows, never a property of that name the publisher wrote.
        properties.pop(ORIGINAL_SENDER, None)
        if self._stored.sender is not None:
            properties[ORIGINAL_SENDER] = self._stored.sender
        dead.put(
            _Stored(
                replace(self._stored.message, properties=properties), sender=self._stored.sender
            )
        )

    def release(self) -> None:
        """The consumer went away without settling: the message goes back, like on a broker."""
        if not self._settled:
            self._settled = True
            self._stored.delivery_count += 1
            self._subscription.queue.put(self._stored, front=True)


class _MemorySubscription(AsyncResource):
    def __init__(self, queue: _Queue, dead_queue: _Queue | None, *, exclusive: bool) -> None:
        self.queue = queue
        self.dead_queue = dead_queue
        self.exclusive = exclusive
        self.unsettled: set[_MemoryDelivery] = set()
        #: Called once on close (a transient subscription removes its queue).
        self.on_close: Callable[[], object] | None = None
        self._closed = False

    def __aiter__(self) -> AsyncIterator[_MemoryDelivery]:
        return self

    async def __anext__(self) -> _MemoryDelivery:
        if self._closed:
            raise StopAsyncIteration
        if self.exclusive:
            await self.queue.acquire_exclusive(self)
        stored = await self.queue.get()
        if self._closed:  # closed while waiting: leave the message for the others
            self.queue.put(stored, front=True)
            raise StopAsyncIteration
        delivery = _MemoryDelivery(self, stored)
        self.unsettled.add(delivery)
        return delivery

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for delivery in list(self.unsettled):
            delivery.release()
        self.unsettled.clear()
        if self.exclusive:
            self.queue.release_exclusive(self)
        if self.on_close is not None:
            self.on_close()


class MemoryTransport(AsyncResource):
    """The :class:`~schemas.transport.Transport` of one process: ``memory://NAME``, or
    ``memory://USER@NAME`` to publish as ``USER`` (each delivery's ``sender``, as RabbitMQ's
    ``user_id``)."""

    name = "memory"

    def __init__(
        self,
        broker: str | MemoryBroker = "default",
        channels: ChannelNames = DEFAULT_CHANNELS,
        *,
        user: str | None = None,
    ) -> None:
        self.broker = broker if isinstance(broker, MemoryBroker) else MemoryBroker.named(broker)
        self.channels = channels
        self.user = user
        self._connected = False
        self._subscriptions: set[_MemorySubscription] = set()

    async def connect(self) -> None:
        self._connected = True

    async def close(self) -> None:
        self._connected = False
        for subscription in list(self._subscriptions):
            await subscription.close()
        self._subscriptions.clear()

    def _check(self) -> None:
        if not self._connected:
            raise TransportError("the memory transport is not connected (use `async with`)")

    @property
    def link_down_for(self) -> float | None:
        """Always None: the memory broker is in the process."""
        return None

    def reply_address(self, vm: str) -> ReplyAddress:
        return ReplyAddress(channel=self.channels.approvals_exchange, key=vm)

    def _check_size(self, message: OutgoingMessage) -> None:
        limit = self.broker.max_message_bytes
        if len(message.body) > limit:
            raise MessageRefused(
                f"message {message.message_id} has {len(message.body)} bytes; the memory broker "
                f"takes at most {limit}"
            )

    async def publish(self, message: OutgoingMessage) -> None:
        self._check()
        self._check_size(message)
        self.broker.published += 1
        self.broker.route(_Stored(message, sender=self.user))

    async def send_approval(self, to: ReplyAddress, message: OutgoingMessage) -> None:
        self._check()
        self._check_size(message)
        expires = None if message.ttl_seconds is None else time.monotonic() + message.ttl_seconds
        self.broker.vm(to.key).put(_Stored(message, expires_at=expires, sender=self.user))

    async def declare_group(self, group: str, *, exclusive: bool | None = None) -> None:
        self._check()
        self.broker.group(group)

    def _open(self, queue: _Queue, dead: _Queue | None, *, exclusive: bool) -> _MemorySubscription:
        self._check()
        subscription = _MemorySubscription(queue, dead, exclusive=exclusive)
        self._subscriptions.add(subscription)
        return subscription

    def subscribe(
        self, group: str, *, prefetch: int = 64, exclusive: bool = False, transient: bool = False
    ) -> _MemorySubscription:
        """``transient``: a copy of the stream of this subscription's own (``group`` names it,
        as ``<group>.transient.<n>``), which goes away when the subscription closes; what it
        dead-letters is dropped."""
        if transient:
            self._check()
            self.broker.transient_count += 1
            name = f"{group}{TRANSIENT_INFIX}{self.broker.transient_count}"
            queue = self.broker.groups[name] = _Queue(f"group:{name}")
            subscription = self._open(queue, None, exclusive=False)
            subscription.on_close = lambda: self.broker.groups.pop(name, None)
            return subscription
        queue = self.broker.group(group)
        return self._open(queue, self.broker.dead[group], exclusive=exclusive)

    def approvals(self, vm: str, *, prefetch: int = 8) -> _MemorySubscription:
        return self._open(self.broker.vm(vm), None, exclusive=False)

    def dead_letters(self, group: str) -> _MemorySubscription:
        self.broker.group(group)
        return self._open(self.broker.dead[group], None, exclusive=False)
