"""Which RabbitMQ refusals of a published message are final. The broker's own words are used:
its ``max_message_size`` (128 MiB by default on 3.x) is too large to provoke in a test, and the
other refusals are provoked against the broker in ``test_rabbitmq_access.py``."""

from __future__ import annotations

import aiormq.exceptions
import pytest

from schemas import MessageRefused, PublishNotConfirmed
from schemas.transport._amqp_errors import refused, refuses


def test_a_message_over_the_size_limit_is_refused_for_good() -> None:
    exc = aiormq.exceptions.ChannelPreconditionFailed(
        "PRECONDITION_FAILED - message size 134217729 is larger than configured max size 134217728"
    )
    error = refused(exc, "message m-1")
    assert isinstance(error, MessageRefused)
    assert str(error).startswith("message m-1: RabbitMQ will never take it: PRECONDITION_FAILED")


@pytest.mark.parametrize(
    "exc",
    [
        aiormq.exceptions.ChannelPreconditionFailed(
            "PRECONDITION_FAILED - user_id property set to 'guest' but authenticated user was "
            "'web_7'"
        ),
        aiormq.exceptions.ChannelAccessRefused(
            "ACCESS_REFUSED - write access to topic 'started.Reboot.web_8' in exchange "
            "'scheduled-events' in vhost '/' refused for user 'web_7'"
        ),
    ],
    ids=["user_id", "topic permission"],
)
def test_a_refusal_that_settings_can_fix_is_retried(exc: BaseException) -> None:
    # It refuses every message of that publisher until an operator fixes the settings or the
    # permissions: setting them all aside would lose the fleet's stream.
    error = refused(exc, "message m-1")
    assert type(error) is PublishNotConfirmed


# The broker closes the channel for the message it refuses, and aiormq fails every publish still
# waiting there with the same refusal: its words say which message it is about (the channel
# tests provoke the topic case against the broker; these are the ones a test cannot provoke).
_TOO_LARGE = aiormq.exceptions.ChannelPreconditionFailed(
    "PRECONDITION_FAILED - message size 70000 is larger than configured max size 65536"
)
_USER_ID = aiormq.exceptions.ChannelPreconditionFailed(
    "PRECONDITION_FAILED - user_id property set to 'web_8' but authenticated user was 'web_7'"
)
_TOPIC = aiormq.exceptions.ChannelAccessRefused(
    "ACCESS_REFUSED - write access to topic 'started.Reboot.web_8' in exchange "
    "'scheduled-events' in vhost '/' refused for user 'web_7'"
)


@pytest.mark.parametrize(
    ("exc", "exchange", "routing_key", "size", "user_id", "blamed"),
    [
        (_TOO_LARGE, "scheduled-events", "x", 70_000, None, True),
        (_TOO_LARGE, "scheduled-events", "x", 65_537, None, True),
        (_TOO_LARGE, "scheduled-events", "x", 65_536, None, False),
        (_TOO_LARGE, "scheduled-events", "x", 900, None, False),
        (_USER_ID, "scheduled-events", "x", 10, "web_8", True),
        (_USER_ID, "scheduled-events", "x", 10, "web_7", False),
        (_USER_ID, "scheduled-events", "x", 10, None, False),
        (_TOPIC, "scheduled-events", "started.Reboot.web_8", 10, None, True),
        (_TOPIC, "scheduled-events", "started.Reboot.web_7", 10, None, False),
        (_TOPIC, "other", "started.Reboot.web_8", 10, None, False),
        (
            aiormq.exceptions.ChannelAccessRefused("ACCESS_REFUSED - other words"),
            "e",
            "k",
            1,
            None,
            True,
        ),
    ],
)
def test_a_refusal_blames_only_the_message_its_words_are_about(
    exc: BaseException,
    exchange: str,
    routing_key: str,
    size: int,
    user_id: str | None,
    blamed: bool,
) -> None:
    """A neighbour on the channel was told the refused message's refusal: for a size, a
    MessageRefused its sender set aside for good (a transition lost). Words it cannot read still
    blame the message."""
    assert refuses(exc, exchange, routing_key, b"x" * size, user_id) is blamed
