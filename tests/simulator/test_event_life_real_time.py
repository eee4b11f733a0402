"""The same life on the real clock, shrunk by ``speed``: no manual clock anywhere."""

from __future__ import annotations

import asyncio
import time
from email.utils import parsedate_to_datetime

import pytest

from publisher.simulator import EventSpec, EventState, EventType

from .conftest import HarnessFactory


async def test_a_preempt_runs_its_life_at_speed(make_harness: HarnessFactory) -> None:
    async with make_harness(speed=100) as h:
        before = time.time()
        event = h.sim.add_event(EventSpec(event_type=EventType.PREEMPT, run_seconds=20))
        (shown,) = (await h.document())["Events"]
        # 30 s of notice at speed 100: NotBefore is a real wall-clock time 0.3 s ahead.
        assert parsedate_to_datetime(shown["NotBefore"]).timestamp() == pytest.approx(
            before + 0.3, abs=1
        )
        seen: list[tuple[int, list[str]]] = []
        async with asyncio.timeout(5):
            while True:
                document = await h.document()
                statuses = [e["EventStatus"] for e in document["Events"]]
                if not seen or seen[-1][0] != document["DocumentIncarnation"]:
                    seen.append((document["DocumentIncarnation"], statuses))
                if not statuses:
                    break
                await asyncio.sleep(0.01)
        assert seen == [(2, ["Scheduled"]), (3, ["Started"]), (4, [])]
        info = h.sim.get_event(event.event_id)
        assert info.state is EventState.COMPLETED
        assert info.started_at is not None
        assert info.ended_at is not None
        assert info.ended_at - info.started_at == pytest.approx(0.2, abs=0.05)


async def test_wait_for_state_times_out(make_harness: HarnessFactory) -> None:
    async with make_harness() as h:
        event = h.sim.add_event(EventSpec(event_type=EventType.REBOOT))
        with pytest.raises(TimeoutError):
            await h.sim.wait_for_state(event.event_id, EventState.STARTED, within=0.05)
