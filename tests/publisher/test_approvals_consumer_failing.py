"""An approvals consumer the broker keeps refusing is said once, not at every try, and said
again when it is back.

A broker user that may not read its VM's approvals queue (a permission set wrong on a fleet's
users, or a broker that cannot open channels for thousands of agents at once) makes every
opening of the consumer fail. The agent tries again with a growing pause, at most every 5 s:
a WARNING at each try would be 12 lines a minute from every VM, thousands a second from a fleet,
for as long as it lasts. It says the first, then a reminder every 5 minutes (2 s here). Real
RabbitMQ, a broker user of the test's own, the simulator over HTTP.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from pathlib import Path

import pytest

from publisher._agent import Agent
from schemas.channels import ChannelNames
from schemas.transport.rabbitmq import RabbitMQTransport
from tests.transport._rabbitmqctl import rabbitmqctl, throwaway_user

from .harness import eventually, settings_for, simulator_server

pytestmark = [pytest.mark.rabbitmq]


async def test_an_approvals_consumer_refused_again_and_again_is_said_once_then_when_back(
    amqp_url: str,
    unique: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.DEBUG, logger="publisher._agent")
    # A reminder every 2 s, not every 5 minutes (raising=False: the code before has none).
    monkeypatch.setattr("publisher._agent._FAILING_REMINDER", 2.0, raising=False)
    channels = ChannelNames().suffixed(unique)
    queue = RabbitMQTransport(amqp_url, channels).vm_queue("web-7")
    refused = ("^.*$", "^.*$", f"^(?!{re.escape(queue)}$).*$")  # its queue may not be read
    async with (
        asyncio.timeout(60),
        throwaway_user(f"web-7-{unique}", permissions=refused) as user,
        simulator_server("web-7") as server,
    ):
        settings = settings_for(
            server,
            "web-7",
            user.url(amqp_url),
            channels,
            tmp_path,
            approvals_listen="always",
        )
        agent = Agent(settings)
        task = asyncio.create_task(agent.run())
        try:

            def tries() -> list[logging.LogRecord]:
                return [r for r in caplog.records if "approvals consumer" in r.getMessage()]

            await eventually(lambda: any("still failing after" in r.getMessage() for r in tries()))
            records = tries()
            said = [r for r in records if r.levelno >= logging.WARNING]
            assert "ACCESS_REFUSED" in said[0].getMessage()
            assert "said again when it is back" in said[0].getMessage()
            # Then only reminders, one per _FAILING_REMINDER; the tries between at DEBUG.
            assert all("still failing after" in r.getMessage() for r in said[1:])
            assert all(b.created - a.created >= 1.9 for a, b in itertools.pairwise(said))
            assert len(records) >= len(said) + 3, [r.getMessage() for r in records]
            assert not agent.ready.is_set()  # it listens always: not ready without its consumer
            await rabbitmqctl("set_permissions", "-p", "/", user.name, ".*", ".*", ".*")
            await eventually(agent.ready.is_set, within=15)
            assert any("approvals consumer open again" in r.getMessage() for r in tries())
        finally:
            agent.stop("test over")
            async with asyncio.timeout(20):
                await task
            async with RabbitMQTransport(amqp_url, channels) as cleaner:
                await cleaner.delete_topology(vms=["web-7"], exchanges=True)
