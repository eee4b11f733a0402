"""Transports: one small interface (:class:`Transport`), one implementation per broker.

``open_transport(url)`` picks the implementation from the URL and imports only that backend:

==================================================  ==========================================
``memory://NAME`` or ``memory://USER@NAME``         :class:`MemoryTransport` (one process)
``amqp://user:pass@host:5672/vhost``, ``amqps://``  RabbitMQ (aio-pika; the ``rabbitmq`` extra)
``Endpoint=sb://NS.servicebus.windows.net/;...``    Azure Service Bus with a connection string
``sb://NS.servicebus.windows.net``                  Azure Service Bus, ``DefaultAzureCredential``
==================================================  ==========================================
"""

from __future__ import annotations

from urllib.parse import urlsplit

from .._errors import ConfigError
from ..channels import DEFAULT_CHANNELS, ChannelNames
from ._base import AsyncResource, Delivery, OutgoingMessage, Subscription, Transport
from .memory import (
    DEAD_LETTER_DESCRIPTION,
    DEAD_LETTER_REASON,
    ORIGINAL_SENDER,
    MemoryBroker,
    MemoryTransport,
)

__all__ = [
    "DEAD_LETTER_DESCRIPTION",
    "DEAD_LETTER_REASON",
    "ORIGINAL_SENDER",
    "AsyncResource",
    "Delivery",
    "MemoryBroker",
    "MemoryTransport",
    "OutgoingMessage",
    "Subscription",
    "Transport",
    "broker_kind",
    "open_transport",
    "redact",
]


def broker_kind(url: str) -> str:
    """``memory``, ``rabbitmq`` or ``servicebus`` for a broker URL; :class:`ConfigError` else."""
    text = url.strip()
    if text.lower().startswith("endpoint="):
        return "servicebus"
    scheme = urlsplit(text).scheme.lower()
    if scheme == "memory":
        return "memory"
    if scheme in ("amqp", "amqps"):
        return "rabbitmq"
    if scheme == "sb":
        return "servicebus"
    raise ConfigError(
        f"broker {redact(url)!r} is not understood: use memory://, amqp://, amqps://, "
        "Endpoint=sb://... (a Service Bus connection string) or sb://NAMESPACE"
    )


def redact(url: str) -> str:
    """The URL with passwords and shared access keys replaced, safe to log."""
    text = url.strip()
    if text.lower().startswith("endpoint="):
        parts = []
        for part in text.split(";"):
            key, sep, _ = part.partition("=")
            secret = key.strip().lower() in ("sharedaccesskey", "sharedaccesssignature")
            parts.append(f"{key}{sep}***" if secret else part)
        return ";".join(parts)
    split = urlsplit(text)
    if split.password:
        netloc = split.netloc.replace(f":{split.password}@", ":***@")
        return split._replace(netloc=netloc).geturl()
    return text


def open_transport(
    url: str, channels: ChannelNames = DEFAULT_CHANNELS, *, name: str | None = None
) -> Transport:
    """The transport for ``url``, not yet connected (use ``async with``). ``name`` is the
    connection name operators see on the broker (RabbitMQ), unless the URL sets one."""
    kind = broker_kind(url)
    if kind == "memory":
        user, at, name = urlsplit(url.strip()).netloc.rpartition("@")
        return MemoryTransport(name or "default", channels, user=user if at else None)
    if kind == "rabbitmq":
        try:
            from .rabbitmq import RabbitMQTransport
        except ImportError as exc:  # the extra is not installed
            raise ConfigError(
                "RabbitMQ needs aio-pika: pip install 'scheduled-events-relay[rabbitmq]'"
            ) from exc
        from ._amqp_settings import AmqpSettings

        return RabbitMQTransport(url, channels, settings=AmqpSettings(name=name) if name else None)
    try:
        from .servicebus import ServiceBusTransport
    except ImportError as exc:
        raise ConfigError(
            "Service Bus needs azure-servicebus: pip install 'scheduled-events-relay[servicebus]'"
        ) from exc
    return ServiceBusTransport(url, channels)
