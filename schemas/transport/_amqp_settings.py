"""The RabbitMQ transport's settings: typed, validated once, from code defaults and the URL.

Options go in the URL query, so one string configures a deployment::

    amqp://relay:secret@rabbit.internal:5672/prod?reconnect_interval=1&confirm_timeout=10

========================== ===== ==================================================================
``reconnect_interval``     0.5 s between reconnect attempts at first; then an eighth of the time
                                 the link has been down (each wait spread by +/-20 % jitter)
``reconnect_max_interval`` 10 s  the longest wait between reconnect attempts
``reconnect_timeout``      30 s  how long ``publish`` waits for a lost link to come back
``confirm_timeout``        10 s  how long ``publish`` waits for the broker's confirm
``connect_timeout``        10 s  one connection attempt (TCP + AMQP handshake)
``heartbeat``              30 s  AMQP heartbeat; 0 turns it off
``approval_ttl``           600 s how long an approval waits in a VM's queue
``delivery_limit``         20    deliveries of a group message before the broker dead-letters it
``name``                   ...   the connection name operators see in the management UI
``declare``                all   ``passive``: check the shared exchanges exist instead of declaring
                                 them (a broker user that may not configure them: a VM's)
``user_id``                login the ``user_id`` property of every message published: RabbitMQ
                                 refuses a publish whose ``user_id`` is not the connection's
                                 user, so consumers know who sent it; empty: not set (EXTERNAL
                                 authentication, where the login is not in the URL)
========================== ===== ==================================================================

TLS options of the underlying client (``cafile``, ``capath``, ``cadata``, ``certfile``,
``keyfile``, ``no_verify_ssl``) and ``auth`` pass through unchanged.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, fields, replace
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from .._errors import ConfigError

__all__ = ["AmqpSettings", "parse_amqp_url"]

_PASSTHROUGH = frozenset(
    {"cafile", "capath", "cadata", "certfile", "keyfile", "no_verify_ssl", "auth"}
)


def _default_name() -> str:
    return f"scheduled-events-relay {socket.gethostname()} pid {os.getpid()}"


@dataclass(frozen=True, slots=True)
class AmqpSettings:
    """How the transport talks to RabbitMQ. URL query options override these."""

    reconnect_interval: float = 0.5
    reconnect_max_interval: float = 10.0
    reconnect_timeout: float = 30.0
    confirm_timeout: float = 10.0
    connect_timeout: float = 10.0
    heartbeat: int = 30
    approval_ttl: float = 600.0
    delivery_limit: int = 20
    name: str = ""
    #: None: the URL's user (``guest`` without one); "": not set.
    user_id: str | None = None
    #: ``all``: declare the shared exchanges and the catch-all (whoever comes first creates
    #: them); ``passive``: only check they exist, for a least-privilege agent whose broker user
    #: may configure nothing but its own queue (the central services declare them).
    declare: str = "all"

    def __post_init__(self) -> None:
        for name in (
            "reconnect_interval",
            "reconnect_max_interval",
            "reconnect_timeout",
            "confirm_timeout",
        ):
            _positive(name, getattr(self, name))
        _positive("connect_timeout", self.connect_timeout)
        _positive("approval_ttl", self.approval_ttl)
        if not 0 <= self.heartbeat <= 65535:
            raise ConfigError(f"heartbeat must be 0..65535 seconds, not {self.heartbeat}")
        if self.declare not in ("all", "passive"):
            raise ConfigError(f"declare must be all or passive, not {self.declare!r}")
        if self.delivery_limit < 1:
            raise ConfigError(f"delivery_limit must be at least 1, not {self.delivery_limit}")

    @property
    def connection_name(self) -> str:
        return self.name or _default_name()


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a positive number of seconds, not {value!r}")


def parse_amqp_url(url: str, base: AmqpSettings | None = None) -> tuple[str, AmqpSettings]:
    """Split ``url`` into the URL the client library gets and the transport's settings.

    Raises :class:`ConfigError` naming the option for an unknown option or a bad value.
    """
    split = urlsplit(url.strip())
    if split.scheme.lower() not in ("amqp", "amqps"):
        raise ConfigError(f"a RabbitMQ URL starts with amqp:// or amqps://, not {split.scheme!r}")
    if not split.hostname:
        raise ConfigError("the RabbitMQ URL has no host")
    try:
        split.port  # noqa: B018 - validates the port
    except ValueError as exc:
        raise ConfigError(f"the RabbitMQ URL has a bad port: {exc}") from exc
    settings = base or AmqpSettings()
    if settings.user_id is None:
        settings = replace(settings, user_id=unquote(split.username or "guest"))
    types = {field.name: field.type for field in fields(AmqpSettings)}
    changes: dict[str, object] = {}
    passthrough: list[tuple[str, str]] = []
    for key, value in parse_qsl(split.query, keep_blank_values=True):
        if key in _PASSTHROUGH:
            passthrough.append((key, value))
            continue
        kind = types.get(key)
        if kind is None:
            known = ", ".join(sorted([*types, *_PASSTHROUGH]))
            raise ConfigError(f"unknown RabbitMQ URL option {key!r}; known options: {known}")
        changes[key] = _convert(key, value, str(kind))
    try:
        settings = replace(settings, **changes)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise ConfigError(f"RabbitMQ URL option: {exc}") from exc
    query = [
        *passthrough,
        ("heartbeat", str(settings.heartbeat)),
        ("name", settings.connection_name),
    ]
    return split._replace(query=urlencode(query)).geturl(), settings


def _convert(key: str, value: str, kind: str) -> object:
    try:
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
    except ValueError as exc:
        raise ConfigError(f"RabbitMQ URL option {key}={value!r} is not a number") from exc
    if not value and key != "user_id":
        raise ConfigError(f"RabbitMQ URL option {key} is empty")
    return value
