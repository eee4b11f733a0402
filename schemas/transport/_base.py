"""The transport interface both sides share, whatever the broker.

Two flows, each with its own channel:

- the **lifecycle stream**: agents :meth:`Transport.publish`, consumer groups
  :meth:`Transport.subscribe` (each group gets every message once; processes of one group
  compete for them);
- the **approvals**: central services :meth:`Transport.send_approval` to a VM's
  :class:`~schemas.ReplyAddress`; that VM's agent reads them with :meth:`Transport.approvals`.

``publish`` and ``send_approval`` return only once the broker has the message (publisher
confirms on RabbitMQ, the settled send on Service Bus). A :class:`Delivery` is settled exactly
once: ``ack`` after handling, ``retry`` for a transient failure (it comes back with
``delivery_count + 1``), ``dead_letter`` with a reason for input that will never be handled.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

from ..channels import ReplyAddress

__all__ = ["AsyncResource", "Delivery", "OutgoingMessage", "Subscription", "Transport"]

PropertyValue = str | int | float | bool


@dataclass(frozen=True, slots=True)
class OutgoingMessage:
    """One message as every broker carries it."""

    body: bytes
    message_id: str
    content_type: str
    #: RabbitMQ routing key; Service Bus ``subject``.
    routing_key: str = ""
    #: Application properties / headers (CloudEvents binary-mode attributes go here).
    properties: Mapping[str, PropertyValue] = field(default_factory=dict)
    #: Seconds after which an undelivered message may be dropped (approvals expire).
    ttl_seconds: float | None = None


@runtime_checkable
class Delivery(Protocol):
    """A received message, to be settled exactly once."""

    @property
    def body(self) -> bytes: ...
    @property
    def message_id(self) -> str: ...
    @property
    def content_type(self) -> str: ...
    @property
    def routing_key(self) -> str: ...
    @property
    def properties(self) -> Mapping[str, PropertyValue]: ...
    @property
    def delivery_count(self) -> int:
        """How many times this message was delivered before (0 on the first delivery)."""
        ...

    @property
    def sender(self) -> str | None:
        """Who published it, as the broker vouches for it: RabbitMQ's validated ``user_id``
        (the publishing connection's user), the user of a ``memory://USER@NAME`` transport;
        None where the broker says nothing (Service Bus: messages are signed instead)."""
        ...

    async def ack(self) -> None:
        """Handled: remove it from the queue."""
        ...

    async def retry(self) -> None:
        """Not handled this time: deliver it again (to this or another consumer)."""
        ...

    async def dead_letter(self, reason: str, description: str) -> None:
        """Never handleable: move it to the dead-letter destination with ``reason``."""
        ...


class Subscription(Protocol):
    """An open consumer: iterate for deliveries, close (or leave the ``async with``) to stop."""

    def __aiter__(self) -> AsyncIterator[Delivery]: ...
    async def __anext__(self) -> Delivery: ...
    async def close(self) -> None: ...
    async def __aenter__(self) -> Self: ...
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """A broker connection. ``async with transport:`` connects and closes.

    Raises :class:`~schemas.TransportError` (never a library's own exception) when the broker
    cannot be reached, and :class:`~schemas.PublishNotConfirmed` when it did not take a message.
    """

    #: ``memory``, ``rabbitmq`` or ``servicebus``.
    name: str

    async def connect(self) -> None: ...
    async def close(self) -> None: ...
    async def __aenter__(self) -> Self: ...
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    @property
    def link_down_for(self) -> float | None:
        """Seconds since the broker link was lost, while it is being restored; None while it
        is up, or where the transport keeps no link of its own (its operations and
        subscriptions then fail instead)."""
        ...

    def reply_address(self, vm: str) -> ReplyAddress:
        """Where approvals for ``vm`` must be sent (carried in every message the VM publishes)."""
        ...

    async def publish(self, message: OutgoingMessage) -> None:
        """Put a lifecycle message on the stream; returns once the broker confirmed it."""
        ...

    async def send_approval(self, to: ReplyAddress, message: OutgoingMessage) -> None:
        """Send an approval to one VM; returns once the broker confirmed it."""
        ...

    async def declare_group(self, group: str, *, exclusive: bool | None = None) -> None:
        """Create the consumer group's durable copy of the stream (idempotent), so messages
        published from now on wait for it even before a consumer runs; on RabbitMQ it also
        takes over what waited in the catch-all while no group existed (dead-lettered into the
        stream, so every group bound by then gets it). ``exclusive`` as in :meth:`subscribe`;
        None takes an existing group as it is (new: competing consumers)."""
        ...

    def subscribe(
        self, group: str, *, prefetch: int = 64, exclusive: bool = False, transient: bool = False
    ) -> Subscription:
        """Consume the group's copy of the stream (declares it). ``exclusive``: one active
        consumer at a time (the others wait), where order matters.

        ``transient``: a copy of the stream for this subscription only, from now on, which the
        broker drops when it closes, for a reader that must leave nothing behind (``tail``):
        a durable group keeps collecting messages after its last consumer stops. RabbitMQ and
        memory create it; Service Bus cannot create a subscription over AMQP, so it reads the
        subscription ``group``, which the operator creates with AutoDeleteOnIdle."""
        ...

    def approvals(self, vm: str, *, prefetch: int = 8) -> Subscription:
        """Consume the approvals addressed to ``vm`` (declares its queue or session)."""
        ...

    def dead_letters(self, group: str) -> Subscription:
        """Consume what the group dead-lettered; ``properties["dead_letter_reason"]`` and
        ``properties["dead_letter_description"]`` say why."""
        ...


class AsyncResource(ABC):
    """``async with`` for the transports and their subscriptions: enter runs :meth:`connect`
    (nothing by default), leaving always runs :meth:`close`."""

    async def connect(self) -> None:
        return None

    @abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
