"""The RabbitMQ connection: aio-pika's robust connection, jittered, quiet where it repeats us,
and a refused login said in one line.

A refused login or vhost is not a network problem, and aio-pika / aiormq report it badly: the
first attempt logs "Connection ... closed. Reconnecting after 0.5 seconds." (it does not
reconnect: the first connect fails fast), aiormq logs each failed TCP connect at ERROR before
raising it, a refused vhost surfaces as ``Expected one of ['Connection.OpenOk'], got
<Connection.Close object at 0x...>``, and while reconnecting every failed attempt is logged,
twice a second. Here the caller gets one :class:`TransportError` that says what RabbitMQ
refused, the libraries say nothing the caller does not already report, and a reconnect that
keeps failing is logged once per reason, in the same words:

================================== ===============================================================
RabbitMQ answers                   :func:`connect_error` says
================================== ===============================================================
403 ACCESS_REFUSED at login         RabbitMQ at HOST refused the login for user X on vhost Y
(wrong password, unknown user)      (wrong user name or password)
530 NOT_ALLOWED at connection.open  RabbitMQ at HOST refused vhost Y to user X: vhost Y does not
("vhost Y not found", "access to    exist or user X may not use it
vhost 'Y' refused for user 'X'")
================================== ===============================================================

(aiormq drops the text of a NOT_ALLOWED close, so the two vhost cases read the same.)

It stays a :class:`TransportError`, not a :class:`ConfigError`: the fix is on the broker as often
as in our settings (the user or vhost created later, a password rotated, an LDAP or OAuth backend
that was down), and an agent that keeps retrying recovers without a restart once it is fixed.
"""

from __future__ import annotations

import asyncio
import logging
import random
from urllib.parse import unquote, urlsplit

import aio_pika
import aiormq
import aiormq.exceptions

from .._errors import TransportError

# Imported for its effect: nothing is sent on a channel after its last frame, which made
# RabbitMQ close the whole connection, and a channel given up no longer stalls the connection's
# reader (see the module).
from . import _amqp_channel_end  # noqa: F401
from ._amqp_errors import reason

__all__ = ["FRAME_BUFFER", "RelayConnection", "connect_error", "login"]

#: Frames an aiormq connection queues for its socket before a sender waits for room (aiormq's
#: own default is 10). Ten fill at once on a connection that many agents share, or on a
#: consumer's that acks while it publishes; each freed slot then costs a waiting sender a turn
#: of the event loop, so on a busy loop a publish waited seconds for room before it was even
#: sent (``tests/benchmarks/fleet.py --vms 2000``: p99 from detection to the approver 20 s,
#: 3.3-5.3 s with this).
#: The queue stays bounded by the publishes in flight: each publisher waits for its confirm.
FRAME_BUFFER = 1024
# aiormq reads it when it creates a connection; it has no per-connection setting for it.
aiormq.Connection.FRAME_BUFFER_SIZE = max(aiormq.Connection.FRAME_BUFFER_SIZE, FRAME_BUFFER)

#: aiormq logs this at ERROR before raising the same error to its caller, which reports it.
_AIORMQ_DUPLICATE = "error when creating transport: %r"
#: aio-pika logs this at WARNING for every failed reconnect attempt (args: connection, error,
#: interval): twice a second for as long as a password is wrong or the broker is down.
_RECONNECT_FAILED = 'Connection attempt to "%s" failed: %s. Reconnecting after %r seconds.'


#: aiormq logs this at WARNING with the reader's error and two chained tracebacks whenever a
#: connection's reader ends: at every lost link (the broker restarting, a network cut), which
#: the transport says in one line ("lost the link to RabbitMQ ...: reconnecting"). Kept for
#: what is not a lost connection (a malformed frame: ``InvalidFrameError``).
_READER_EXITED = "Cancelling cause reader exited abnormally"
#: aio-pika logs this at ERROR when a callback fails. A robust channel's close callback
#: (``RobustChannel._on_close``) reopens the channel at once, which fails when the connection
#: is the one that was lost ("No active transport in channel", "... closed"): one ERROR per
#: channel at every lost link, for a channel the connection reopens when it is back.
_CALLBACK_FAILED = "Callback %r error: %s: %s"
_REOPEN_FAILURES = frozenset({"ChannelInvalidStateError", "RuntimeError"})


class _DropDuplicates(logging.Filter):
    """aiormq's records that repeat what the transport says (a failed connect, a lost link)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _READER_EXITED and record.exc_info:
            return not isinstance(record.exc_info[1], ConnectionError)
        return record.msg != _AIORMQ_DUPLICATE


class _DropChannelReopenOnLostLink(logging.Filter):
    """aio-pika's ERROR for a robust channel that could not reopen on a lost connection."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.msg != _CALLBACK_FAILED or not isinstance(args, tuple) or len(args) != 3:
            return True
        callback = getattr(args[0], "callback", None)
        reopen = getattr(callback, "__func__", None) is aio_pika.RobustChannel._on_close
        return not (reopen and args[1] in _REOPEN_FAILURES)


class _OncePerReason(logging.Filter):
    """A failed reconnect of a :class:`RelayConnection` is logged once per reason, in the words
    of :func:`connect_error`; its repeats are dropped until it connects, even when reasons
    alternate (a load balancer in front of a broker that is down resets some attempts and
    closes others)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.msg != _RECONNECT_FAILED or not isinstance(args, tuple) or len(args) != 3:
            return True
        connection, exc = args[0], args[1]
        if not isinstance(connection, RelayConnection) or not isinstance(exc, BaseException):
            return True
        return connection.reconnect_failed(record, exc)


logging.getLogger("aiormq.connection").addFilter(_DropDuplicates())
logging.getLogger("aio_pika.robust_connection").addFilter(_OncePerReason())
logging.getLogger("aio_pika.tools").addFilter(_DropChannelReopenOnLostLink())


class RelayConnection(aio_pika.RobustConnection):
    """aio-pika's robust connection with three changes.

    - The longer its link has been down, the longer it waits between reconnect attempts: the
      interval (``reconnect_interval``, 0.5 s) at first, then an eighth of the time the link
      has been down, at most ``max_reconnect_interval`` (10 s). aio-pika waits the same
      interval for ever: 10,000 agents cut off by a broker restart would try 20,000 times a
      second, against a node that is starting up; after a long outage each tries every 10 s
      (1,000 a second for such a fleet), and comes back at most an eighth of the outage
      late. Each wait is spread by +/-20 %: a fleet cut off together would come back in
      lock-step.
    - An attempt to connect that fails is not a lost link: it does not log that it is
      reconnecting (after a failed first connect it is not: ``connect`` raises) nor run the
      close callbacks, which would say "lost the link" at every attempt of an outage.
    - A failed reconnect is logged once per reason and outage (a login refused after a
      password rotation, the broker down), in one line, not at every attempt.
    """

    _base_interval: float = 0.5
    #: The longest wait between reconnect attempts, however long the link has been down.
    max_reconnect_interval: float = 10.0
    #: The reasons a reconnect failed for since the link was last up, each logged once.
    _failures: frozenset[str] = frozenset()
    #: When the link was lost (the event loop's clock); None while it is up.
    _down_since: float | None = None

    def reconnect_failed(self, record: logging.LogRecord, exc: BaseException) -> bool:
        """Rewrite aio-pika's record of a failed reconnect; False for a repeat (dropped)."""
        text = str(connect_error(exc, str(self.url), str(self)))
        if text in self._failures:
            return False
        self._failures |= {text}
        record.msg = (
            "%s; reconnecting every ~%.1f s now, less often the longer it fails (at most every "
            "%.0f s; not logged again for this reason until it connects)"
        )
        record.args = (text, self._wait(), self.longest_wait)
        return True

    async def _on_connected(self) -> None:
        self._failures = frozenset()
        await super()._on_connected()
        self._down_since = None  # back, its channels restored: the next outage starts afresh

    def _wait(self) -> float:
        """The wait before the next reconnect attempt, before jitter (see the class)."""
        base = self._base_interval
        if self._down_since is None:
            return base
        down = asyncio.get_running_loop().time() - self._down_since
        return max(base, min(self.longest_wait, down / 8))

    @property
    def longest_wait(self) -> float:
        """The longest wait between reconnect attempts: ``max_reconnect_interval``, or the first
        interval when that is longer."""
        return max(self.max_reconnect_interval, self._base_interval)

    @property
    def reconnect_interval(self) -> float:
        return self._wait() * random.uniform(0.8, 1.2)

    @reconnect_interval.setter
    def reconnect_interval(self, value: float) -> None:
        self._base_interval = float(value)

    async def _on_connection_close(self, closing: asyncio.Future[object]) -> None:
        if not self.connected.is_set():
            # An attempt that never connected (the first connect, or a reconnect): no link was
            # lost. aio-pika would log "Reconnecting after" and run the close callbacks (the
            # transport's "lost the link") at every attempt; the attempt's own failure is
            # reported by connect()'s caller, or logged once per reason (_OncePerReason).
            if closing.done() and not closing.cancelled():
                closing.exception()  # retrieved, so asyncio does not log it as forgotten
            return
        if self._down_since is None:
            self._down_since = asyncio.get_running_loop().time()
        await super()._on_connection_close(closing)


def login(url: str) -> tuple[str, str]:
    """(user, vhost) as the broker sees them: aiormq's defaults are ``guest`` and ``/``."""
    split = urlsplit(url)
    return unquote(split.username or "guest"), unquote(split.path[1:]) or "/"


def connect_error(exc: BaseException, url: str, display_url: str) -> TransportError:
    """The one-line error for a failed connect (or reconnect), naming what RabbitMQ refused."""
    user, vhost = login(url)
    host = urlsplit(display_url).netloc.rpartition("@")[2]
    text = str(exc)
    if isinstance(exc, aiormq.exceptions.ProbableAuthenticationError):
        message = (
            f"RabbitMQ at {host} refused the login for user {user!r} on vhost {vhost!r} "
            "(wrong user name or password)"
        )
    elif (
        isinstance(exc, aiormq.exceptions.InvalidFrameError)
        and "Connection.OpenOk" in text
        and "Connection.Close" in text
    ):
        message = (
            f"RabbitMQ at {host} refused vhost {vhost!r} to user {user!r}: vhost {vhost!r} "
            f"does not exist or user {user!r} may not use it"
        )
    else:
        message = f"cannot connect to RabbitMQ at {display_url}: {reason(exc)}"
    return TransportError(" ".join(message.split()))  # one line, whatever the broker said
