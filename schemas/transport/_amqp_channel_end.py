"""An AMQP channel's last frame is its last: nothing of it reaches the socket after, and
what arrives for a channel given up never holds up the frames of the others.

RabbitMQ forgets a channel once its closing handshake is done: once it has the client's
``Channel.CloseOk`` to its own ``Channel.Close`` (it closed the channel: a message it refused,
a queue missing), or once it has answered the client's ``Channel.Close``. Any later frame with
that channel's number but a new ``Channel.Open`` is a *connection* error, ``CHANNEL_ERROR -
expected 'channel.open'``: RabbitMQ closes the connection, and every channel on it. Hundreds
of agents share one connection (``tests/benchmarks/fleet.py``: 500), so one channel's end
cost all of them their link.

aiormq (7.2.4) sends such frames. Two of them made RabbitMQ close the connection in
``tests/transport/test_rabbitmq_channels.py``:

- a publish made while the channel handles the broker's ``Channel.Close``: aiormq queues its
  ``Channel.CloseOk`` at once, but the channel counts as closed only a few turns of the event
  loop later, and ``basic_publish`` checks only that (agents sharing a connection with one
  whose message the broker refused: ``operation basic.publish caused a connection
  exception``);
- an ack, nack or reject made while the client's own ``Channel.Close`` waits for its
  ``CloseOk`` (aiormq refuses them only once the ``CloseOk`` is in: a consumer settling while
  its subscription closes; ``operation basic.ack``).

Read in aiormq, not reproduced through the transport: a second ``Channel.Close``, which
aiormq sends when the first one's ``CloseOk`` is later than the heartbeat (sent by hand after
a first one RabbitMQ had answered, it closes the connection too: ``operation
channel.close``).

Importing this module gives each aiormq channel a door to its connection's write queue, and
the queue checks the door when a frame takes its place (after any wait for room, so the
order is the socket's): a frame that comes after its channel's last one (the ``CloseOk`` the
channel sent; or the ``Channel.Close`` it sent, after which only a ``CloseOk`` may follow, the
answer to a ``Channel.Close`` of the broker's that crossed it) is not queued. Its sender gets
``ChannelInvalidStateError``, as from a closed channel (the frame never left: the transport
publishes the message again on the reopened channel, a delivery it could not ack is
delivered again), and a redundant ``Channel.Close`` or ``CloseOk`` is dropped. Frames queued
*before* the last one are harmless: the broker discards what arrives on a channel it closes.

The other way, a channel given up before its last frame arrives must not hold up the frames
of the others. aiormq's connection has one reader for all its channels; it puts each frame in
its channel's queue, and waits when that queue is full (10 frames: ``Connection.channel``'s
default, fixed when aiormq is imported). The channel's own reader empties it, also while its
``Channel.Close`` waits for the ``CloseOk``; but when aiormq gives the channel up first (its
``Channel.Close`` or another request got no answer in time, so a close cancels the reader at
once) the connection still routes its frames to it until the ``CloseOk``, and the
deliveries the broker sent before it (up to the prefetch) fill the queue: the connection's
reader waited for good, and nothing more arrived on any channel of the connection until the
heartbeat check gave the whole connection up. Reproduced in
``tests/transport/test_rabbitmq_channels.py`` (a subscription closed while its link stalled
longer than the heartbeat: once the link came back, neither confirms nor approvals arrived
on the connection). So once a channel's own reader is gone, its queue has no bound any more
(what the broker sends a channel given up before its CloseOk unregisters it is bounded: its
prefetch, its requests' answers), and a put waiting for room is let go. Until then the bound
stays: a queue without one let the connection's reader read all the socket held before the
channels' readers ran, which held the acks back and cut a consumer's rate (the raw consumer of
``tests/benchmarks/consumer_throughput.py``: 11,651-11,725 msg/s against 16,397-16,865), and a
check on every frame cost 10 % of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import aiormq
import aiormq.exceptions
from aiormq.abc import ChannelFrame
from pamqp import commands as spec

__all__: list[str] = []

log = logging.getLogger(__name__)

#: Where a method frame's class and method are: after the frame type (1 byte), the channel
#: (2) and the size (4). ``ChannelFrame.marshall`` puts the method frame first.
_METHOD = slice(7, 11)
_CLOSE = spec.Channel.Close.index
_CLOSE_OK = spec.Channel.CloseOk.index


class _ChannelDoor:
    """What one aiormq channel sees as its connection's write queue (``put``, ``put_nowait``,
    all that aiormq's ``Channel`` uses): each frame goes on tagged with this door, and
    :class:`_WriteQueue` asks :meth:`admit` when it takes its place."""

    __slots__ = ("_closed", "_ended", "_number", "_queue")

    def __init__(self, queue: asyncio.Queue[ChannelFrame], number: int) -> None:
        self._queue = queue
        self._number = number
        self._closed = False  # its Channel.Close is queued: only a CloseOk may follow
        self._ended = False  # its last frame is queued

    def admit(self, frame: ChannelFrame) -> bool:
        """May ``frame`` go on now? Raises for a frame after the channel's last one; False
        for a redundant ``Channel.Close`` or ``CloseOk`` (dropped)."""
        method = int.from_bytes(frame.payload[_METHOD], "big")
        ending = method in (_CLOSE, _CLOSE_OK)
        if self._ended or (self._closed and method != _CLOSE_OK):
            if ending:
                log.debug("channel %d: a second %s dropped", self._number, _name(method))
                return False
            raise aiormq.exceptions.ChannelInvalidStateError(
                f"channel {self._number} is closed: nothing more may be sent on it"
            )
        if method == _CLOSE:
            self._closed = True
        elif method == _CLOSE_OK:
            self._ended = True
        return True

    def _tagged(self, frame: ChannelFrame) -> ChannelFrame:
        if not isinstance(self._queue, _WriteQueue):
            # A connection made before this module was imported: checked here, in order
            # unless the frame waits for room.
            return frame if self.admit(frame) else _NOTHING
        return _DoorFrame(frame.payload, frame.should_close, frame.drain_future, self)

    async def put(self, frame: ChannelFrame) -> None:
        tagged = self._tagged(frame)
        if tagged is not _NOTHING:
            await self._queue.put(tagged)

    def put_nowait(self, frame: ChannelFrame) -> None:
        tagged = self._tagged(frame)
        if tagged is not _NOTHING:
            self._queue.put_nowait(tagged)


@dataclasses.dataclass(frozen=True)
class _DoorFrame(ChannelFrame):
    """A channel's frame, with the door it came through."""

    door: _ChannelDoor | None = None


#: A frame the door dropped.
_NOTHING = ChannelFrame(b"", False)


class _WriteQueue(asyncio.Queue[ChannelFrame]):
    """A connection's write queue: a channel's frame takes its place only if its door admits
    it then (``asyncio.Queue.put`` ends in ``put_nowait``, after any wait for room)."""

    def put_nowait(self, item: ChannelFrame) -> None:
        if self.full():
            raise asyncio.QueueFull
        if isinstance(item, _DoorFrame) and item.door is not None and not item.door.admit(item):
            return
        super().put_nowait(item)


def _name(method: int) -> str:
    return "Channel.Close" if method == _CLOSE else "Channel.CloseOk"


_connection_init = aiormq.Connection.__init__
_channel_init = aiormq.Channel.__init__


def _init_connection(self: aiormq.Connection, *args: Any, **kwargs: Any) -> None:
    _connection_init(self, *args, **kwargs)
    self.write_queue = _WriteQueue(maxsize=self.write_queue.maxsize)


def _init_channel(
    self: aiormq.Channel, connector: Any, number: int, *args: Any, **kwargs: Any
) -> None:
    _channel_init(self, connector, number, *args, **kwargs)
    self.write_queue = _ChannelDoor(self.write_queue, number)  # type: ignore[assignment]
    # Nothing is in it yet: the channel's reader has not run, and it is not registered.
    frames = _ChannelFrames(self.frames.maxsize)
    self.frames = frames
    reader: asyncio.Task[None] = self._Channel__reader_task  # type: ignore[attr-defined]
    reader.add_done_callback(lambda _: frames.abandon())


class _ChannelFrames(asyncio.Queue[Any]):
    """A channel's queue of frames from the connection's reader, bounded as aiormq's, until
    the channel's own reader is gone (:meth:`abandon`)."""

    def abandon(self) -> None:
        """Nobody reads it any more: what it holds is dropped, what comes no longer waits for
        room (a channel given up gets no more than its prefetch and its requests' answers
        before the broker's CloseOk unregisters it), and a put waiting for room is let go."""
        while not self.empty():
            self.get_nowait()
        self._maxsize = 0  # asyncio.Queue's bound
        for putter in self._putters:  # type: ignore[attr-defined]
            if not putter.done():
                putter.set_result(None)


aiormq.Connection.__init__ = _init_connection  # type: ignore[method-assign]
aiormq.Channel.__init__ = _init_channel  # type: ignore[method-assign]
