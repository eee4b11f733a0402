"""Which aio-pika / aiormq failures mean "the link is down" and which mean "refused".

A lost link is worth waiting for (the robust connection reconnects); a refusal (a missing
entity, a precondition, a permission) will not go away by itself.
"""

from __future__ import annotations

import asyncio
import re

import aiormq.exceptions
import pamqp.exceptions

from .._errors import ConfigError

__all__ = ["FAILURES", "LINK_ERRORS", "REFUSALS", "config_error", "is_spurious_cancel", "reason"]

#: The connection or channel went away under an operation.
LINK_ERRORS: tuple[type[BaseException], ...] = (
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
    OSError,
    EOFError,
    pamqp.exceptions.PAMQPException,
)

#: Anything that can go wrong talking to the broker, a timeout included.
FAILURES: tuple[type[BaseException], ...] = (
    *LINK_ERRORS,
    aiormq.exceptions.AMQPError,
    TimeoutError,
)

#: The broker refused an operation on a channel; it closed that channel.
REFUSALS: tuple[type[BaseException], ...] = (
    aiormq.exceptions.ChannelAccessRefused,
    aiormq.exceptions.ChannelNotFoundEntity,
    aiormq.exceptions.ChannelLockedResource,
    aiormq.exceptions.ChannelPreconditionFailed,
)

_INEQUIVALENT = re.compile(r"inequivalent arg '([^']+)'")


def is_spurious_cancel(exc: asyncio.CancelledError) -> bool:
    """aiormq cancels pending futures when a channel closes: that CancelledError reaches a
    task nobody cancelled, and means "link lost", not "stop"."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


def reason(exc: BaseException) -> str:
    """The broker's own words where it gave some, else the exception's text."""
    args = getattr(exc, "args", ())
    for arg in args:
        reply_text = getattr(arg, "reply_text", None)
        if reply_text:
            return str(reply_text)
    text = str(exc) or type(exc).__name__
    return text


def config_error(exc: BaseException, entity: str, hint: str) -> ConfigError:
    """A precondition failure on a declaration: the entity exists with other settings."""
    text = reason(exc)
    match = _INEQUIVALENT.search(text)
    what = f"its argument {match.group(1)!r} differs" if match else "its settings differ"
    return ConfigError(
        f"{entity} exists on the broker but {what} ({text}). Arguments are fixed when an entity "
        f"is declared: {hint}"
    )
