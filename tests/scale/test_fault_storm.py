"""The fault storm of ``tests/benchmarks/faults.py``, short: 30 real agents (3 processes), the
simulator, two approvers (one active) and the audit over the real RabbitMQ, through every fault
in turn -- the broker links cut, the active approver killed, agent processes killed in a loop,
an IMDS storm, an IMDS hang -- and nothing lost, repeated to a handler, wrongly approved or
invented, and each fault recovered from."""

from __future__ import annotations

import pytest

from tests.benchmarks import faults

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


@pytest.mark.timeout(420)
async def test_every_fault_loses_repeats_invents_and_misapproves_nothing(amqp_url: str) -> None:
    plan = faults.Plan(
        vms=30,
        broker=amqp_url,
        agents_per_process=10,
        imds_timeout=2.0,
        run_seconds=6.0,
        link_cut=5.0,
        kill_seconds=6.0,
        kill_every=2.0,
        storm_seconds=4.0,
        hang_seconds=5.0,
        phase_timeout=60.0,
    )
    result = await faults.measure(plan)
    print(faults.table(result))
    assert [p.fault for p in result.phases] == list(faults.FAULTS)
    assert result.processes_killed >= 4  # the approver, and three agent processes at least
    for phase in result.phases:
        assert phase.events == 30
        assert phase.approvable == 27
        counts = {
            "lost": phase.lost,
            "duplicates_to_handlers": phase.duplicates_to_handlers,
            "wrong_posts": phase.wrong_posts,
            "invented": phase.invented,
            "unfinished": phase.unfinished,
        }
        assert counts == dict.fromkeys(counts, 0), (phase.fault, phase.examples)
        assert phase.recovery_s is not None, f"{phase.fault}: not caught up within 60 s"
