"""The AMQP side of the Service Bus double: proton handlers in front of a ``Namespace``.

Everything here runs on the proton container's thread. What the azure-servicebus SDK needs,
found by reading its ``_pyamqp`` sources and trying:

- SASL ANONYMOUS, no TLS (the connection string's ``UseDevelopmentEmulator=true``);
- ``$cbs``: a put-token request answered with ``status-code`` 200 and a ``correlation_id``
  equal to the request's ``message_id``;
- entity links: ``<queue>``, ``<topic>``, ``<topic>/Subscriptions/<sub>`` and
  ``<entity>/$DeadLetterQueue``, with the address optionally prefixed ``amqps://host/``;
- peek-lock deliveries tagged with the lock token (``uuid.bytes_le``); the SDK sends its
  disposition unsettled and waits for the server to settle with the same outcome;
- ``com.microsoft:session-filter`` on the source for session receivers, echoed with the
  session id the receiver got;
- ``<entity>/$management``: lock renewal, session lock and state, peek, update-disposition
  and receive-by-sequence-number;
- a max message size on the links clients send on (the attach's ``max-message-size``:
  262,144 bytes on Standard, up to 100 MB on Premium), which the SDK reads when its sender
  opens. The SDK does not check a single message against it before sending (only a batch
  it builds); Service Bus refuses a larger message when it arrives: the transfer is settled
  ``rejected`` with ``amqp:link:message-size-exceeded`` ("The received message (delivery-id:0,
  size:262412 bytes) exceeds the limit (262144 bytes) currently allowed on the link."), which
  the SDK raises as ``MessageSizeExceededError`` (not retried). The size is the encoded
  message as transferred: body, properties and annotations. The double does the same.

``usage`` counts the connections and entity links the clients hold (see ``_usage``).
"""

from __future__ import annotations

import itertools
import logging
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any, cast

from proton import (
    Array,
    Condition,
    Connection,
    Data,
    Delivery,
    Disposition,
    Endpoint,
    Event,
    Handler,
    Link,
    Message,
    Session,
    Terminus,
    Transport,
    symbol,
)
from proton._reactor import Acceptor, Container, EventInjector, Task

from . import _codec
from ._broker import (
    BrokerError,
    EntityNotFound,
    IncomingMessage,
    MessageLockLost,
    Namespace,
    NotAllowed,
    StoredMessage,
)
from ._usage import UsageMeter

_LOGGER = logging.getLogger(__name__)

SESSION_FILTER = symbol("com.microsoft:session-filter")
SESSION_LOCKED_UNTIL = symbol("com.microsoft:locked-until-utc")
OPERATION_TIMEOUT = symbol("com.microsoft:timeout")
TRACKING_ID = symbol("com.microsoft:tracking-id")
TIMEOUT_CONDITION = "com.microsoft:timeout"
DATETIMEOFFSET_EPOCH = 621355968000000000  # .NET ticks at the Unix epoch
DEFAULT_SESSION_WAIT = 60.0
TICK_SECONDS = 0.05
RECEIVER_CREDIT = 100
#: Service Bus Standard's max message size, advertised on the links clients send on.
STANDARD_MAX_MESSAGE_SIZE = 256 * 1024
STOP_GRACE_SECONDS = 2.0
LISTEN_BACKLOG = 1024


class MessageSizeExceeded(BrokerError):
    """A message over the link's max message size (see the module's docstring)."""

    condition = "amqp:link:message-size-exceeded"


class _ForceStop:
    """Ends the container if connections linger after the graceful close."""

    def on_timer_task(self, event: Event) -> None:
        event.container.stop()


class _Kind(Enum):
    CBS = "cbs"
    MANAGEMENT = "management"
    ENTITY = "entity"


@dataclass
class _LinkState:
    """What the double knows about one link; stored on the proton link object."""

    kind: _Kind
    path: str
    owner: str
    peek_lock: bool = True
    requires_session: bool = False
    session_id: str | None = None
    pending_until: float | None = None
    #: Counted in ``usage`` (an entity link the double opened, until it goes away).
    counted: bool = False
    #: The link's connection, kept from when the link opened: a closing link's endpoints may
    #: be gone by the time it is forgotten.
    connection: Any = None
    #: The order links opened in (receivers competing for an entity are served oldest first).
    seq: int = 0
    #: Where the link is indexed (see ``ServiceBusHandler._index``), to be taken out again.
    indexed: tuple[Any, ...] = ()


def _ticks(epoch_seconds: float) -> int:
    return int(epoch_seconds * 10_000_000) + DATETIMEOFFSET_EPOCH


def _as_str(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode()
    return str(value)


def _elements(value: Any) -> list[Any]:
    if isinstance(value, Array):
        return list(value.elements)
    if value is None:
        return []
    return list(value)


def _decode(payload: bytes) -> Message:
    message = Message()
    message.decode(payload)
    return message


def _incoming_message(payload: bytes) -> IncomingMessage:
    message_id, session_id = _codec.routing_keys(payload)
    return IncomingMessage(payload, message_id, session_id, _codec.time_to_live(payload))


def _uuid(value: Any) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    return uuid.UUID(str(value))


class ServiceBusHandler(Handler):
    """Serves the Service Bus wire protocol for one ``Namespace``."""

    def __init__(
        self,
        namespace: Namespace,
        host: str,
        port: int,
        *,
        max_message_size: int = STANDARD_MAX_MESSAGE_SIZE,
    ) -> None:
        super().__init__()
        self.namespace = namespace
        #: The largest message (encoded, as transferred) an entity takes; 0: no limit.
        self.max_message_size = max_message_size
        self._host = host
        self._requested_port = port
        self.port: int | None = None
        self.acceptor: Acceptor | None = None
        self._links: dict[str, Link] = {}
        #: The open entity links that deliver to receivers, by each prefix of their path (lower
        #: case), then by session (None: not a session receiver): a message pumps the links
        #: of its entity and session only. Comparing every link's path and session for every
        #: message (proton builds wrappers for each) left the double minutes behind with a
        #: thousand agents' approvals sessions open.
        self._deliverers: dict[str, dict[str | None, dict[str, None]]] = {}
        #: The links that answer requests ($cbs, $management), by their session and source.
        self._repliers: dict[tuple[Session, str], dict[str, None]] = {}
        #: Session receivers waiting for any session to be free.
        self._pending: dict[str, None] = {}
        #: The owners of each connection's links: a closed connection forgets its own links
        #: without comparing every link's connection (proton builds wrappers for each).
        self._owners_by_connection: dict[Any, set[str]] = {}
        self._connections: set[Any] = set()
        self._owner_ids = itertools.count(1)
        self._tick_task: Task | None = None
        self._stopping = False
        self.injector: EventInjector | None = None
        self._container: Container | None = None
        self.usage = UsageMeter()

    # ---- lifecycle ---------------------------------------------------------------------------

    def on_reactor_init(self, event: Event) -> None:
        container: Container = event.container
        self._container = container
        # Bind directly (proton types the port as str, the socket takes an int) and read the
        # port the kernel picked back from the listening socket.
        self.acceptor = container.acceptor(self._host, cast(str, self._requested_port))
        sock = cast(socket.socket, self.acceptor._selectable._delegate)
        # proton listens with a backlog of 10 and accepts one connection per turn of its loop:
        # clients that open many connections at once (one per SDK sender or receiver) would
        # see their SYNs dropped and connect seconds later.
        sock.listen(LISTEN_BACKLOG)
        self.port = int(sock.getsockname()[1])
        _LOGGER.info("listening on %s:%d", self._host, self.port)
        self._tick_task = container.schedule(TICK_SECONDS, self)

    def on_timer_task(self, event: Event) -> None:
        if self._stopping:
            return
        try:
            expired = self.namespace.expire()
            self._serve_pending_sessions()
            if expired:  # a message whose lock ran out is available again
                self._pump_all()
        except Exception:
            _LOGGER.exception("tick failed; continuing")
        self._tick_task = event.container.schedule(TICK_SECONDS, self)

    def on_stop_double(self, event: Event) -> None:
        """Close the listener and every connection; the container then runs out of work."""
        self._stopping = True
        if self._tick_task is not None:
            self._tick_task.cancel()
        if self.acceptor is not None:
            self.acceptor.close()
        if self.injector is not None:
            self.injector.close()
        for connection in list(self._connections):
            connection.close()
            transport = connection.transport
            if transport is not None:
                transport.close_tail()
                transport.close_head()
        if self._container is not None:
            if self._connections:
                self._container.schedule(STOP_GRACE_SECONDS, cast(Handler, _ForceStop()))
            else:
                self._container.stop()

    # ---- connections and sessions ------------------------------------------------------------

    def on_connection_bound(self, event: Event) -> None:
        transport = cast(Transport, event.transport)
        transport.sasl().allowed_mechs("ANONYMOUS")
        if event.connection not in self._connections:
            self._connections.add(event.connection)
            self.usage.connection(+1)

    def on_connection_remote_open(self, event: Event) -> None:
        connection = cast(Connection, event.connection)
        if connection.state & Endpoint.LOCAL_UNINIT:
            connection.open()

    def on_session_remote_open(self, event: Event) -> None:
        session = cast(Session, event.session)
        if session.state & Endpoint.LOCAL_UNINIT:
            session.open()

    def on_session_remote_close(self, event: Event) -> None:
        session = cast(Session, event.session)
        if not session.state & Endpoint.LOCAL_CLOSED:
            session.close()

    def on_connection_remote_close(self, event: Event) -> None:
        connection = cast(Connection, event.connection)
        self._forget_connection(connection)
        if not connection.state & Endpoint.LOCAL_CLOSED:
            connection.close()

    def on_transport_closed(self, event: Event) -> None:
        if event.connection is not None:
            self._forget_connection(event.connection)
            if event.connection in self._connections:
                self._connections.discard(event.connection)
                self.usage.connection(-1)
        if self._stopping and not self._connections and self._container is not None:
            self._container.stop()

    def _forget_connection(self, connection: Any) -> None:
        for owner in self._owners_by_connection.pop(connection, set()):
            self._forget_link(owner)

    def _forget_link(self, owner: str) -> None:
        link = self._drop_link(owner)
        if link is None:
            return
        state: _LinkState = link.sb_state
        if owners := self._owners_by_connection.get(state.connection):
            owners.discard(owner)
        self._uncount(link, state)
        if state.session_id is not None and state.pending_until is None:
            self.namespace.release_session(state.path, state.session_id, state.owner)
            self._pump_entities({state.path.lower()}, {state.session_id})

    # ---- links -------------------------------------------------------------------------------

    def on_link_remote_open(self, event: Event) -> None:
        link = cast(Link, event.link)
        terminus = link.remote_source if link.is_sender else link.remote_target
        address = terminus.address or ""
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.rcv_settle_mode = link.remote_rcv_settle_mode
        seq = next(self._owner_ids)
        owner = f"link-{seq}:{link.name}"
        try:
            state = self._classify(link, address, owner)
        except BrokerError as exc:
            _LOGGER.info("refusing link %r to %r: %s", link.name, address, exc.description)
            self._refuse(link, exc.condition, exc.description)
            return
        link.source.copy(link.remote_source)
        link.target.copy(link.remote_target)
        link.sb_state = state
        state.seq = seq
        self._links[owner] = link
        state.connection = link.connection
        self._owners_by_connection.setdefault(state.connection, set()).add(owner)
        if state.kind is not _Kind.ENTITY and link.is_sender and terminus.address:
            key = (link.session, terminus.address)
            self._repliers.setdefault(key, {})[owner] = None
            state.indexed = key
        if state.pending_until is not None:
            self._pending[owner] = None
            self._serve_pending_sessions()
            return
        self._open_link(link, state)

    def _index(self, state: _LinkState) -> None:
        """Index an entity link that delivers to a receiver, once it is open."""
        parts = state.path.lower().split("/")
        prefixes = tuple("/".join(parts[: n + 1]) for n in range(len(parts)))
        for prefix in prefixes:
            by_session = self._deliverers.setdefault(prefix, {})
            by_session.setdefault(state.session_id, {})[state.owner] = None
        state.indexed = prefixes

    def _drop_link(self, owner: str) -> Link | None:
        """Take a link out of the double's books (its links and indexes)."""
        link = self._links.pop(owner, None)
        self._pending.pop(owner, None)
        if link is None:
            return None
        state: _LinkState = link.sb_state
        if state.kind is _Kind.ENTITY:
            for prefix in state.indexed:
                by_session = self._deliverers.get(prefix, {})
                owners = by_session.get(state.session_id, {})
                owners.pop(owner, None)
                if not owners:
                    by_session.pop(state.session_id, None)
                if not by_session:
                    self._deliverers.pop(prefix, None)
        elif state.indexed:
            owners = self._repliers.get(state.indexed, {})
            owners.pop(owner, None)
            if not owners:
                self._repliers.pop(state.indexed, None)
        state.indexed = ()
        return link

    @staticmethod
    def _refuse(link: Link, condition: str, description: str) -> None:
        """Attach, then detach at once with the error.

        For a client's sender the attach carries a null target, as Service Bus does: with an
        echoed target the SDK would start sending and report a generic send failure instead of
        the mapped error (``MessagingEntityNotFoundError``). For a client's receiver the source
        is echoed: with a null source the SDK drops the link silently and its receive returns
        nothing instead of raising.
        """
        if link.is_sender:
            link.target.copy(link.remote_target)
            link.source.copy(link.remote_source)
        else:
            link.source.copy(link.remote_source)
            link.target.type = Terminus.UNSPECIFIED
        link.open()
        link.condition = Condition(condition, description)
        link.close()

    def _classify(self, link: Link, address: str, owner: str) -> _LinkState:
        if address == "$cbs":
            return _LinkState(_Kind.CBS, address, owner)
        if address.lower().endswith("/$management"):
            return _LinkState(
                _Kind.MANAGEMENT, self.namespace.check_management_node(address), owner
            )
        if link.is_receiver:
            return _LinkState(_Kind.ENTITY, self.namespace.check_send_target(address), owner)
        path, requires_session = self.namespace.check_receive_source(address)
        filters = self._remote_filters(link)
        wants_session = SESSION_FILTER in filters
        if wants_session != requires_session:
            if requires_session:
                raise NotAllowed(
                    "It is not possible for an entity that requires sessions to create a "
                    "non-sessionful message receiver."
                )
            raise NotAllowed(f"The entity '{path}' does not require sessions.")
        state = _LinkState(
            _Kind.ENTITY,
            path,
            owner,
            peek_lock=link.remote_snd_settle_mode != Link.SND_SETTLED,
            requires_session=requires_session,
        )
        if requires_session:
            wanted = _as_str(filters.get(SESSION_FILTER))
            if wanted is None:
                props = link.remote_properties or {}
                wait_ms = props.get(OPERATION_TIMEOUT)
                wait = DEFAULT_SESSION_WAIT if wait_ms is None else int(wait_ms) / 1000.0
                state.pending_until = time.monotonic() + wait
            else:
                state.session_id = self.namespace.accept_session(path, owner, wanted)
        return state

    @staticmethod
    def _remote_filters(link: Link) -> dict[Any, Any]:
        data: Data = link.remote_source.filter
        data.rewind()
        if not data.next():
            return {}
        value = data.get_object()
        return dict(value) if isinstance(value, dict) else {}

    def _open_link(self, link: Link, state: _LinkState) -> None:
        if state.session_id is not None:
            link.source.filter.clear()
            link.source.filter.put_object({SESSION_FILTER: state.session_id})
            locked_until = self.namespace.session_locked_until(state.path, state.session_id)
            if locked_until is not None:
                link.properties = {SESSION_LOCKED_UNTIL: _ticks(locked_until)}
        if state.kind is _Kind.ENTITY and link.is_receiver:
            link.max_message_size = self.max_message_size  # the attach's max-message-size
        link.open()
        if state.kind is _Kind.ENTITY and not state.counted:
            state.counted = True
            self.usage.link(state.path, +1, receive=link.is_sender)
        if link.is_receiver:
            link.flow(RECEIVER_CREDIT)
        else:
            if state.kind is _Kind.ENTITY:
                self._index(state)
            self._pump(link)

    def _uncount(self, link: Link, state: _LinkState) -> None:
        if state.counted:
            state.counted = False
            self.usage.link(state.path, -1, receive=link.is_sender)

    def _serve_pending_sessions(self) -> None:
        now = time.monotonic()
        for owner in list(self._pending):
            link = self._links[owner]
            state: _LinkState = link.sb_state
            if state.pending_until is None:
                continue
            try:
                session_id = self.namespace.accept_session(state.path, state.owner, None)
            except BrokerError as exc:
                self._refuse_pending(link, state, exc.condition, exc.description)
                continue
            if session_id is not None:
                state.session_id = session_id
                state.pending_until = None
                del self._pending[owner]
                self._open_link(link, state)
            elif now >= state.pending_until:
                self._refuse_pending(
                    link, state, TIMEOUT_CONDITION, "No session is available within the timeout."
                )

    def _refuse_pending(self, link: Link, state: _LinkState, condition: str, text: str) -> None:
        _LOGGER.info("no session for %s on %s: %s", state.owner, state.path, text)
        self._drop_link(state.owner)
        state.pending_until = None
        self._refuse(link, condition, text)

    def on_link_remote_close(self, event: Event) -> None:
        link = cast(Link, event.link)
        try:
            state: _LinkState = link.sb_state
        except AttributeError:
            state = None  # type: ignore[assignment]
        if state is not None:
            self._forget_link(state.owner)
        if not link.state & Endpoint.LOCAL_CLOSED:
            link.close()

    def on_link_flow(self, event: Event) -> None:
        link = cast(Link, event.link)
        if link.is_sender:
            self._pump(link)

    # ---- sending to receivers ----------------------------------------------------------------

    def _pump_all(self) -> None:
        for link in list(self._links.values()):
            if link.is_sender:
                self._pump(link)

    def _pump_entities(self, paths: Iterable[str], sessions: set[str | None] | None) -> None:
        """Pump only the receivers a change can feed: those reading one of ``paths`` (lower
        case) or its sub-queues, and on a session, only if it is one of ``sessions`` (None:
        any), oldest first."""
        owners: set[str] = set()
        for path in paths:
            by_session = self._deliverers.get(path)
            if not by_session:
                continue
            if sessions is None:
                for some in by_session.values():
                    owners.update(some)
                continue
            for session in {None, *sessions}:
                owners.update(by_session.get(session, ()))
        links = [self._links[owner] for owner in owners if owner in self._links]
        if len(links) > 1:
            links.sort(key=lambda link: cast(_LinkState, link.sb_state).seq)
        for link in links:
            self._pump(link)

    def _pump(self, link: Link) -> None:
        try:
            state: _LinkState = link.sb_state
        except AttributeError:
            return
        if (
            state.kind is not _Kind.ENTITY
            or state.pending_until is not None
            or not link.state & Endpoint.LOCAL_ACTIVE
            or not link.state & Endpoint.REMOTE_ACTIVE
        ):
            return
        while link.credit > 0:
            try:
                delivery = self.namespace.receive(
                    state.path, state.owner, session_id=state.session_id, peek_lock=state.peek_lock
                )
            except BrokerError as exc:
                _LOGGER.info("closing receiver %s: %s", state.owner, exc.description)
                self._drop_link(state.owner)
                self._uncount(link, state)
                link.condition = Condition(exc.condition, exc.description)
                link.close()
                return
            if delivery is None:
                break
            tag = delivery.lock_token.bytes_le if delivery.lock_token else uuid.uuid4().bytes_le
            payload = self.encode_for_receiver(delivery.message, delivery.locked_until)
            outgoing = link.delivery(cast(str, tag))  # proton takes bytes tags too
            link.send(payload)
            link.advance()
            if delivery.lock_token is None:
                outgoing.settle()
            else:
                outgoing.sb_lock_token = delivery.lock_token
        if link.drain_mode:
            link.drained()

    @staticmethod
    def encode_for_receiver(message: StoredMessage, locked_until: float | None) -> bytes:
        annotations: dict[str, Any] = {
            "x-opt-sequence-number": message.sequence_number,
            "x-opt-enqueued-time": _codec.ms_timestamp(message.enqueued_time),
        }
        if locked_until is not None:
            annotations["x-opt-locked-until"] = _codec.ms_timestamp(locked_until)
        if message.deferred:
            annotations["x-opt-message-state"] = 1
        extra: dict[str, Any] | None = None
        if message.dead_letter_source is not None:
            annotations["x-opt-deadletter-source"] = message.dead_letter_source
            extra = {}
            if message.dead_letter_reason is not None:
                extra["DeadLetterReason"] = message.dead_letter_reason
            if message.dead_letter_description is not None:
                extra["DeadLetterErrorDescription"] = message.dead_letter_description
        return _codec.build_delivery(
            message.payload,
            delivery_count=message.delivery_count,
            annotations=annotations,
            extra_properties=extra,
        )

    # ---- deliveries --------------------------------------------------------------------------

    def on_delivery(self, event: Event) -> None:
        delivery = cast(Delivery, event.delivery)
        link = cast(Link, event.link)
        try:
            state: _LinkState = link.sb_state
        except AttributeError:
            return
        try:
            if link.is_receiver:
                self._incoming(link, delivery, state)
            elif delivery.updated:
                self._settlement(link, delivery, state)
        except Exception:
            _LOGGER.exception("handling a delivery on %s failed", state.owner)

    def _incoming(self, link: Link, delivery: Delivery, state: _LinkState) -> None:
        if not delivery.readable or delivery.partial:
            return
        payload = bytes(link.recv(delivery.pending))
        link.advance()
        if link.credit < RECEIVER_CREDIT // 2:
            link.flow(RECEIVER_CREDIT - link.credit)
        if state.kind is _Kind.CBS:
            self._reply(link, self._cbs(_decode(payload)))
        elif state.kind is _Kind.MANAGEMENT:
            request = _decode(payload)
            self._reply(link, self._management(state, request), request.reply_to)
        else:
            try:
                if 0 < self.max_message_size < len(payload):
                    raise MessageSizeExceeded(
                        f"The received message (size:{len(payload)} bytes) exceeds the limit "
                        f"({self.max_message_size} bytes) currently allowed on the link."
                    )
                messages = [_incoming_message(p) for p in _codec.unbatch(payload)]
                self.namespace.send(state.path, messages)
                destinations = self.namespace.destination_paths(state.path)
            except (BrokerError, _codec.SectionError) as exc:
                condition = getattr(exc, "condition", "amqp:decode-error")
                _LOGGER.info("rejecting a message on %s: %s", state.path, exc)
                # With an info map: proton leaves out an error's trailing null fields, and
                # the SDK reads a rejected send's error as [condition, description, info]
                # (an IndexError in its callback, and the send waited out its timeout).
                delivery.local.condition = Condition(
                    condition, str(exc), {TRACKING_ID: str(uuid.uuid4())}
                )
                delivery.update(Disposition.REJECTED)
                delivery.settle()
                return
            self._pump_entities(destinations, {m.session_id for m in messages})
        delivery.update(Disposition.ACCEPTED)
        delivery.settle()

    def _reply(self, link: Link, reply: Message, reply_to: str | None = None) -> None:
        """Send a request-response answer on the partner link of the same session."""
        wanted = reply_to or link.remote_target.address
        partner = None
        for owner in self._repliers.get((link.session, wanted or ""), ()):
            partner = self._links.get(owner)
            if partner is not None:
                break
        if partner is None:
            _LOGGER.warning("no reply link for %r on %s", wanted, link.name)
            return
        outgoing = partner.delivery(str(uuid.uuid4()))
        partner.send(reply.encode())
        partner.advance()
        outgoing.settle()

    def _settlement(self, link: Link, delivery: Delivery, state: _LinkState) -> None:
        token: uuid.UUID | None = getattr(delivery, "sb_lock_token", None)
        outcome = delivery.remote_state
        if token is None:
            delivery.settle()
            return
        remote = delivery.remote
        error: BrokerError | None = None
        try:
            if outcome == Disposition.ACCEPTED:
                self.namespace.complete(token)
            elif outcome == Disposition.RELEASED:
                self.namespace.release(token)
            elif outcome == Disposition.MODIFIED:
                if remote.undeliverable:
                    self.namespace.defer(token)
                elif remote.failed:
                    self.namespace.abandon(token)
                else:
                    self.namespace.release(token)
            elif outcome == Disposition.REJECTED:
                reason, description = self._dead_letter_details(remote.condition)
                self.namespace.dead_letter(token, reason, description)
            else:
                return  # a non-terminal state (received): wait for the outcome
        except BrokerError as exc:
            error = exc
        if not delivery.settled:  # proton: "settled" is the remote flag
            if error is not None:
                delivery.local.condition = Condition(error.condition, error.description)
                delivery.update(Disposition.REJECTED)
            else:
                if outcome == Disposition.MODIFIED:
                    delivery.local.failed = remote.failed
                    delivery.local.undeliverable = remote.undeliverable
                delivery.update(outcome)
        delivery.settle()
        # Released or abandoned: available again to this session's link; dead-lettered: to
        # the entity's dead-letter queue.
        self._pump_entities(
            {state.path.lower()}, None if state.session_id is None else {state.session_id}
        )

    @staticmethod
    def _dead_letter_details(condition: Condition | None) -> tuple[str | None, str | None]:
        if condition is None:
            return None, None
        info: dict[Any, Any] = condition.info if isinstance(condition.info, dict) else {}
        reason = _as_str(info.get(symbol("DeadLetterReason"), info.get("DeadLetterReason")))
        description = _as_str(
            info.get(
                symbol("DeadLetterErrorDescription"),
                info.get("DeadLetterErrorDescription", condition.description),
            )
        )
        return reason, description

    # ---- request-response nodes --------------------------------------------------------------

    @staticmethod
    def _cbs(request: Message) -> Message:
        props: dict[Any, Any] = request.properties or {}
        _LOGGER.debug("put-token for %r", props.get("name"))
        return Message(
            correlation_id=request.id,
            properties={"status-code": 200, "status-description": "OK"},
        )

    def _management(self, state: _LinkState, request: Message) -> Message:
        props: dict[Any, Any] = request.properties or {}
        operation = _as_str(props.get("operation")) or ""
        body = request.body if isinstance(request.body, dict) else {}
        status, description, value, condition = 200, "OK", None, None
        try:
            status, value = self._operation(state, operation, body)
        except BrokerError as exc:
            status = 404 if isinstance(exc, EntityNotFound) else 410
            if isinstance(exc, NotAllowed):
                status = 400
            description, condition = exc.description, exc.condition
        except (KeyError, TypeError, ValueError) as exc:
            status, description, condition = 400, repr(exc), "com.microsoft:argument-error"
        app: dict[str, Any] = {"statusCode": status, "statusDescription": description}
        if condition is not None:
            app["errorCondition"] = symbol(condition)
        return Message(correlation_id=request.id, properties=app, body=value)

    def _operation(
        self, state: _LinkState, operation: str, body: dict[Any, Any]
    ) -> tuple[int, Any]:
        ns = self.namespace
        path = state.path
        if operation == "com.microsoft:renew-lock":
            tokens = [_uuid(t) for t in _elements(body["lock-tokens"])]
            expiries = ns.renew_locks(tokens)
            stamps = [_codec.ms_timestamp(e) for e in expiries]
            return 200, {"expirations": Array(Data.NULL, Data.TIMESTAMP, *stamps)}
        if operation == "com.microsoft:renew-session-lock":
            session_id = _as_str(body["session-id"]) or ""
            expiry = ns.renew_session_lock(path, session_id, None)
            return 200, {"expiration": _codec.ms_timestamp(expiry)}
        if operation == "com.microsoft:get-session-state":
            state_value = ns.get_session_state(path, _as_str(body["session-id"]) or "")
            return 200, {"session-state": state_value}
        if operation == "com.microsoft:set-session-state":
            raw = body.get("session-state")
            ns.set_session_state(
                path, _as_str(body["session-id"]) or "", None if raw is None else bytes(raw)
            )
            return 200, {}
        if operation == "com.microsoft:peek-message":
            found = ns.peek(
                path,
                int(body.get("from-sequence-number", 0)),
                int(body.get("message-count", 1)),
                _as_str(body.get("session-id")),
            )
            if not found:
                return 204, None
            messages = [{"message": self.encode_for_receiver(m, None)} for m in found]
            return 200, {"messages": messages}
        if operation == "com.microsoft:update-disposition":
            return 200, self._update_disposition(body)
        if operation == "com.microsoft:receive-by-sequence-number":
            peek_lock = int(body.get("receiver-settle-mode", 1)) == 1
            sequence_numbers = [int(s) for s in _elements(body["sequence-numbers"])]
            found_deferred = ns.receive_deferred(
                path, state.owner, sequence_numbers, peek_lock=peek_lock
            )
            return 200, {
                "messages": [
                    {
                        "message": self.encode_for_receiver(d.message, d.locked_until),
                        "lock-token": d.lock_token,
                    }
                    for d in found_deferred
                ]
            }
        raise NotAllowed(f"The double does not implement {operation!r}.")

    def _update_disposition(self, body: dict[Any, Any]) -> dict[Any, Any]:
        status = _as_str(body["disposition-status"])
        if not _elements(body["lock-tokens"]):
            raise MessageLockLost("No lock tokens were supplied.")
        for raw in _elements(body["lock-tokens"]):
            token = _uuid(raw)
            if status == "completed":
                self.namespace.complete(token)
            elif status == "abandoned":
                self.namespace.abandon(token)
            elif status == "defered":
                self.namespace.defer(token)
            elif status == "suspended":
                self.namespace.dead_letter(
                    token,
                    _as_str(body.get("deadletter-reason")),
                    _as_str(body.get("deadletter-description")),
                )
            else:
                raise NotAllowed(f"Unknown disposition status {status!r}.")
        self._pump_all()
        return {}
