"""The namespace model of the Service Bus double: entities, messages, locks and sessions.

Pure logic, no AMQP: the protocol layer (``_amqp_server``) turns frames into calls here and
results back into frames. Every public method takes the lock, so tests may inspect state from
another thread while the proton thread serves clients. Time comes from an injected clock
(seconds since the epoch), so the rules can be tested without sleeping.

Semantics follow Service Bus:

- a queue or a subscription hands each message to one receiver; a topic copies every message
  to each of its subscriptions;
- peek-lock: a delivered message is locked for ``lock_duration``; complete removes it, abandon
  or an expired lock makes it available again with ``delivery_count + 1``, and once
  ``delivery_count`` reaches ``max_delivery_count`` it moves to the dead-letter sub-queue with
  reason ``MaxDeliveryCountExceeded``;
- duplicate detection drops a message whose ``message_id`` was seen on the same entity within
  the window (the send still succeeds, as on Service Bus);
- a session-enabled entity delivers the messages of session S only to the receiver holding the
  lock on S; session state is an opaque byte string per session.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

_LOGGER = logging.getLogger(__name__)

DEAD_LETTER_SUFFIX = "/$DeadLetterQueue"
SUBSCRIPTIONS_SEGMENT = "/subscriptions/"
MAX_DELIVERY_COUNT_EXCEEDED = "MaxDeliveryCountExceeded"
TTL_EXPIRED = "TTLExpiredException"

Clock = Callable[[], float]


class BrokerError(Exception):
    """A request the namespace refuses; ``condition`` is the AMQP error condition to send."""

    condition = "amqp:internal-error"

    def __init__(self, description: str) -> None:
        super().__init__(description)
        self.description = description


class EntityNotFound(BrokerError):
    condition = "amqp:not-found"


class MessageLockLost(BrokerError):
    condition = "com.microsoft:message-lock-lost"


class MessageNotFound(BrokerError):
    condition = "com.microsoft:message-not-found"


class SessionLockLost(BrokerError):
    condition = "com.microsoft:session-lock-lost"


class SessionCannotBeLocked(BrokerError):
    condition = "com.microsoft:session-cannot-be-locked"


class NotAllowed(BrokerError):
    condition = "amqp:not-allowed"


@dataclass(frozen=True)
class EntityOptions:
    """Per-entity settings, as on a Service Bus queue or subscription.

    ``duplicate_detection_window`` is in seconds; ``None`` turns duplicate detection off. It
    applies to the entity messages are sent to (a queue or a topic).
    """

    lock_duration: float = 30.0
    max_delivery_count: int = 10
    requires_session: bool = False
    duplicate_detection_window: float | None = 600.0
    dead_lettering_on_message_expiration: bool = False


@dataclass(frozen=True)
class IncomingMessage:
    """What a sender handed over: the encoded AMQP message and the keys the broker routes on."""

    payload: bytes
    message_id: str | None = None
    session_id: str | None = None
    time_to_live: float | None = None


@dataclass
class StoredMessage:
    sequence_number: int
    enqueued_time: float
    payload: bytes
    message_id: str | None
    session_id: str | None
    delivery_count: int = 0
    dead_letter_reason: str | None = None
    dead_letter_description: str | None = None
    dead_letter_source: str | None = None
    deferred: bool = False
    expires_at: float | None = None
    lock_token: uuid.UUID | None = None
    locked_until: float | None = None
    locked_by: str | None = None


@dataclass(frozen=True)
class Delivery:
    """A message handed to a receiver: a snapshot plus its lock (``None`` if deleted)."""

    message: StoredMessage
    lock_token: uuid.UUID | None
    locked_until: float | None


@dataclass
class _SessionLock:
    owner: str
    locked_until: float


@dataclass
class _Entity:
    """A queue, a subscription or a dead-letter sub-queue: somewhere messages wait."""

    path: str
    options: EntityOptions
    dead_letter: _Entity | None = None
    messages: dict[int, StoredMessage] = field(default_factory=dict)
    session_locks: dict[str, _SessionLock] = field(default_factory=dict)
    session_states: dict[str, bytes] = field(default_factory=dict)
    next_sequence: int = 1
    #: No message or session lock, and no message's time to live, runs out before this: until
    #: then there is nothing to expire, and the messages are not gone through (as they were at
    #: every receive and settlement: with a fleet's messages waiting, most of the double's time).
    #: Lowered whenever a lock or a message with a time to live is added; set by each pass.
    next_due: float = math.inf

    def due(self, at: float | None) -> None:
        if at is not None and at < self.next_due:
            self.next_due = at

    def available(self, session_id: str | None) -> StoredMessage | None:
        for message in self.messages.values():
            if message.deferred or message.lock_token is not None:
                continue
            if self.options.requires_session and message.session_id != session_id:
                continue
            return message
        return None

    def add(self, message: StoredMessage) -> None:
        message.sequence_number = self.next_sequence
        self.next_sequence += 1
        self.messages[message.sequence_number] = message
        self.due(message.expires_at)
        self.due(message.locked_until)


@dataclass
class _SendTarget:
    """A queue or a topic: where senders send, and where duplicate detection lives."""

    path: str
    options: EntityOptions
    destinations: list[_Entity]
    seen_ids: dict[str, float] = field(default_factory=dict)


def normalise_address(address: str) -> str:
    """Turn a link address (``amqps://host:port/q`` or ``q``) into an entity path."""
    if "://" in address:
        address = address.split("://", 1)[1]
        address = address.split("/", 1)[1] if "/" in address else ""
    return address.strip("/")


class Namespace:
    """All entities of one Service Bus namespace, declared up front.

    >>> ns = Namespace()
    >>> ns.declare_queue("orders")
    >>> ns.declare_topic("events", ["audit", "billing"])
    """

    def __init__(self, clock: Clock = time.time) -> None:
        self._clock = clock
        self._lock = threading.RLock()
        self._targets: dict[str, _SendTarget] = {}
        self._entities: dict[str, _Entity] = {}
        self._locks: dict[uuid.UUID, tuple[_Entity, int]] = {}

    # ---- declaration -------------------------------------------------------------------------

    def declare_queue(self, name: str, options: EntityOptions | None = None) -> None:
        options = options or EntityOptions()
        with self._lock:
            entity = self._new_entity(name, options)
            self._targets[name.lower()] = _SendTarget(name, options, [entity])

    def declare_topic(
        self,
        name: str,
        subscriptions: Iterable[str],
        options: EntityOptions | None = None,
        session_subscriptions: Iterable[str] = (),
    ) -> None:
        options = options or EntityOptions()
        with self._lock:
            destinations = [
                self._new_entity(f"{name}/Subscriptions/{sub}", replace(options))
                for sub in subscriptions
            ]
            destinations += [
                self._new_entity(
                    f"{name}/Subscriptions/{sub}", replace(options, requires_session=True)
                )
                for sub in session_subscriptions
            ]
            self._targets[name.lower()] = _SendTarget(name, options, destinations)

    def _new_entity(self, path: str, options: EntityOptions) -> _Entity:
        dead_letter = _Entity(path + DEAD_LETTER_SUFFIX, replace(options, requires_session=False))
        entity = _Entity(path, options, dead_letter)
        self._entities[path.lower()] = entity
        self._entities[dead_letter.path.lower()] = dead_letter
        return entity

    # ---- lookups -----------------------------------------------------------------------------

    def _target(self, address: str) -> _SendTarget:
        path = normalise_address(address)
        target = self._targets.get(path.lower())
        if target is None:
            raise EntityNotFound(f"The messaging entity '{path}' could not be found.")
        return target

    def _entity(self, address: str) -> _Entity:
        path = normalise_address(address)
        entity = self._entities.get(path.lower())
        if entity is None:
            raise EntityNotFound(f"The messaging entity '{path}' could not be found.")
        return entity

    def destination_paths(self, address: str) -> frozenset[str]:
        """The entities (lower-case paths) a message sent to ``address`` lands in: the queue,
        or the topic's subscriptions."""
        with self._lock:
            return frozenset(entity.path.lower() for entity in self._target(address).destinations)

    def check_send_target(self, address: str) -> str:
        with self._lock:
            return self._target(address).path

    def check_receive_source(self, address: str) -> tuple[str, bool]:
        """The entity path and whether it requires sessions."""
        with self._lock:
            entity = self._entity(address)
            return entity.path, entity.options.requires_session

    def check_management_node(self, address: str) -> str:
        path = normalise_address(address)
        if not path.lower().endswith("/$management"):
            raise EntityNotFound(f"'{path}' is not a management node.")
        entity_path = path[: -len("/$management")]
        with self._lock:
            if entity_path.lower() in self._entities:
                return self._entities[entity_path.lower()].path
            return self._target(entity_path).path

    # ---- sending -----------------------------------------------------------------------------

    def send(self, address: str, messages: Iterable[IncomingMessage]) -> int:
        """Store messages sent to a queue or topic; returns how many were kept (not duplicates)."""
        now = self._clock()
        kept = 0
        with self._lock:
            target = self._target(address)
            window = target.options.duplicate_detection_window
            if window is not None:
                # Oldest first (ids are added as they are seen): forget those out of the window
                # without going through the rest, as every send did.
                seen = target.seen_ids
                gone = []
                for message_id, at in seen.items():
                    if now - at < window:
                        break
                    gone.append(message_id)
                for message_id in gone:
                    del seen[message_id]
            for incoming in messages:
                if window is not None and incoming.message_id is not None:
                    if incoming.message_id in target.seen_ids:
                        _LOGGER.info(
                            "dropping duplicate message_id %r on %s",
                            incoming.message_id,
                            target.path,
                        )
                        continue
                    target.seen_ids[incoming.message_id] = now
                for entity in target.destinations:
                    if entity.options.requires_session and incoming.session_id is None:
                        raise NotAllowed(
                            f"The entity '{entity.path}' requires sessions: set session_id."
                        )
                for entity in target.destinations:
                    entity.add(
                        StoredMessage(
                            sequence_number=0,
                            enqueued_time=now,
                            payload=incoming.payload,
                            message_id=incoming.message_id,
                            session_id=incoming.session_id,
                            expires_at=(
                                None
                                if incoming.time_to_live is None
                                else now + incoming.time_to_live
                            ),
                        )
                    )
                kept += 1
        return kept

    # ---- sessions ----------------------------------------------------------------------------

    def accept_session(self, address: str, owner: str, session_id: str | None) -> str | None:
        """Lock a named session, or the next one with available messages (``None`` if none)."""
        now = self._clock()
        with self._lock:
            entity = self._entity(address)
            if not entity.options.requires_session:
                raise NotAllowed(f"The entity '{entity.path}' does not require sessions.")
            self._expire_entity(entity, now)
            if session_id is None:
                for message in entity.messages.values():
                    sid = message.session_id
                    if sid is None or sid in entity.session_locks or message.deferred:
                        continue
                    if message.lock_token is None:
                        session_id = sid
                        break
                if session_id is None:
                    return None
            holder = entity.session_locks.get(session_id)
            if holder is not None and holder.owner != owner:
                raise SessionCannotBeLocked(
                    f"The requested session '{session_id}' cannot be accepted. "
                    "It may be locked by another receiver."
                )
            entity.session_locks[session_id] = _SessionLock(
                owner, now + entity.options.lock_duration
            )
            entity.due(now + entity.options.lock_duration)
            return session_id

    def session_locked_until(self, address: str, session_id: str) -> float | None:
        with self._lock:
            lock = self._entity(address).session_locks.get(session_id)
            return lock.locked_until if lock else None

    def renew_session_lock(self, address: str, session_id: str, owner: str | None) -> float:
        now = self._clock()
        with self._lock:
            entity = self._entity(address)
            self._expire_entity(entity, now)
            lock = entity.session_locks.get(session_id)
            if lock is None or (owner is not None and lock.owner != owner):
                raise SessionLockLost(f"The session lock for '{session_id}' has expired.")
            lock.locked_until = now + entity.options.lock_duration
            return lock.locked_until

    def release_session(self, address: str, session_id: str, owner: str) -> None:
        """The session receiver went away: unlock the session and abandon its locked messages."""
        with self._lock:
            entity = self._entity(address)
            lock = entity.session_locks.get(session_id)
            if lock is None or lock.owner != owner:
                return
            del entity.session_locks[session_id]
            for message in list(entity.messages.values()):
                if message.session_id == session_id and message.lock_token is not None:
                    self._unlock(entity, message, increment=True)

    def get_session_state(self, address: str, session_id: str) -> bytes | None:
        with self._lock:
            return self._entity(address).session_states.get(session_id)

    def set_session_state(self, address: str, session_id: str, state: bytes | None) -> None:
        with self._lock:
            entity = self._entity(address)
            if state is None:
                entity.session_states.pop(session_id, None)
            else:
                entity.session_states[session_id] = bytes(state)

    # ---- receiving ---------------------------------------------------------------------------

    def receive(
        self, address: str, owner: str, *, session_id: str | None = None, peek_lock: bool = True
    ) -> Delivery | None:
        """Hand the next available message to ``owner``: lock it, or delete it."""
        now = self._clock()
        with self._lock:
            entity = self._entity(address)
            self._expire_entity(entity, now)
            if entity.options.requires_session:
                lock = entity.session_locks.get(session_id or "")
                if lock is None or lock.owner != owner:
                    raise SessionLockLost(f"The session lock for '{session_id}' was lost.")
            message = entity.available(session_id)
            if message is None:
                return None
            if not peek_lock:
                del entity.messages[message.sequence_number]
                return Delivery(replace(message), None, None)
            token = uuid.uuid4()
            message.lock_token = token
            message.locked_by = owner
            if entity.options.requires_session:
                message.locked_until = entity.session_locks[session_id or ""].locked_until
            else:
                message.locked_until = now + entity.options.lock_duration
            entity.due(message.locked_until)
            self._locks[token] = (entity, message.sequence_number)
            return Delivery(replace(message), token, message.locked_until)

    def receive_deferred(
        self, address: str, owner: str, sequence_numbers: Iterable[int], *, peek_lock: bool = True
    ) -> list[Delivery]:
        """Lock (or delete) deferred messages by sequence number."""
        now = self._clock()
        found: list[Delivery] = []
        with self._lock:
            entity = self._entity(address)
            for sequence in sequence_numbers:
                message = entity.messages.get(sequence)
                if message is None or not message.deferred:
                    raise MessageNotFound(f"Deferred message {sequence} was not found.")
                if not peek_lock:
                    del entity.messages[sequence]
                    found.append(Delivery(replace(message), None, None))
                    continue
                token = uuid.uuid4()
                message.lock_token = token
                message.locked_by = owner
                message.locked_until = now + entity.options.lock_duration
                entity.due(message.locked_until)
                self._locks[token] = (entity, sequence)
                found.append(Delivery(replace(message), token, message.locked_until))
        return found

    def _locked(self, token: uuid.UUID) -> tuple[_Entity, StoredMessage]:
        found = self._locks.get(token)
        if found is None:
            raise MessageLockLost(
                "The lock supplied is invalid. Either the lock expired, or the message has "
                "already been removed from the queue."
            )
        entity, sequence = found
        message = entity.messages.get(sequence)
        if message is None or message.lock_token != token:
            del self._locks[token]
            raise MessageLockLost("The lock supplied is invalid.")
        return entity, message

    def _settle(self, token: uuid.UUID) -> tuple[_Entity, StoredMessage]:
        self.expire()
        entity, message = self._locked(token)
        del self._locks[token]
        return entity, message

    def complete(self, token: uuid.UUID) -> None:
        with self._lock:
            entity, message = self._settle(token)
            del entity.messages[message.sequence_number]

    def abandon(self, token: uuid.UUID) -> None:
        with self._lock:
            entity, message = self._settle(token)
            self._unlock(entity, message, increment=True)

    def release(self, token: uuid.UUID) -> None:
        """Give the message back without counting a delivery (AMQP ``released``)."""
        with self._lock:
            entity, message = self._settle(token)
            self._unlock(entity, message, increment=False)

    def defer(self, token: uuid.UUID) -> None:
        with self._lock:
            _entity, message = self._settle(token)
            self._clear_lock(message)
            message.deferred = True

    def dead_letter(self, token: uuid.UUID, reason: str | None, description: str | None) -> None:
        with self._lock:
            entity, message = self._settle(token)
            self._move_to_dead_letter(entity, message, reason, description)

    def renew_locks(self, tokens: Iterable[uuid.UUID]) -> list[float]:
        now = self._clock()
        expiries: list[float] = []
        with self._lock:
            self.expire()
            for token in tokens:
                entity, message = self._locked(token)
                message.locked_until = now + entity.options.lock_duration
                expiries.append(message.locked_until)
        return expiries

    def peek(
        self, address: str, from_sequence: int, count: int, session_id: str | None = None
    ) -> list[StoredMessage]:
        with self._lock:
            entity = self._entity(address)
            self._expire_entity(entity, self._clock())
            found = [
                replace(m)
                for seq, m in sorted(entity.messages.items())
                if seq >= from_sequence and (session_id is None or m.session_id == session_id)
            ]
            return found[:count]

    def count(self, address: str) -> int:
        """How many messages wait in an entity (locked, deferred or available)."""
        with self._lock:
            return len(self._entity(address).messages)

    # ---- expiry ------------------------------------------------------------------------------

    def expire(self) -> bool:
        """Expire message and session locks that ran out; True if anything became available."""
        now = self._clock()
        changed = False
        with self._lock:
            for entity in list(self._entities.values()):
                changed = self._expire_entity(entity, now) or changed
        return changed

    def _expire_entity(self, entity: _Entity, now: float) -> bool:
        if now < entity.next_due:
            return False
        changed = False
        # The earliest deadline left (a locked message's time to live counts too: it runs once
        # the message is unlocked).
        due = math.inf
        for message in list(entity.messages.values()):
            if message.expires_at is None:
                continue
            if message.lock_token is not None or message.expires_at > now:
                due = min(due, message.expires_at)
                continue
            if message.expires_at <= now:
                _LOGGER.info("message %s #%d expired", entity.path, message.sequence_number)
                if entity.options.dead_lettering_on_message_expiration:
                    self._move_to_dead_letter(
                        entity, message, TTL_EXPIRED, "The message expired and was dead lettered."
                    )
                else:
                    del entity.messages[message.sequence_number]
        for session_id, lock in list(entity.session_locks.items()):
            if lock.locked_until <= now:
                _LOGGER.info("session lock on %s/%s expired", entity.path, session_id)
                del entity.session_locks[session_id]
                changed = True
            else:
                due = min(due, lock.locked_until)
        for message in list(entity.messages.values()):
            if message.lock_token is None:
                continue
            if entity.options.requires_session:
                expired = message.session_id not in entity.session_locks
            else:
                expired = message.locked_until is not None and message.locked_until <= now
            if expired:
                _LOGGER.info("lock on %s #%d expired", entity.path, message.sequence_number)
                self._locks.pop(message.lock_token, None)
                self._unlock(entity, message, increment=True)
                changed = True
            elif message.locked_until is not None:
                due = min(due, message.locked_until)
        # Lowered meanwhile by what was added (a message dead-lettered into this entity).
        entity.next_due = min(due, entity.next_due if entity.next_due > now else math.inf)
        return changed

    def _clear_lock(self, message: StoredMessage) -> None:
        if message.lock_token is not None:
            self._locks.pop(message.lock_token, None)
        message.lock_token = None
        message.locked_until = None
        message.locked_by = None

    def _unlock(self, entity: _Entity, message: StoredMessage, *, increment: bool) -> None:
        self._clear_lock(message)
        if not increment:
            return
        message.delivery_count += 1
        if message.delivery_count >= entity.options.max_delivery_count:
            self._move_to_dead_letter(
                entity,
                message,
                MAX_DELIVERY_COUNT_EXCEEDED,
                f"Message could not be consumed after {message.delivery_count} delivery attempts.",
            )

    def _move_to_dead_letter(
        self,
        entity: _Entity,
        message: StoredMessage,
        reason: str | None,
        description: str | None,
    ) -> None:
        self._clear_lock(message)
        del entity.messages[message.sequence_number]
        if entity.dead_letter is None:
            _LOGGER.warning("dropping message #%d: no dead-letter queue", message.sequence_number)
            return
        message.dead_letter_reason = reason
        message.dead_letter_description = description
        message.dead_letter_source = entity.path
        message.expires_at = None
        entity.dead_letter.add(message)
