"""The namespace model alone: Service Bus rules without the wire, on a fake clock."""

from __future__ import annotations

import pytest

from tests.servicebus_double._broker import (
    EntityNotFound,
    EntityOptions,
    IncomingMessage,
    MessageLockLost,
    Namespace,
    NotAllowed,
    SessionCannotBeLocked,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ns(clock: FakeClock) -> Namespace:
    namespace = Namespace(clock)
    options = EntityOptions(lock_duration=10, max_delivery_count=2, duplicate_detection_window=60)
    namespace.declare_queue("q", options)
    namespace.declare_queue("sq", EntityOptions(lock_duration=10, requires_session=True))
    namespace.declare_topic("t", ["a", "b"], options)
    return namespace


def msg(body: bytes, message_id: str | None = None, session_id: str | None = None):
    return IncomingMessage(body, message_id, session_id)


def test_unknown_entities_are_not_found(ns: Namespace) -> None:
    with pytest.raises(EntityNotFound):
        ns.send("nope", [msg(b"x")])
    with pytest.raises(EntityNotFound):
        ns.receive("t", "r")  # a topic has no messages of its own: read a subscription
    assert ns.check_receive_source("amqps://host:5671/T/subscriptions/A") == (
        "t/Subscriptions/a",
        False,
    )


def test_topic_copies_to_each_subscription(ns: Namespace) -> None:
    ns.send("t", [msg(b"x")])
    assert ns.count("t/Subscriptions/a") == ns.count("t/Subscriptions/b") == 1


def test_lock_expiry_redelivers_then_dead_letters(ns: Namespace, clock: FakeClock) -> None:
    ns.send("q", [msg(b"x", "m")])
    first = ns.receive("q", "r")
    assert first is not None
    assert ns.receive("q", "r") is None
    clock.now += 11
    second = ns.receive("q", "r")
    assert second is not None
    assert second.message.delivery_count == 1
    with pytest.raises(MessageLockLost):
        ns.complete(first.lock_token)  # type: ignore[arg-type]
    clock.now += 11
    assert ns.receive("q", "r") is None
    dead = ns.receive("q/$DeadLetterQueue", "r")
    assert dead is not None
    assert dead.message.dead_letter_reason == "MaxDeliveryCountExceeded"


def test_release_does_not_count_a_delivery(ns: Namespace) -> None:
    ns.send("q", [msg(b"x")])
    first = ns.receive("q", "r")
    assert first is not None
    assert first.lock_token is not None
    ns.release(first.lock_token)
    again = ns.receive("q", "r")
    assert again is not None
    assert again.message.delivery_count == 0


def test_duplicates_are_dropped_within_the_window(ns: Namespace, clock: FakeClock) -> None:
    assert ns.send("q", [msg(b"1", "same"), msg(b"2", "same")]) == 1
    clock.now += 61
    assert ns.send("q", [msg(b"3", "same")]) == 1
    assert ns.count("q") == 2


def test_renewed_lock_outlives_the_original(ns: Namespace, clock: FakeClock) -> None:
    ns.send("q", [msg(b"x")])
    got = ns.receive("q", "r")
    assert got is not None
    assert got.lock_token is not None
    clock.now += 8
    (expiry,) = ns.renew_locks([got.lock_token])
    assert expiry == clock.now + 10
    clock.now += 8
    ns.complete(got.lock_token)
    assert ns.count("q") == 0


def test_sessions_are_exclusive(ns: Namespace, clock: FakeClock) -> None:
    ns.send("sq", [msg(b"a", session_id="A"), msg(b"b", session_id="B")])
    with pytest.raises(NotAllowed):
        ns.send("sq", [msg(b"none")])
    assert ns.accept_session("sq", "r1", None) == "A"
    assert ns.accept_session("sq", "r2", None) == "B"
    assert ns.accept_session("sq", "r3", None) is None
    with pytest.raises(SessionCannotBeLocked):
        ns.accept_session("sq", "r3", "A")
    got = ns.receive("sq", "r1", session_id="A")
    assert got is not None
    assert got.message.payload == b"a"
    assert ns.receive("sq", "r1", session_id="A") is None
    clock.now += 11  # the session lock lapses: the message comes back for the next holder
    assert ns.accept_session("sq", "r3", None) == "A"
    again = ns.receive("sq", "r3", session_id="A")
    assert again is not None
    assert again.message.delivery_count == 1


def test_session_state(ns: Namespace) -> None:
    assert ns.get_session_state("sq", "S") is None
    ns.set_session_state("sq", "S", b"42")
    assert ns.get_session_state("sq", "S") == b"42"
    ns.set_session_state("sq", "S", None)
    assert ns.get_session_state("sq", "S") is None


def test_expired_messages_are_not_delivered(ns: Namespace, clock: FakeClock) -> None:
    ns.send("q", [IncomingMessage(b"stale", time_to_live=1.0), msg(b"fresh")])
    clock.now += 2
    got = ns.receive("q", "r")
    assert got is not None
    assert got.message.payload == b"fresh"
    assert ns.count("q") == 1
