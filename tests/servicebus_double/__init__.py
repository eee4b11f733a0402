"""A protocol-level Azure Service Bus double that the real azure-servicebus SDK talks to.

It speaks AMQP 1.0 on loopback through python-qpid-proton, with the Service Bus specifics the
SDK relies on ($cbs, $management, lock tokens, sessions), in front of an in-memory namespace
with declared queues, topics and subscriptions. Unknown entities are refused with
``amqp:not-found``, as a real namespace does.

Usage::

    with ServiceBusDouble(queues=["orders"], topics={"events": ["a", "b"]}) as sb:
        client = ServiceBusClient.from_connection_string(sb.connection_string)

or standalone: ``python -m tests.servicebus_double --port 0 --queue orders``.

Like Service Bus Standard, it advertises a max message size of 262,144 bytes on the links
clients send on and refuses a larger message (the SDK raises ``MessageSizeExceededError``):
``max_message_size`` sets another (Premium: up to 100 MB; 0: no limit).

``usage()`` says how many connections and entity links the clients hold (now, at peak, and on
average since ``restart_usage()``), to measure a client against the namespace's quotas.
"""

from __future__ import annotations

import logging
import math
import select
import threading
from collections.abc import Iterable, Mapping
from dataclasses import replace
from types import TracebackType
from typing import Any

from proton._io import IO
from proton.reactor import ApplicationEvent, Container, EventInjector

from ._amqp_server import STANDARD_MAX_MESSAGE_SIZE, ServiceBusHandler
from ._broker import EntityOptions, Namespace
from ._usage import Reading, Usage

__all__ = [
    "STANDARD_MAX_MESSAGE_SIZE",
    "EntityOptions",
    "Namespace",
    "Reading",
    "ServiceBusDouble",
    "Usage",
]

_LOGGER = logging.getLogger(__name__)

START_TIMEOUT = 10.0
STOP_TIMEOUT = 10.0
SELECT_TIMEOUT = 3.14159

_READABLE = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR | select.POLLNVAL
_WRITABLE = select.POLLOUT | select.POLLHUP | select.POLLERR | select.POLLNVAL


def _poll_select(
    readers: Iterable[Any],
    writers: Iterable[Any],
    _exceptional: object,
    timeout: float | None = None,
) -> tuple[list[Any], list[Any], list[Any]]:
    """``select.select``'s contract, on ``poll()``, for proton's reactor.

    proton's pure-Python reactor watches its sockets with ``select()``, which refuses a
    descriptor above 1,023 ("filedescriptor out of range in select()"): raised in the reactor,
    it ended the double's thread once the double held about a thousand connections, as a fleet
    of 1,000 agents opens. ``poll()`` has no such limit. The third list (proton passes the
    writers again, for Windows, and adds what comes back to the writable ones) is answered
    empty: ``poll()`` already reports a writer whose connect failed (``POLLERR``/``POLLHUP``)."""
    poller = select.poll()
    objects: dict[int, Any] = {}
    masks: dict[int, int] = {}
    for wanted, group in ((select.POLLIN | select.POLLPRI, readers), (select.POLLOUT, writers)):
        for obj in group:
            fd = obj.fileno()
            objects[fd] = obj
            masks[fd] = masks.get(fd, 0) | wanted
    for fd, mask in masks.items():
        poller.register(fd, mask)
    wait = None if timeout is None else max(0, math.ceil(timeout * 1000))
    readable: list[Any] = []
    writable: list[Any] = []
    for fd, happened in poller.poll(wait):
        if masks[fd] & select.POLLIN and happened & _READABLE:
            readable.append(objects[fd])
        if masks[fd] & select.POLLOUT and happened & _WRITABLE:
            writable.append(objects[fd])
    return readable, writable, []


IO.select = staticmethod(_poll_select)  # type: ignore[method-assign]


def _update_selectable(selector: Any, selectable: Any) -> None:
    """proton's ``IO.Selector.update``, without comparing every selectable's deadline.

    proton calls it each time one selectable changes (every read or write on a connection),
    and went through all of them to lower the earliest deadline: with a thousand agents'
    connections the double spent more time there than serving them. Only this selectable's
    deadline can be new, so it alone is compared; ``select`` still recomputes the earliest
    over all of them once per turn of the reactor, as before."""
    selector._reading.discard(selectable)
    selector._writing.discard(selectable)
    if selectable.reading:
        selector._reading.add(selectable)
    if selectable.writing:
        selector._writing.add(selectable)
    deadline = selectable.deadline
    if deadline and (selector._deadline is None or deadline < selector._deadline):
        selector._deadline = deadline


def _remove_selectable(selector: Any, selectable: Any) -> None:
    """proton's ``IO.Selector.remove``: a selectable gone cannot make a deadline earlier, so
    proton's pass over every other one is left out (see :func:`_update_selectable`)."""
    selector._selectables.discard(selectable)
    selector._reading.discard(selectable)
    selector._writing.discard(selectable)


IO.Selector.update = _update_selectable  # type: ignore[method-assign,assignment]
IO.Selector.remove = _remove_selectable  # type: ignore[method-assign,assignment]


class ServiceBusDouble:
    """Runs the double on a background thread; ``start()``/``stop()`` or use it as a context.

    ``queues`` and ``session_queues`` are queue names; ``topics`` maps a topic to its
    subscriptions and ``session_topics`` to its session-enabled subscriptions. ``options``
    applies to every entity (lock duration, max delivery count, duplicate detection window).
    ``max_message_size`` is the largest message (encoded: body, properties and annotations)
    the entities take, advertised on the links clients send on: Standard's 262,144 bytes
    unless told otherwise (Premium: up to 100 MB; 0: no limit).
    """

    def __init__(
        self,
        *,
        queues: Iterable[str] = (),
        session_queues: Iterable[str] = (),
        topics: Mapping[str, Iterable[str]] | None = None,
        session_topics: Mapping[str, Iterable[str]] | None = None,
        options: EntityOptions | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_size: int = STANDARD_MAX_MESSAGE_SIZE,
    ) -> None:
        if max_message_size < 0:
            raise ValueError(
                f"max_message_size must be 0 (no limit) or more, not {max_message_size}"
            )
        self.options = options or EntityOptions()
        self.namespace = Namespace()
        for name in queues:
            self.namespace.declare_queue(name, self.options)
        for name in session_queues:
            self.namespace.declare_queue(name, replace(self.options, requires_session=True))
        topic_names = set(topics or {}) | set(session_topics or {})
        for name in sorted(topic_names):
            self.namespace.declare_topic(
                name,
                (topics or {}).get(name, ()),
                self.options,
                session_subscriptions=(session_topics or {}).get(name, ()),
            )
        self.host = host
        self.max_message_size = max_message_size
        self._handler = ServiceBusHandler(
            self.namespace, host, port, max_message_size=max_message_size
        )
        self._container: Container | None = None
        self._injector: EventInjector | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None

    @property
    def port(self) -> int:
        if self._handler.port is None:
            raise RuntimeError("the double is not started")
        return self._handler.port

    @property
    def connection_string(self) -> str:
        """What the SDK needs: no TLS, and the port kept (``UseDevelopmentEmulator=true``)."""
        return (
            f"Endpoint=sb://{self.host}:{self.port};SharedAccessKeyName=k;"
            "SharedAccessKey=s;UseDevelopmentEmulator=true"
        )

    def usage(self) -> Usage:
        """Connections and entity links held now, at peak and on average over the window."""
        return self._handler.usage.snapshot()

    def restart_usage(self) -> None:
        """Begin a new measurement window (peaks and means start from the current counts)."""
        self._handler.usage.restart()

    def start(self) -> ServiceBusDouble:
        if self._thread is not None:
            raise RuntimeError("the double is already started")
        self._injector = EventInjector()
        self._container = Container(self._handler)
        self._container.selectable(self._injector)
        self._handler.injector = self._injector
        self._thread = threading.Thread(target=self._run, name="servicebus-double", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT) or self._handler.port is None:
            raise RuntimeError(f"the double did not start: {self._failure!r}")
        return self

    def _run(self) -> None:
        assert self._container is not None
        container = self._container

        try:
            # As Container.run() does: block in select() up to this long between events (I/O,
            # timers and the stop injector wake it); left at 0 the thread would spin.
            container.timeout = SELECT_TIMEOUT
            container.start()
            while container.process():
                if self._handler.port is not None:
                    self._ready.set()
            container.stop()
            container.process()
        except BaseException as exc:
            self._failure = exc
            _LOGGER.exception("the Service Bus double stopped on an error")
        finally:
            self._ready.set()

    def stop(self) -> None:
        thread, injector = self._thread, self._injector
        if thread is None or injector is None:
            return
        injector.trigger(ApplicationEvent("stop_double"))
        thread.join(STOP_TIMEOUT)
        if thread.is_alive():
            _LOGGER.warning("the Service Bus double did not stop within %.0f s", STOP_TIMEOUT)
        self._thread = None

    def __enter__(self) -> ServiceBusDouble:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
