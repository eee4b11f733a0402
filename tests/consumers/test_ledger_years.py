"""Message times anywhere in the years the contract allows (1 to 9999, UTC) in the ledger: the
history of an event with a report dated in the year 1 reads, and the newest report is the
newest in time, not in text (SQLite keeps times as text)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from consumers._audit import Appended, open_ledger

from ._factory import T0, event, transition, vm


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def ledger_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'audit.db'}"
    return request.getfixturevalue("postgres_url")


async def test_a_report_dated_in_the_year_one_does_not_break_the_event_history(ledger_url):
    """Any VM can file a message under another event's id with a time in the year 1. Before,
    SQLite stored it as "1-01-01T..." and reading it back raised ValueError: `audit history
    --event` (and the console's timeline) failed for that event from then on."""
    real = transition("scheduled", event("EVT-7", resources=("web-1",)), vm("web-1"), at=T0)
    odd = transition(
        "scheduled",
        event("EVT-7", resources=("evil",)),
        vm("evil"),
        at=datetime(1, 1, 1, tzinfo=UTC),
    )
    async with open_ledger(ledger_url) as ledger:
        assert await ledger.append(real) is Appended.NEW
        assert await ledger.append(odd) is Appended.NEW
        entries = await ledger.history(event_id="EVT-7")
        by_vm = await ledger.history(vm="evil")
    assert [(e.vm, e.time) for e in entries] == [("evil", odd.time), ("web-1", T0)]
    assert [e.time for e in by_vm] == [odd.time]


async def test_the_newest_report_of_an_event_is_the_newest_in_time(ledger_url):
    """`approve --db` takes the version to approve from the event's newest report. One dated
    in the year 999 sorted after 2025 as text: it was taken for the newest."""
    real = transition("scheduled", event("EVT-8", resources=("web-1",)), vm("web-1"), at=T0)
    old = transition(
        "scheduled",
        event("EVT-8", source="User", resources=("web-1",)),
        vm("evil"),
        at=datetime(999, 1, 1, tzinfo=UTC),
    )
    async with open_ledger(ledger_url) as ledger:
        await ledger.append(real)
        await ledger.append(old)
        latest = await ledger.latest_event("EVT-8")
    assert latest is not None
    assert latest["EventSource"] == "Platform"
