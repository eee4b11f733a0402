"""The VM's request budget counts a request from when it goes out: one let through and still
waiting for its connection holds its place, and one never written gives it back (the agent's
polling must not stall behind requests that never reached IMDS)."""

from __future__ import annotations

import asyncio
import time

import pytest

from publisher._imds import ImdsClient
from publisher._poller import RequestLimiter

PERIOD = 0.5


async def test_a_request_not_yet_out_holds_its_place_and_counts_from_when_it_goes_out() -> None:
    limiter = RequestLimiter(1, PERIOD)
    first = await limiter.acquire()
    second = asyncio.ensure_future(limiter.acquire())
    await asyncio.sleep(2 * PERIOD)  # the first still waits for its connection
    assert not second.done()
    first.went_out()
    out_at = time.monotonic()
    slot = await asyncio.wait_for(second, 5)
    waited = time.monotonic() - out_at
    assert 0.8 * PERIOD <= waited <= 3 * PERIOD, waited  # the first's period, from when it went
    slot.went_out()


async def test_a_request_never_written_gives_its_place_back() -> None:
    limiter = RequestLimiter(2, PERIOD)
    for _ in range(3):  # each failing before it is written: none of them costs the budget
        failed = await asyncio.wait_for(limiter.acquire(), 0.1)
        failed.release()
    written = await asyncio.wait_for(limiter.acquire(), 0.1)
    written.went_out()
    written.release()  # once out, nothing: it stays counted
    other = await asyncio.wait_for(limiter.acquire(), 0.1)
    other.went_out()
    late = asyncio.ensure_future(limiter.acquire())
    await asyncio.sleep(PERIOD / 4)
    assert not late.done()  # two out within the period
    (await asyncio.wait_for(late, 5)).went_out()
    assert limiter.peak == 3  # gone out within one second (the limit is per PERIOD here)


async def test_a_request_that_fails_before_it_is_sent_gives_its_place_back() -> None:
    """A request of the agent's IMDS client that fails between its admission and its send (here
    the request counter raising) gives its place back: held for ever, two such places would
    stop every later request of the agent, its polls included."""
    calls = 0

    def counter(endpoint: str) -> None:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise RuntimeError("the counter broke")

    async with ImdsClient(
        "http://127.0.0.1:9", timeout=1, first_timeout=1, on_request=counter
    ) as client:
        for _ in range(2):
            with pytest.raises(RuntimeError):
                await client.scheduled_events()
        slot = await asyncio.wait_for(client.limiter.acquire(), 2 * PERIOD)
        slot.release()
