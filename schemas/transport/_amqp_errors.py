"""Which aio-pika / aiormq failures mean "the link is down" and which mean "refused".

A lost link is worth waiting for (the robust connection reconnects); a refusal (a missing
entity, a precondition, a permission) will not go away by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import aiormq.exceptions
import pamqp.exceptions

from .._errors import ConfigError, MessageRefused, PublishNotConfirmed

__all__ = [
    "FAILURES",
    "LINK_ERRORS",
    "MESSAGE_REFUSALS",
    "REFUSALS",
    "config_error",
    "initialized",
    "is_spurious_cancel",
    "lost_if_closed",
    "reason",
    "refused",
    "refuses",
    "unabandoned",
    "uninterrupted",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

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

#: On a publish, the broker refused that message for what it carries (ACCESS_REFUSED: a routing
#: key the user's topic permissions forbid; PRECONDITION_FAILED: a ``user_id`` that is not the
#: login's, a message over ``max_message_size``): the next one may well go through.
MESSAGE_REFUSALS: tuple[type[BaseException], ...] = (
    aiormq.exceptions.ChannelAccessRefused,
    aiormq.exceptions.ChannelPreconditionFailed,
)

#: RabbitMQ's words for a message over ``max_message_size`` (PRECONDITION_FAILED), with the
#: limit (in bytes of body).
_TOO_LARGE = re.compile(r"message size \d+ is larger than configured max size (\d+)")
#: RabbitMQ's words for a routing key the user's topic permissions forbid (ACCESS_REFUSED).
_TOPIC = re.compile(r"access to topic '(.*)' in exchange '(.*)' in vhost '.*' refused for user")
#: RabbitMQ's words for a ``user_id`` that is not the login's (PRECONDITION_FAILED).
_USER_ID = re.compile(r"user_id property set to '(.*)' but authenticated user was")

_INEQUIVALENT = re.compile(r"inequivalent arg '([^']+)'")


@contextlib.contextmanager
def lost_if_closed() -> Iterator[None]:
    """Raise what aiormq fails every future still waiting on a connection or channel with when
    it ended without an error (closed from this side: its reader stops at the broker's
    Close-Ok and passes no error on), a bare ``Exception``, as a :class:`ConnectionError` (one
    of :data:`LINK_ERRORS`): around an exchange with the broker, what catches
    :data:`FAILURES` takes it as the lost link it is. Uncaught, it ended the approver's
    approval sends and an agent opening its approvals subscription."""
    try:
        yield
    except Exception as exc:
        if type(exc) is not Exception or exc.args:
            raise
        raise ConnectionError("the connection was closed") from exc


def is_spurious_cancel(exc: asyncio.CancelledError) -> bool:
    """aiormq cancels pending futures when a channel closes: that CancelledError reaches a
    task nobody cancelled, and means "link lost", not "stop"."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


async def uninterrupted(exchange: Coroutine[Any, Any, T]) -> T:
    """Run an exchange with the broker (opening a channel and consuming, closing one) to its
    end even when the caller is cancelled meanwhile, then pass the cancel on.

    aiormq answers a cancelled RPC by closing its channel at once; when that races the
    channel's own opening or closing, RabbitMQ closes the whole *connection*
    (``CHANNEL_ERROR - expected 'channel.open'``), which costs every other channel on it a
    reconnect, and the cancel surfaced as a link error the caller would retry. Each step has
    its own timeout, so waiting for the end is bounded. A second cancel stops waiting.
    """
    inner = asyncio.ensure_future(exchange)
    try:
        return await asyncio.shield(inner)
    except asyncio.CancelledError:
        if inner.done():
            raise
        await asyncio.wait({inner})
        if not inner.cancelled():
            inner.exception()  # retrieved: the cancel is what the caller gets
        raise


#: Exchanges given up on but left to finish (see :func:`unabandoned`): referenced until done.
_LEFT_RUNNING: set[asyncio.Future[Any]] = set()


async def unabandoned(
    exchange: Awaitable[T],
    timeout: float,  # noqa: ASYNC109
    *,
    then: Callable[[], Awaitable[object]] | None = None,
) -> T:
    """Wait at most ``timeout`` for an exchange that must not be cut short (a channel's opening
    or closing), raising :class:`TimeoutError` when it takes longer, *without* cancelling it.

    aiormq answers a cancelled RPC by sending ``Channel.Close``; for an opening or a closing
    already on the wire that is a second frame RabbitMQ does not expect, and it closes the
    whole *connection* (``CHANNEL_ERROR - expected 'channel.open'``): a broker slow for a
    moment then cost every channel on it a reconnect. So a slow exchange is left to finish in
    the background (aiormq bounds it: the connection's heartbeat, or its loss), and ``then``
    runs if it succeeds late (close the channel nobody will use). A cancel of the caller
    leaves it the same way.
    """
    task = asyncio.ensure_future(exchange)
    try:
        async with asyncio.timeout(timeout):
            return await asyncio.shield(task)
    except BaseException:
        if not task.done():
            _LEFT_RUNNING.add(task)
            task.add_done_callback(lambda done: _finished_late(done, then))
        raise


async def initialized(channel: Any, timeout: float) -> None:  # noqa: ASYNC109
    """Open ``channel`` (an aio-pika channel), as :func:`unabandoned` does.

    When the connection under it has closed (the link dropped, and the robust connection has
    not reconnected yet) aiormq raises a bare ``RuntimeError("<Connection ...> closed")``: that
    is a lost link, raised here as a :class:`ConnectionError` (one of :data:`LINK_ERRORS`), so
    that every caller waits and tries again as it does for any other. Uncaught, it ended an
    agent whose link dropped between declaring its approvals queue and consuming it. So is the
    bare ``Exception`` of a connection that ended without an error (:func:`lost_if_closed`).
    """
    try:
        with lost_if_closed():
            await unabandoned(channel.initialize(), timeout, then=channel.close)
    except RuntimeError as exc:
        if not str(exc).endswith(" closed"):
            raise
        raise ConnectionError(f"the link closed before a channel opened: {exc}") from exc


def _finished_late(task: asyncio.Future[Any], then: Callable[[], Awaitable[object]] | None) -> None:
    _LEFT_RUNNING.discard(task)
    if task.cancelled():
        return
    if (exc := task.exception()) is not None:
        log.debug("an exchange given up on failed later (%s)", reason(exc))
    elif then is not None:
        follow_up = asyncio.ensure_future(then())
        _LEFT_RUNNING.add(follow_up)
        follow_up.add_done_callback(lambda done: _finished_late(done, None))


def reason(exc: BaseException) -> str:
    """The broker's own words where it gave some, else the exception's text."""
    args = getattr(exc, "args", ())
    for arg in args:
        reply_text = getattr(arg, "reply_text", None)
        if reply_text:
            return str(reply_text)
    text = str(exc) or type(exc).__name__
    return text


def refused(exc: BaseException, what: str) -> PublishNotConfirmed:
    """The error for a message the broker refused for what it carries (a MESSAGE_REFUSALS).

    Only a message over the broker's size limit is :class:`MessageRefused` (never taken,
    however often sent: the sender sets it aside). A ``user_id`` that is not the login's or a
    routing key the topic permissions forbid refuses every message of that publisher alike
    until an operator fixes the settings or the permissions: the sender keeps them and retries.
    """
    text = reason(exc)
    if _TOO_LARGE.search(text):
        return MessageRefused(f"{what}: RabbitMQ will never take it: {text}")
    return PublishNotConfirmed(f"{what}: RabbitMQ refused it: {text}")


def refuses(
    exc: BaseException, exchange: str, routing_key: str, body: bytes, user_id: str | None
) -> bool:
    """Whether the broker's refusal ``exc`` (a MESSAGE_REFUSALS, which closed the channel) is
    about this message, published to ``exchange`` with ``routing_key``, ``body`` and
    ``user_id``. aiormq fails every publish still waiting for its confirm on the closed
    channel with the same refusal, whichever message the broker refused: a neighbour whose
    body, routing key and user_id the broker's words rule out was not judged (or was taken
    before the refused one), and is published again. Words it cannot read blame the message,
    as before."""
    text = reason(exc)
    size = _TOO_LARGE.search(text)
    if size is not None:
        return len(body) > int(size.group(1))
    topic = _TOPIC.search(text)
    if topic is not None:
        return (topic.group(1), topic.group(2)) == (routing_key, exchange)
    user = _USER_ID.search(text)
    if user is not None:
        return (user_id or "") == user.group(1)
    return True


def config_error(exc: BaseException, entity: str, hint: str) -> ConfigError:
    """A precondition failure on a declaration: the entity exists with other settings."""
    text = reason(exc)
    match = _INEQUIVALENT.search(text)
    what = f"its argument {match.group(1)!r} differs" if match else "its settings differ"
    return ConfigError(
        f"{entity} exists on the broker but {what} ({text}). Arguments are fixed when an entity "
        f"is declared: {hint}"
    )
