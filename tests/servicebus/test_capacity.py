"""A short run of ``tests/benchmarks/servicebus_capacity.py``: the real SDK against the double,
agents as the agent uses the transport, the connections and receive links counted by the
double. The benchmark runs 1,000 agents at the real cadence (a heartbeat a minute, senders
closed after 5 s); this keeps the same ratio of heartbeat to idle timeout (12 to 1) at a fifth
of the time, with 20 agents in one worker process."""

from __future__ import annotations

import pytest

from tests.benchmarks.servicebus_capacity import Plan, measure

pytestmark = [pytest.mark.servicebus, pytest.mark.slow, pytest.mark.timeout(150)]

#: 10,000 idle VMs in a namespace of 5,000 connections leave room for busy ones only if an idle
#: agent holds a connection a fifth of the time or less.
IDLE_AGENT_CONNECTIONS = 0.2


async def test_an_idle_agent_holds_a_connection_a_fraction_of_the_time_and_no_receive_link():
    plan = Plan(
        agents=20, busy=4, heartbeat=12.0, sender_idle_timeout=1.0, window=12.0, ramp=1.0,
        spread=2.0, workers=1,
    )  # fmt: skip
    result = await measure(plan)
    assert result.errors == 0
    assert result.idle.per_idle_agent_connections < IDLE_AGENT_CONNECTIONS, result.idle
    assert result.idle.approvals_receive_links_peak == 0  # nobody listens without an event
    # A busy agent listens with one receive link on the approvals queue, and every approval
    # reached its agent.
    assert result.busy.approvals_receive_links_peak == plan.busy
    assert result.busy.per_busy_agent_receive_links is not None
    assert result.busy.per_busy_agent_receive_links <= 1.0
    assert result.approvals_received == plan.busy
