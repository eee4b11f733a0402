"""The console in a real browser (Debian's Chromium, driven by Playwright) against the whole
system: the IMDS simulator, real agents, the approver, the audit, all in this test's loop."""

from __future__ import annotations

import asyncio
import os
import time
from datetime import UTC, datetime, timedelta

import pytest
import pytest_asyncio

try:
    from playwright.async_api import expect
except ImportError:  # the browser fixture says what to install (and fails when CI is set)
    expect = None  # type: ignore[assignment]

from consumers import ApproveUserInitiated, PolicySet
from consumers._approver_state import ApproverState
from publisher.simulator import EventSource as SimSource
from publisher.simulator import EventSpec, EventType
from publisher.simulator import EventState as SimState
from schemas import (
    AgentData,
    AgentMessage,
    MessageType,
    ReplyAddress,
    ScheduledEvent,
    Transition,
    TransitionKind,
    TransitionMessage,
    VmIdentity,
)
from schemas.wire import lifecycle_message

from ._stack import PASSWORDS, running_stack

pytestmark = [pytest.mark.timeout(90), pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(loop_scope="module")
async def open_page(browser):
    """Opens a page in a browser context of its own, signed in as ``name`` (None: not)."""
    contexts = []

    async def opener(url: str, name: str | None, *, viewport=None):
        context = await browser.new_context(viewport=viewport or {"width": 1400, "height": 900})
        contexts.append(context)
        page = await context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.errors = errors
        await page.goto(url + "/")
        if name is not None:
            await page.fill("#name", name)
            await page.fill("#password", PASSWORDS[name])
            await page.click("button[type=submit]")
            await page.wait_for_selector("#connection.live", timeout=5000)
        return page

    yield opener
    for context in contexts:
        await context.close()


def reboot(vm: str, *, source: SimSource = SimSource.PLATFORM, notice: float = 900) -> EventSpec:
    return EventSpec(
        event_type=EventType.REBOOT,
        resources=(vm,),
        event_source=source,
        not_before_seconds=notice,
        run_seconds=5,
    )


async def until(condition, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within} s: {what}")
        await asyncio.sleep(0.05)


async def open_event(page, event_id: str) -> None:
    await page.click(f'tr[data-event-id="{event_id}"] a')
    await page.wait_for_selector("#event-view:not([hidden])")
    await expect(page.locator("#event-title")).to_contain_text(event_id)


async def confirm(page, button: str, reason: str) -> None:
    await page.click(button)
    await page.fill("#confirm-reason", reason)
    await page.click("#confirm-ok")
    await page.wait_for_selector("#toast:not([hidden])")


async def test_a_simulated_event_appears_within_two_seconds(open_page, tmp_path):
    async with running_stack(tmp_path) as stack:
        page = await open_page(stack.url, "alice")
        started = time.monotonic()
        info = stack.simulator.add_event(reboot("web_1"))
        await page.wait_for_selector(f'tr[data-event-id="{info.event_id}"]', timeout=2000)
        elapsed = time.monotonic() - started
        row = page.locator(f'tr[data-event-id="{info.event_id}"]')
        text = await row.inner_text()
        assert "Reboot" in text
        assert "web_1" in text
        assert "zone 2" in text  # the agent's identity joined in
        assert "in 14:" in text  # the NotBefore countdown, computed on the page
        assert page.errors == []
    assert elapsed < 2.0, f"{elapsed:.2f} s"


async def test_approve_posts_start_requests_and_shows_in_the_timeline(
    open_page, tmp_path, screenshots
):
    async with running_stack(tmp_path) as stack:
        page = await open_page(stack.url, "alice")
        info = stack.simulator.add_event(reboot("web_0"))
        await page.wait_for_selector(f'tr[data-event-id="{info.event_id}"]', timeout=3000)
        # The approver (default policy) leaves a platform reboot to NotBefore: say so on screen.
        await expect(page.locator(f'tr[data-event-id="{info.event_id}"]')).to_contain_text("wait")
        await open_event(page, info.event_id)
        shown = await page.inner_text("#event-version")
        await confirm(page, "#approve", "patch window")
        assert "approval of" in await page.inner_text("#toast")
        await stack.simulator.wait_for_state(info.event_id, SimState.STARTED, within=5)
        event = stack.simulator.get_event(info.event_id)
        assert [a.vm for a in event.approvals] == ["web_0"]
        posts = [r for r in stack.simulator.requests(vm="web_0") if r.method == "POST"]
        assert posts, "no POST StartRequests reached the simulator"
        decisions = await stack.decisions(info.event_id)
        mine = [d for d in decisions if d["action"] == "approve"]
        assert mine
        assert mine[-1]["decided_by"] == "alice"
        assert mine[-1]["policy"] == "console"
        assert mine[-1]["event_version"] == shown
        assert mine[-1]["reason"] == "patch window"
        # The timeline on the page is the one `audit history` prints, with alice's approval.
        await expect(page.locator("#timeline")).to_contain_text("approval.applied", timeout=5000)
        await expect(page.locator("#timeline")).to_contain_text("started ", timeout=5000)
        timeline = await page.inner_text("#timeline")
        assert "decision.approve" in timeline
        assert "alice" in timeline
        assert "patch window [console] -> web_0" in timeline
        await page.evaluate("document.getElementById('toast').hidden = true")
        await page.screenshot(path=str(screenshots / "timeline.png"), full_page=True)
        assert page.errors == []


async def test_a_stale_version_is_refused(open_page, tmp_path):
    async with running_stack(tmp_path, signing_key=True) as stack:
        page = await open_page(stack.url, "alice")
        info = stack.simulator.add_event(reboot("web_2"))
        await page.wait_for_selector(f'tr[data-event-id="{info.event_id}"]', timeout=3000)
        status = await page.evaluate(
            """async (id) => {
                const me = await (await fetch('/api/me')).json();
                const r = await fetch(`/api/events/${id}/approve`, {method: 'POST',
                    headers: {'Content-Type': 'application/json', 'X-CSRF-Token': me.csrf},
                    body: JSON.stringify({version: 'not-the-version', reason: 'x'})});
                return [r.status, (await r.json()).error];
            }""",
            info.event_id,
        )
        assert status[0] == 409
        assert "the event changed: look again" in status[1]
        assert stack.simulator.get_event(info.event_id).approvals == ()


async def test_a_hold_keeps_the_approver_from_approving_until_released(open_page, tmp_path):
    policies = PolicySet((ApproveUserInitiated(),))
    async with running_stack(tmp_path, policies=policies, approver_first=False) as stack:
        page = await open_page(stack.url, "alice")
        info = stack.simulator.add_event(reboot("web_1", source=SimSource.USER))
        await page.wait_for_selector(f'tr[data-event-id="{info.event_id}"]', timeout=3000)
        # By keyboard alone: the row's link, the Hold button, the reason, Enter.
        await page.focus(f'tr[data-event-id="{info.event_id}"] a')
        await page.keyboard.press("Enter")
        await expect(page.locator("#event-title")).to_contain_text(info.event_id)
        await page.focus("#hold")
        await page.keyboard.press("Enter")
        await expect(page.locator("#confirm-reason")).to_be_focused()
        await page.keyboard.type("database migration running")
        await page.keyboard.press("Enter")
        await page.wait_for_selector("#toast:not([hidden])")
        assert "is held" in await page.inner_text("#toast")
        holds = await ApproverState(stack.ledger.db, "approver").holds()
        assert holds[info.event_id].held_by == "alice"
        # The approver now gets the event: its policy would approve it at once.
        stack.start_approver()
        await until(
            lambda: any(d.event_id == info.event_id for d in stack.approver.decisions),
            5,
            "the approver's decision",
        )
        await asyncio.sleep(1.5)
        assert stack.simulator.get_event(info.event_id).approvals == ()
        decision = [d for d in stack.approver.decisions if d.event_id == info.event_id][-1]
        assert decision.action.value == "wait"
        assert decision.policy == "hold"
        assert "held by alice" in decision.reason
        # The page shows the hold and the approver's decision.
        row = page.locator(f'tr[data-event-id="{info.event_id}"]')
        await page.click("a[href='#/']")
        await expect(row).to_contain_text("held by alice")
        assert "held by alice" in await row.inner_text()
        # Release: the approver decides again within about a second, and approves.
        await open_event(page, info.event_id)
        await confirm(page, "#release", "migration done")
        await stack.simulator.wait_for_state(info.event_id, SimState.STARTED, within=5)
        assert [a.vm for a in stack.simulator.get_event(info.event_id).approvals] == ["web_1"]
        actions = [(d["action"], d["decided_by"]) for d in await stack.decisions(info.event_id)]
        assert ("hold", "alice") in actions
        assert ("release", "alice") in actions
        assert actions[-1][0] == "approve"
        assert page.errors == []


async def test_an_anonymous_client_gets_only_the_sign_in_page(open_page, tmp_path):
    async with running_stack(tmp_path, vms=("web_0",)) as stack:
        info = stack.simulator.add_event(reboot("web_0"))
        await until(lambda: stack.console.live.fleet.event(info.event_id) is not None, 3, "event")
        page = await open_page(stack.url, None)
        assert page.url == stack.url + "/login"
        assert await page.locator("form[action='/login']").count() == 1
        assert info.event_id not in await page.content()
        request = page.context.request
        for path in ("/api/me", "/api/stream", "/static/console.js", "/api/history", "/nothing"):
            response = await request.get(stack.url + path)
            assert response.status == 401, path
            assert info.event_id not in await response.text()
        response = await request.post(
            stack.url + f"/api/events/{info.event_id}/approve",
            data={"version": "x"},
        )
        assert response.status == 401
        # A wrong password is refused, and says nothing about who exists.
        await page.fill("#name", "alice")
        await page.fill("#password", "wrong")
        await page.click("button[type=submit]")
        assert "Wrong name or password" in await page.inner_text("main")
        assert page.url == stack.url + "/login"
        assert stack.simulator.get_event(info.event_id).approvals == ()


async def test_a_read_only_user_cannot_approve(open_page, tmp_path):
    async with running_stack(tmp_path, vms=("web_0",)) as stack:
        page = await open_page(stack.url, "victor")
        assert "victor · viewer" in await page.inner_text("#user")
        info = stack.simulator.add_event(reboot("web_0"))
        await page.wait_for_selector(f'tr[data-event-id="{info.event_id}"]', timeout=3000)
        await open_event(page, info.event_id)
        assert await page.locator("#approve").count() == 0
        assert await page.locator("#hold").count() == 0
        assert "you can look, not act" in await page.inner_text("#event-actions")
        version = await page.inner_text("#event-version")
        results = await page.evaluate(
            """async ([id, version]) => {
                const me = await (await fetch('/api/me')).json();
                const out = [];
                for (const action of ['approve', 'hold']) {
                    const r = await fetch(`/api/events/${id}/${action}`, {method: 'POST',
                        headers: {'Content-Type': 'application/json', 'X-CSRF-Token': me.csrf},
                        body: JSON.stringify({version, reason: 'sneaky'})});
                    out.push([r.status, (await r.json()).error]);
                }
                return out;
            }""",
            [info.event_id, version],
        )
        assert results == [
            [403, "your role (viewer) may not approve"],
            [403, "your role (viewer) may not hold"],
        ]
        await asyncio.sleep(0.5)
        assert stack.simulator.get_event(info.event_id).approvals == ()
        assert not [d for d in await stack.decisions(info.event_id) if d["decided_by"] == "victor"]
        assert page.errors == []


async def test_an_agent_is_silent_only_past_the_heartbeat_interval_it_declared(open_page, tmp_path):
    """Two agents last heard 5 minutes ago: one declares a heartbeat every 10 minutes (it is
    online: 2.5 intervals have not gone by), the other declares none (silent after the
    console's 150 s). Before, both were silent: a fleet on a longer heartbeat interval looked
    silent between its heartbeats."""
    async with running_stack(tmp_path, vms=("web_0",), approver_first=False, audit=False) as stack:
        page = await open_page(stack.url, "alice")
        heard = datetime.now(UTC) - timedelta(minutes=5)
        for name, interval in (("quiet_0", 600.0), ("plain_0", None)):
            vm = VmIdentity(name=name, scale_set=name.split("_")[0], resource_group="rg")
            message = AgentMessage.build(
                MessageType.AGENT_HEARTBEAT,
                AgentData(
                    vm=vm,
                    agent_version="0.1.0",
                    reply_to=ReplyAddress(channel="scheduled-events.approvals", key=name),
                    heartbeat_interval=interval,
                ),
                observed_at=heard,
                instance="run-1",
            )
            await stack.transport.publish(lifecycle_message(message))
        # web_0's own agent is online (it heartbeats every 5 s).
        await expect(page.locator("#agent-summary")).to_contain_text(
            "2 online, 1 silent, 0 offline", timeout=10_000
        )
        await page.check("#show-online")
        await expect(page.locator("#agent-rows")).to_contain_text("quiet_0")
        rows = {
            name: await page.inner_text(f'#agent-rows tr:has-text("{name}")')
            for name in ("quiet_0", "plain_0")
        }
        assert "online" in rows["quiet_0"], rows
        assert "silent" in rows["plain_0"], rows
        assert page.errors == []


def _burst(count: int) -> list[TransitionMessage]:
    """``count`` Scheduled events, each on a VM of its own (100 scale sets, 3 zones)."""
    base = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    messages = []
    for n in range(count):
        vm = VmIdentity(
            name=f"burst{n % 100}_{n}",
            scale_set=f"burst{n % 100}",
            zone=str(n % 3 + 1),
            resource_group="rg",
            subscription_id="sub",
        )
        event = ScheduledEvent.from_imds(
            {
                "EventId": f"00000000-0000-4000-8000-{n:012d}",
                "EventStatus": "Scheduled",
                "EventType": "Freeze" if n % 2 else "Redeploy",
                "Resources": [vm.name],
                "NotBefore": (base + timedelta(seconds=n)).strftime("%a, %d %b %Y %H:%M:%S GMT"),
                "EventSource": "Platform",
                "DurationInSeconds": -1,
            }
        )
        messages.append(
            TransitionMessage.build(
                Transition(TransitionKind.SCHEDULED, event, None, 1),
                vm=vm,
                reply_to=ReplyAddress(channel="scheduled-events.approvals", key=vm.name),
                observed_at=datetime.now(UTC),
            )
        )
    return messages


@pytest.mark.slow
async def test_a_burst_of_10000_events_updates_rows_not_the_page(open_page, tmp_path):
    # The console alone with the burst (no approver or audit sharing its process).
    async with running_stack(tmp_path, vms=("web_0",), approver_first=False, audit=False) as stack:
        page = await open_page(stack.url, "alice")
        messages = await asyncio.to_thread(_burst, 10_000)
        assert messages[0].kind is MessageType.SCHEDULED
        batches_before = stack.console.feed.batches
        before = await page.evaluate("window.consoleStats")
        started = time.monotonic()
        for message in messages:
            await stack.transport.publish(lifecycle_message(message))
        await expect(page.locator("#open-count")).to_have_text("10000", timeout=30_000)
        elapsed = time.monotonic() - started
        # A batch's event rows come before its agent rows, in chunks the page applies as they
        # arrive, and the page's clock tick sets the count of open events too: it can be whole
        # while the batch's last chunks are on their way (a CI run read 19,000 rows here).
        await page.wait_for_function(
            f"window.consoleStats.rowsCreated >= {before['rowsCreated'] + 20_000}",
            timeout=30_000,
        )
        stats = await page.evaluate("window.consoleStats")
        server_batches = stack.console.feed.batches - batches_before
        # Coalesced: a few batches; each event's row data taken once; only the rows on the
        # page (the first 200, in NotBefore order) rendered, never 10,000 redrawn.
        # 10,000 event rows and 10,000 agent rows (one VM each), each taken once.
        assert stats["rowsCreated"] - before["rowsCreated"] == 20_000, stats
        assert stats["resets"] == 1, stats
        assert stats["batches"] < 200, stats
        assert stats["rowsRendered"] < 1_000, stats
        assert server_batches < 100, server_batches
        assert await page.locator("#open-rows tr").count() == 200
        assert "9800 not shown" in await page.inner_text("#more-open")
        first = await page.get_attribute("#open-rows tr:first-child", "data-event-id")
        assert first == "00000000-0000-4000-8000-000000000000"
        # The page stays responsive: a filter finds one event among 10,000 at once.
        await page.fill("#filter", "000000009999")
        await expect(page.locator("#open-rows tr")).to_have_count(1)
        await page.fill("#filter", "")
        await page.click("#more-open")
        await expect(page.locator("#open-rows tr")).to_have_count(400)
        assert page.errors == []
    assert elapsed < 30, elapsed


async def test_the_fleet_page_on_a_laptop_and_a_phone(
    open_page, tmp_path, monkeypatch, screenshots
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "drain").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "drain").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    policies = PolicySet((ApproveUserInitiated(),))
    vms = ("web_0", "web_1", "web_2", "web_3", "api_0", "api_1")
    async with running_stack(tmp_path, vms, policies=policies, hooks=("scheduled=drain",)) as stack:
        page = await open_page(stack.url, "alice")
        freeze = stack.simulator.add_event(
            EventSpec(
                event_type=EventType.FREEZE,
                resources=("web_0", "web_1"),
                not_before_seconds=600,
                duration_in_seconds=5,
                run_seconds=5,
                description="Virtual machine is being paused because of a memory-preserving "
                "Live Migration operation.",
            )
        )
        held = stack.simulator.add_event(
            EventSpec(
                event_type=EventType.REDEPLOY,
                resources=("api_1",),
                not_before_seconds=1200,
            )
        )
        user = stack.simulator.add_event(reboot("web_3", source=SimSource.USER, notice=900))
        stack.simulator.add_event(reboot("api_0", notice=300))
        await expect(page.locator("#open-count")).to_have_text("4", timeout=5000)
        await open_event(page, held.event_id)
        await confirm(page, "#hold", "capacity review")
        await page.click("a[href='#/']")
        await stack.simulator.wait_for_state(user.event_id, SimState.STARTED, within=5)
        await expect(page.locator(f'tr[data-event-id="{user.event_id}"]')).to_contain_text(
            "Started"
        )
        await expect(page.locator(f'tr[data-event-id="{freeze.event_id}"]')).to_contain_text(
            "drain ok"  # its VMs' hooks ran
        )
        await page.check("#show-online")
        await asyncio.sleep(0.6)
        # Every control has a name a screen reader can say.
        unnamed = await page.evaluate(
            """() => [...document.querySelectorAll('input, select, button, a')]
                .filter((e) => e.offsetParent !== null && e.type !== 'hidden')
                .filter((e) => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')
                               && !e.textContent.trim())
                .map((e) => e.outerHTML)"""
        )
        assert unnamed == []
        await page.evaluate("document.getElementById('toast').hidden = true")
        await page.screenshot(path=str(screenshots / "fleet.png"), full_page=True)
        assert page.errors == []

        phone = await open_page(stack.url, "alice", viewport={"width": 390, "height": 844})
        await expect(phone.locator("#open-count")).to_have_text("4", timeout=5000)
        overflow = await phone.evaluate(
            "document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0, f"{overflow} px wider than a phone"
        label = await phone.evaluate(
            "getComputedStyle(document.querySelector('#open-rows td'), '::before').content"
        )
        assert label == '"Event"'  # each cell says what it is at phone width
        await phone.screenshot(path=str(screenshots / "phone.png"), full_page=False)
        assert phone.errors == []
