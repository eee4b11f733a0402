"""Which RabbitMQ refusals of a published message are final. The broker's own words are used:
its ``max_message_size`` (128 MiB by default on 3.x) is too large to provoke in a test, and the
other refusals are provoked against the broker in ``test_rabbitmq_access.py``."""

from __future__ import annotations

import aiormq.exceptions
import pytest

from schemas import MessageRefused, PublishNotConfirmed
from schemas.transport._amqp_errors import refused


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
