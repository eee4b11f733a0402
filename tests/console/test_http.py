"""The console over HTTP (a real socket, httpx as the client): sign-in, sessions, CSRF, roles,
the actions and their audit, the history, and the live feed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from consumers._approver_state import ApproverState
from consumers._audit import Ledger
from consumers._db import open_database
from consumers._schema import ensure_schema
from consumers._timeline import entry_line
from consumers.console._auth import Authenticator
from consumers.console._feed import Feed
from consumers.console._live import LatestDecision, LiveFleet
from consumers.console._server import console_running
from consumers.console._sessions import SessionCodec
from consumers.console._users import DEFAULT_ITERATIONS, Role, UsersFile, write_user
from schemas import Approval, event_version, load_public_keys, load_signing_key
from schemas.approvals import verify, write_key_pair
from schemas.transport import MemoryBroker, open_transport
from schemas.wire import lifecycle_message
from tests.consumers._factory import event, heartbeat, hook, transition, vm

from ._stack import PASSWORDS, write_users

NOW = datetime.now(UTC).replace(microsecond=0)


class Console:
    def __init__(self, service, server, transport, db, tmp_path):
        self.service = service
        self.server = server
        self.transport = transport
        self.db = db
        self.tmp_path = tmp_path
        self.url = server.url

    async def publish(self, *messages):
        for message in messages:
            await self.transport.publish(lifecycle_message(message))

    async def known(self, event_id, within=3.0):
        deadline = time.monotonic() + within
        while self.service.live.fleet.event(event_id) is None:
            assert time.monotonic() < deadline, f"the console never saw {event_id}"
            await asyncio.sleep(0.02)
        return self.service.live.fleet.event(event_id)

    def client(self, **kwargs) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=10, **kwargs)


@contextlib.asynccontextmanager
async def console(
    tmp_path: Path, *, signing_key=True, token=None, proxy=None, users=True, host_names=()
):
    _, _public = write_key_pair(tmp_path / "keys")
    key = load_signing_key(tmp_path / "keys" / "approver.key") if signing_key else None
    users_file = UsersFile(write_users(tmp_path / "users")) if users else None
    auth = Authenticator(SessionCodec(b"s" * 32), users=users_file, token=token, proxy_header=proxy)
    name = f"http-{uuid.uuid4().hex[:8]}"
    try:
        async with (
            open_transport(f"memory://{name}") as transport,
            open_database(str(tmp_path / "central.db")) as db,
        ):
            await ensure_schema(db)
            names = {"host_names": host_names} if host_names else {}
            async with console_running(transport, db, auth, signing_key=key, **names) as running:
                yield Console(*running, transport, db, tmp_path)
    finally:
        MemoryBroker.discard(name)


def _form_token(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found is not None, html
    return found.group(1)


async def sign_in(client: httpx.AsyncClient, name: str, password: str | None = None):
    page = await client.get("/login")
    token = _form_token(page.text)
    return await client.post(
        "/login",
        data={"name": name, "password": password or PASSWORDS[name], "csrf": token},
        headers={"Origin": str(client.base_url).rstrip("/")},
    )


async def signed_in(client: httpx.AsyncClient, name: str) -> str:
    """Signs in; returns the CSRF token."""
    response = await sign_in(client, name)
    assert response.status_code == 303, response.text
    return (await client.get("/api/me")).json()["csrf"]


def scheduled(event_id: str, vm_name: str = "web-1", **kwargs):
    identity = vm(vm_name, scale_set="web", zone="1")
    ev = event(event_id, resources=(vm_name,), not_before=NOW + timedelta(minutes=15), **kwargs)
    return ev, identity, transition("scheduled", ev, identity, at=NOW)


async def test_an_anonymous_client_gets_the_sign_in_page_and_nothing_else(tmp_path):
    async with console(tmp_path) as c, c.client() as client:
        _ev, identity, message = scheduled("EVT-ANON")
        await c.publish(heartbeat(identity, at=NOW), message)
        await c.known("EVT-ANON")
        page = await client.get("/", headers={"Accept": "text/html"})
        assert (page.status_code, page.headers["location"]) == (303, "/login")
        for path in (
            "/api/me",
            "/api/stream",
            "/static/console.js",
            "/static/console.css",
            "/api/history?vm=web-1",
            "/api/events/EVT-ANON/timeline",
            "/nothing",
        ):
            response = await client.get(path)
            assert response.status_code == 401, path
            assert "EVT-ANON" not in response.text
        refused = await client.post("/api/events/EVT-ANON/hold", json={"reason": "x"})
        assert refused.status_code == 401
        login = await client.get("/login")
        assert login.status_code == 200
        assert 'name="password"' in login.text
        assert "EVT-ANON" not in login.text
        assert "script-src 'self'" in login.headers["content-security-policy"]
        assert login.headers["x-frame-options"] == "DENY"
        cookie = login.headers["set-cookie"]
        assert "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
        assert "Secure" not in cookie


async def test_sign_in_sets_a_strict_session_cookie_and_logs_it(tmp_path, caplog):
    caplog.set_level("INFO", logger="consumers.console")
    async with console(tmp_path) as c, c.client() as client:
        wrong = await sign_in(client, "alice", "not-her-password")
        assert wrong.status_code == 401
        assert "Wrong name or password." in wrong.text
        response = await sign_in(client, "alice")
        assert (response.status_code, response.headers["location"]) == (303, "/")
        cookie = next(v for k, v in response.headers.multi_items() if k == "set-cookie")
        assert cookie.startswith("se_console=v1.")
        for attribute in ("HttpOnly", "SameSite=Strict", "Path=/"):
            assert attribute in cookie
        me = (await client.get("/api/me")).json()
        assert (me["user"], me["role"], me["may_act"], me["can_approve"]) == (
            "alice",
            "operator",
            True,
            True,
        )
        page = await client.get("/")
        assert page.status_code == 200
        assert "/static/console.js" in page.text
        assert (await client.get("/static/console.js")).status_code == 200
    logs = caplog.text
    assert "sign-in refused: 'alice'" in logs
    assert "sign-in: alice (operator, by password)" in logs


async def test_the_sign_in_form_is_csrf_safe_and_throttled(tmp_path):
    async with console(tmp_path) as c, c.client() as client:
        # A form posted from elsewhere carries neither this site's Origin nor its form cookie.
        foreign = await client.post(
            "/login",
            data={"name": "alice", "password": PASSWORDS["alice"], "csrf": "guess"},
            headers={"Origin": "https://evil.example"},
        )
        assert foreign.status_code == 403
        no_cookie = await client.post(
            "/login", data={"name": "alice", "password": PASSWORDS["alice"], "csrf": "guess"}
        )
        assert no_cookie.status_code == 400
        cookies = [v.split("=")[0] for k, v in no_cookie.headers.multi_items() if k == "set-cookie"]
        assert "se_console" not in cookies  # no session
        for _ in range(5):
            assert (await sign_in(client, "victor", "wrong-password")).status_code == 401
        braked = await sign_in(client, "victor")
        assert braked.status_code == 429
        assert "Too many failed sign-ins" in braked.text


async def test_every_change_needs_the_session_csrf_token_and_this_origin(tmp_path):
    async with console(tmp_path) as c, c.client() as client:
        _ev, identity, message = scheduled("EVT-CSRF")
        await c.publish(heartbeat(identity, at=NOW), message)
        await c.known("EVT-CSRF")
        csrf = await signed_in(client, "alice")
        path = "/api/events/EVT-CSRF/hold"
        no_token = await client.post(path, json={"reason": "x"})
        assert no_token.status_code == 403
        assert "CSRF" in no_token.json()["error"]
        wrong = await client.post(path, json={"reason": "x"}, headers={"X-CSRF-Token": "nope"})
        assert wrong.status_code == 403
        other_site = await client.post(
            path,
            json={"reason": "x"},
            headers={"X-CSRF-Token": csrf, "Origin": "https://evil.example"},
        )
        assert other_site.status_code == 403
        as_form = await client.post(path, data={"reason": "x"}, headers={"X-CSRF-Token": csrf})
        assert as_form.status_code == 415
        assert await ApproverState(c.db, "approver").holds() == {}
        ok = await client.post(
            path, json={"reason": "x"}, headers={"X-CSRF-Token": csrf, "Origin": c.url}
        )
        assert ok.status_code == 200, ok.text
        # Signed out: the same cookie no longer works.
        assert (await client.post("/logout", headers={"X-CSRF-Token": csrf})).status_code == 200
        assert (await client.get("/api/me")).status_code == 401


async def test_approve_signs_for_the_version_on_screen_and_records_the_operator(tmp_path):
    async with console(tmp_path) as c, c.client() as client:
        ev, identity, message = scheduled("EVT-APPROVE")
        await c.publish(heartbeat(identity, at=NOW), message)
        await c.known("EVT-APPROVE")
        csrf = await signed_in(client, "alice")
        headers = {"X-CSRF-Token": csrf}
        path = "/api/events/EVT-APPROVE/approve"
        version = event_version(ev)
        stale = await client.post(path, json={"version": "0" * 32}, headers=headers)
        assert stale.status_code == 409
        assert stale.json()["error"].startswith("the event changed: look again")
        unknown = await client.post(
            "/api/events/EVT-NONE/approve", json={"version": version}, headers=headers
        )
        assert unknown.status_code == 404
        async with c.transport.approvals("web-1") as inbox:
            ok = await client.post(
                path, json={"version": version, "reason": "patched"}, headers=headers
            )
            assert ok.status_code == 200, ok.text
            assert ok.json()["target"] == "web-1"
            async with asyncio.timeout(3):
                delivery = await anext(aiter(inbox))
            approval = Approval.from_bytes(delivery.body)
            await delivery.ack()
        trusted = load_public_keys([tmp_path / "keys" / "approver.pub"])
        verify(approval, trusted, vm_name="web-1")
        assert (approval.event_id, approval.event_version) == ("EVT-APPROVE", version)
        assert approval.decided_by == "alice"
        assert approval.reason == "patched"
        decisions = [e for e in await Ledger(c.db).history(event_id="EVT-APPROVE")]
        assert [e.kind for e in decisions] == ["decision.approve"]
        body = decisions[0].body
        assert body["decided_by"] == "alice"
        assert body["policy"] == "console"
        assert body["approval_id"] == approval.approval_id
        assert body["event_version"] == version
        # The page's row shows the approval as sent.
        row = c.service.live.event_row(c.service.live.fleet.event("EVT-APPROVE"))
        assert row["approval"]["outcome"] == "sent"
        assert row["approval"]["by"] in ("", "alice")
        # A started event cannot be approved.
        started = event("EVT-APPROVE", status="Started", resources=("web-1",))
        await c.publish(transition("started", started, identity, at=NOW + timedelta(seconds=5)))
        deadline = time.monotonic() + 3
        while c.service.live.fleet.event("EVT-APPROVE").event.event_status != "Started":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        late = await client.post(path, json={"version": event_version(started)}, headers=headers)
        assert late.status_code == 409
        assert "only a Scheduled event" in late.json()["error"]


async def test_a_console_without_a_key_cannot_approve(tmp_path):
    async with console(tmp_path, signing_key=False) as c, c.client() as client:
        ev, identity, message = scheduled("EVT-NOKEY")
        await c.publish(heartbeat(identity, at=NOW), message)
        await c.known("EVT-NOKEY")
        csrf = await signed_in(client, "alice")
        assert (await client.get("/api/me")).json()["can_approve"] is False
        response = await client.post(
            "/api/events/EVT-NOKEY/approve",
            json={"version": event_version(ev)},
            headers={"X-CSRF-Token": csrf},
        )
        assert response.status_code == 503
        assert "no signing key" in response.json()["error"]


async def test_hold_and_release_go_to_the_approver_and_the_audit(tmp_path):
    async with console(tmp_path) as c, c.client() as client:
        _ev, identity, message = scheduled("EVT-HOLD")
        await c.publish(heartbeat(identity, at=NOW), message)
        await c.known("EVT-HOLD")
        csrf = await signed_in(client, "alice")
        headers = {"X-CSRF-Token": csrf}
        held = await client.post(
            "/api/events/EVT-HOLD/hold", json={"reason": "db migration"}, headers=headers
        )
        assert held.status_code == 200, held.text
        holds = await ApproverState(c.db, "approver").holds()
        assert (holds["EVT-HOLD"].held_by, holds["EVT-HOLD"].reason) == ("alice", "db migration")
        row = c.service.live.event_row(c.service.live.fleet.event("EVT-HOLD"))
        assert row["hold"]["by"] == "alice"
        released = await client.post(
            "/api/events/EVT-HOLD/release", json={"reason": "done"}, headers=headers
        )
        assert released.status_code == 200
        assert await ApproverState(c.db, "approver").holds() == {}
        again = await client.post("/api/events/EVT-HOLD/release", json={}, headers=headers)
        assert again.status_code == 409
        bogus = await client.post("/api/events/EVT-HOLD/delete", json={}, headers=headers)
        assert bogus.status_code == 404
        timeline = (await client.get("/api/events/EVT-HOLD/timeline")).json()
        entries = await Ledger(c.db).history(event_id="EVT-HOLD")
        assert timeline["lines"] == [entry_line(e) for e in entries]
        assert [e.kind for e in entries] == ["decision.hold", "decision.release"]
        assert "alice" in timeline["lines"][0]
        assert "db migration [console]" in timeline["lines"][0]


async def test_a_hold_or_release_the_ledger_cannot_record_does_not_take_effect(tmp_path):
    """The approver acts on the holds table alone: a hold or release that took effect without
    its record would leave an approval the audit cannot explain (an ``approve`` before the
    ``release`` that allowed it, or none at all). Both go in one transaction, or neither."""
    async with console(tmp_path) as c, c.client() as client:
        _ev, identity, message = scheduled("EVT-ATOMIC")
        await c.publish(heartbeat(identity, at=NOW), message)
        await c.known("EVT-ATOMIC")
        headers = {"X-CSRF-Token": await signed_in(client, "alice")}
        state = ApproverState(c.db, "approver")
        refuse = (
            "CREATE TRIGGER refuse_records BEFORE INSERT ON ledger_decisions "
            "BEGIN SELECT RAISE(ABORT, 'the ledger is full'); END"
        )

        await c.db.execute(refuse)
        held = await client.post("/api/events/EVT-ATOMIC/hold", json={}, headers=headers)
        assert held.status_code == 500
        assert await state.holds() == {}  # not held: nothing says it was

        await c.db.execute("DROP TRIGGER refuse_records")
        held = await client.post("/api/events/EVT-ATOMIC/hold", json={}, headers=headers)
        assert held.status_code == 200, held.text
        await c.db.execute(refuse)
        released = await client.post("/api/events/EVT-ATOMIC/release", json={}, headers=headers)
        assert released.status_code == 500
        assert list(await state.holds()) == ["EVT-ATOMIC"]  # still held: nothing says otherwise

        await c.db.execute("DROP TRIGGER refuse_records")
        released = await client.post("/api/events/EVT-ATOMIC/release", json={}, headers=headers)
        assert released.status_code == 200, released.text
        assert await state.holds() == {}
        entries = await Ledger(c.db).history(event_id="EVT-ATOMIC")
        assert [e.kind for e in entries] == ["decision.hold", "decision.release"]


async def test_a_viewer_reads_but_cannot_act(tmp_path):
    async with console(tmp_path) as c, c.client() as client:
        ev, identity, message = scheduled("EVT-VIEW")
        await c.publish(heartbeat(identity, at=NOW), message)
        await c.known("EVT-VIEW")
        csrf = await signed_in(client, "victor")
        me = (await client.get("/api/me")).json()
        assert (me["role"], me["may_act"], me["can_approve"]) == ("viewer", False, False)
        for action, body in (
            ("approve", {"version": event_version(ev)}),
            ("hold", {}),
            ("release", {}),
        ):
            response = await client.post(
                f"/api/events/EVT-VIEW/{action}", json=body, headers={"X-CSRF-Token": csrf}
            )
            assert response.status_code == 403, action
        assert (await client.get("/api/events/EVT-VIEW/timeline")).status_code == 200
        assert await Ledger(c.db).history(event_id="EVT-VIEW") == []


async def test_a_role_taken_away_in_the_users_file_applies_at_once(tmp_path):
    async with console(tmp_path) as c, c.client() as client:
        csrf = await signed_in(client, "alice")
        users = tmp_path / "users"
        users.write_text(users.read_text().replace("alice:operator:", "alice:viewer:"))
        assert (await client.get("/api/me")).json()["role"] == "viewer"
        response = await client.post("/api/events/X/hold", json={}, headers={"X-CSRF-Token": csrf})
        assert response.status_code == 403
        lines = (tmp_path / "users").read_text().splitlines()
        (tmp_path / "users").write_text(
            "\n".join(line for line in lines if not line.startswith("alice:")) + "\n"
        )
        assert (await client.get("/api/me")).status_code == 401


async def test_a_new_password_ends_the_sessions_of_the_old_one(tmp_path):
    """console-user FILE NAME sets a new password (a stolen one, say): the sessions signed in
    with the old one end at their next request, not when they expire 12 hours later."""
    async with console(tmp_path) as c, c.client() as thief, c.client() as victor:
        await signed_in(thief, "alice")
        await signed_in(victor, "victor")
        write_user(tmp_path / "users", "alice", Role.OPERATOR, "a-new-password", iterations=1000)
        assert (await thief.get("/api/me")).status_code == 401
        assert (await victor.get("/api/me")).status_code == 200  # nobody else's
        assert (await sign_in(thief, "alice", "alice-password")).status_code == 401
        assert (await sign_in(thief, "alice", "a-new-password")).status_code == 303
        assert (await thief.get("/api/me")).json()["user"] == "alice"


async def test_a_shared_token_records_the_name_given_with_it(tmp_path):
    async with (
        console(tmp_path, token="a-long-shared-token", users=False) as c,
        c.client() as client,
    ):
        assert (await sign_in(client, "ops-bob", "wrong")).status_code == 401
        assert (await sign_in(client, "ops-bob", "a-long-shared-token")).status_code == 303
        me = (await client.get("/api/me")).json()
        assert (me["operator_name"], me["role"]) == ("ops-bob (shared token)", "operator")


async def test_behind_an_oidc_proxy_the_header_names_the_user(tmp_path):
    write_users(tmp_path / "users")
    write_user(tmp_path / "users", "carol@example.com", Role.OPERATOR, None)
    async with console(tmp_path, proxy="X-Forwarded-User") as c, c.client() as client:
        assert (await client.get("/api/me")).status_code == 401
        login = await client.get("/login")
        assert login.status_code == 401  # the proxy signs people in, not a form
        headers = {"X-Forwarded-User": "carol@example.com"}
        me = await client.get("/api/me", headers=headers)
        assert (me.json()["user"], me.json()["role"], me.json()["via"]) == (
            "carol@example.com",
            "operator",
            "proxy",
        )
        assert "se_console=" in me.headers["set-cookie"]
        csrf = me.json()["csrf"]
        # The session made for carol follows the header: another name is another session.
        dave = await client.get("/api/me", headers={"X-Forwarded-User": "dave@example.com"})
        assert (dave.json()["user"], dave.json()["role"]) == ("dave@example.com", "viewer")
        # Changes still need the CSRF token of the header's user's session.
        client.cookies.clear()
        first = await client.get("/api/me", headers=headers)
        csrf = first.json()["csrf"]
        no_token = await client.post("/api/events/X/hold", json={}, headers=headers)
        assert no_token.status_code == 403
        with_token = await client.post(
            "/api/events/X/hold", json={}, headers=headers | {"X-CSRF-Token": csrf}
        )
        assert with_token.status_code == 404  # authenticated and allowed; no such event


async def test_over_https_the_cookie_is_secure(tmp_path):
    async with console(tmp_path) as c, c.client() as client:
        page = await client.get("/login", headers={"X-Forwarded-Proto": "https"})
        token = _form_token(page.text)
        form_cookie = page.headers["set-cookie"]
        assert "Secure" in form_cookie
        # httpx keeps Secure cookies for https: the browser behind the proxy would send it.
        response = await client.post(
            "/login",
            data={"name": "alice", "password": PASSWORDS["alice"], "csrf": token},
            headers={
                "X-Forwarded-Proto": "https",
                "Origin": c.url.replace("http:", "https:"),
                "Cookie": form_cookie.split(";")[0],
            },
        )
        assert response.status_code == 303, response.text
        cookie = next(v for k, v in response.headers.multi_items() if k == "set-cookie")
        assert cookie.startswith("__Host-se_console=")
        assert "Secure" in cookie
        assert response.headers["strict-transport-security"].startswith("max-age=")


async def test_history_searches_by_event_vm_type_and_time(tmp_path):
    async with console(tmp_path) as c, c.client() as client:
        ledger = Ledger(c.db)
        for n, (vm_name, kind) in enumerate((("web-1", "Reboot"), ("web-2", "Freeze"))):
            ev, identity, message = scheduled(f"EVT-H{n}", vm_name, event_type=kind)
            await ledger.append(message)
            await ledger.append(hook(identity, ev, at=NOW + timedelta(seconds=1)))
            await ledger.append_decision(
                f"EVT-H{n}",
                "wait",
                "NotBefore applies",
                decided_by="approver",
                policy="default",
                event_type=kind,
                at=NOW + timedelta(seconds=2),
            )
        await signed_in(client, "victor")

        async def search(**params):
            response = await client.get("/api/history", params=params)
            assert response.status_code == 200, response.text
            return response.json()["entries"]

        by_vm = await search(vm="web-2")
        assert {e["event_id"] for e in by_vm} == {"EVT-H1"}
        assert [e["line"] for e in by_vm] == [
            entry_line(e) for e in await ledger.search(vm="web-2")
        ]
        assert {e["event_id"] for e in await search(type="Reboot")} == {"EVT-H0"}
        assert len(await search(event_id="EVT-H0")) == 3
        since = (NOW + timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%S")  # the page's UTC
        assert {e["kind"] for e in await search(since=since)} == {"hook.completed", "decision.wait"}
        until = (NOW + timedelta(seconds=1)).isoformat()
        assert {e["kind"] for e in await search(until=until)} == {"scheduled"}
        assert len(await search(limit="2")) == 2
        bad = await client.get("/api/history", params={"since": "yesterday"})
        assert bad.status_code == 400


async def read_batches(lines, wanted, within: float):
    """Batches of the stream until ``wanted(batch)`` says stop; returns them."""
    seen = []
    async with asyncio.timeout(within):
        event_name = None
        async for line in lines:
            if line.startswith("event: "):
                event_name = line[7:]
            elif line.startswith("data: ") and event_name == "batch":
                batch = json.loads(line[6:])
                seen.append(batch)
                if wanted(batch):
                    return seen
    return seen


async def test_the_stream_sends_a_snapshot_then_changes_within_a_second(tmp_path):
    async with console(tmp_path) as c, c.client() as client:
        _ev, identity, message = scheduled("EVT-LIVE-1")
        await c.publish(heartbeat(identity, at=NOW), message)
        await c.known("EVT-LIVE-1")
        await signed_in(client, "victor")
        async with client.stream("GET", "/api/stream") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = response.aiter_lines()
            snapshot = await read_batches(lines, lambda b: b.get("final"), 3)
            assert snapshot[0]["reset"] is True
            assert [e["id"] for e in snapshot[0]["events"]] == ["EVT-LIVE-1"]
            assert snapshot[0]["agents"][0]["scale_set"] == "web"
            # A broker message: its row arrives within a second.
            started = time.monotonic()
            _, _, second = scheduled("EVT-LIVE-2", "web-2")
            await c.publish(second)
            batches = await read_batches(
                lines, lambda b: any(e["id"] == "EVT-LIVE-2" for e in b["events"]), 3
            )
            assert time.monotonic() - started < 1.0
            assert batches[-1]["reset"] is False
            assert "EVT-LIVE-2" in [e["id"] for e in batches[-1]["events"]]
            # The approver's decision (a database row, not a message) shows up too.
            await Ledger(c.db).append_decision(
                "EVT-LIVE-1",
                "wait",
                "NotBefore applies",
                decided_by="approver",
                policy="default",
                event_type="Reboot",
            )
            batches = await read_batches(
                lines,
                lambda b: any(e["id"] == "EVT-LIVE-1" and e["decision"] for e in b["events"]),
                3,
            )
            row = next(e for e in batches[-1]["events"] if e["id"] == "EVT-LIVE-1")
            assert row["decision"]["reason"] == "NotBefore applies"


def test_a_burst_is_coalesced_into_one_batch_of_changed_rows():
    live = LiveFleet()
    feed = Feed(live, chunk=1000)
    identity = vm("web-1")
    for n in range(2500):
        ev = event(f"EVT-{n}", resources=("web-1",), not_before=NOW + timedelta(minutes=15))
        live.apply(transition("scheduled", ev, identity, at=NOW))
        live.apply(transition("updated", ev, identity, at=NOW + timedelta(seconds=1)))
    changes = live.take_changes()
    assert changes is not None
    subscriber_chunks = feed._encode(changes, reset=False)
    assert len(subscriber_chunks) == 3  # 2,501 rows in chunks of 1,000
    rows = [json.loads(chunk.split(b"data: ", 1)[1]) for chunk in subscriber_chunks]
    assert sum(len(r["events"]) for r in rows) == 2500
    assert sum(len(r["agents"]) for r in rows) == 1
    assert rows[-1]["final"] is True
    assert "final" not in rows[0]
    assert live.take_changes() is None


@pytest.mark.parametrize("size", [4])
async def test_a_page_that_falls_behind_gets_a_snapshot_not_a_backlog(size):
    live = LiveFleet()
    feed = Feed(live, queue_size=size)
    stream = feed.stream(keepalive=0.05)
    assert (await anext(stream)).startswith(b"retry:")
    first = await anext(stream)
    assert b'"reset":true' in first
    subscriber = next(iter(feed.subscribers))
    identity = vm("web-1")
    for n in range(size + 2):  # more batches than the page's queue holds
        live.apply(transition("scheduled", event(f"E{n}", resources=("web-1",)), identity))
        feed.flush()
    assert subscriber.needs_reset
    again = await anext(stream)
    assert b'"reset":true' in again
    assert again.count(b'"id":"E') == size + 2
    feed.close()
    with contextlib.suppress(StopAsyncIteration):
        while True:
            await anext(stream)
    assert feed.subscribers == set()


def test_decisions_waiting_for_their_event_are_kept_once_and_bounded():
    """PostgreSQL's console reads the last 200 decisions again at every poll: one about an
    event the view does not know (pruned an hour after it ended) waited once more at every
    poll, without bound. Each waits once, and an event's waiting decisions are bounded; the
    latest still applies when the event comes."""
    live = LiveFleet()
    for _ in range(50):
        live.decided("EVT-GONE", LatestDecision.from_row(7, NOW, {"action": "wait"}))
    for position in range(100, 1100):
        body = {"action": "wait", "reason": f"decision {position}", "policy": "default"}
        live.decided("EVT-LATER", LatestDecision.from_row(position, NOW, body))
    assert len(live._early["EVT-GONE"]) == 1
    assert len(live._early["EVT-LATER"]) <= 16
    *_, message = scheduled("EVT-LATER")
    live.apply(message)
    state = live.fleet.event("EVT-LATER")
    assert state is not None
    assert live.event_row(state)["decision"]["reason"] == "decision 1099"


def test_a_decision_that_comes_before_its_event_waits_for_it():
    live = LiveFleet()
    decision = LatestDecision.from_row(
        7, NOW, {"action": "wait", "reason": "NotBefore applies", "policy": "default"}
    )
    assert live.decided("EVT-EARLY", decision) is False
    *_, message = scheduled("EVT-EARLY")
    live.apply(message)
    state = live.fleet.event("EVT-EARLY")
    assert state is not None
    row = live.event_row(state)
    assert row["decision"]["reason"] == "NotBefore applies"


async def test_a_cookie_that_is_not_ascii_is_no_session_not_a_500(tmp_path):
    """A session cookie holding a character outside ASCII (a quoted value, decoded as latin-1)
    is no session: the sign-in page and a 401, not a 500 on every request of that browser."""
    async with console(tmp_path) as c, c.client() as client:
        for path, status in (("/login", 200), ("/api/me", 401)):
            response = await client.get(path, headers={"Cookie": b'se_console="v1.a.\xe9"'})
            assert response.status_code == status, path
        assert (await sign_in(client, "alice")).status_code == 303
        assert (await client.get("/api/me")).status_code == 200


async def test_another_applications_cookie_does_not_hide_the_session(tmp_path):
    """Cookies ignore ports and a parent domain's cookies are sent too: another application on
    the same host name sets cookies the console did not write (JSON, a space, a stray quote).
    The session cookie beside them still counts: no sign-in loop for every operator."""
    async with console(tmp_path) as c, c.client() as client:
        assert (await sign_in(client, "alice")).status_code == 303
        session = client.cookies["se_console"]
        client.cookies.clear()
        for other in ('prefs={"theme":"dark"}', "grafana_session=a b", 'x="', "=lone"):
            for header in (f"{other}; se_console={session}", f"se_console={session}; {other}"):
                me = await client.get("/api/me", headers={"Cookie": header})
                assert me.status_code == 200, header
                assert me.json()["user"] == "alice"


async def test_over_https_only_the_host_prefixed_cookie_counts(tmp_path):
    """Over https the session is ``__Host-se_console`` (Secure, this host only). A plain
    ``se_console`` is one a sibling subdomain or a man in the middle of plain http can plant:
    it must not sign the browser in as whoever made it (session fixation)."""
    async with console(tmp_path) as c, c.client() as attacker, c.client() as victim:
        assert (await sign_in(attacker, "victor")).status_code == 303
        planted = attacker.cookies["se_console"]
        https = {"X-Forwarded-Proto": "https", "Cookie": f"se_console={planted}"}
        me = await victim.get("/api/me", headers=https)
        assert me.status_code == 401
        form = await victim.get("/login", headers=https)
        assert form.status_code == 200  # the sign-in form, not a redirect into victor's session
        # The same session under the https name counts over https (and only there).
        secure = {"X-Forwarded-Proto": "https", "Cookie": f"__Host-se_console={planted}"}
        assert (await victim.get("/api/me", headers=secure)).json()["user"] == "victor"
        plain = await victim.get("/api/me", headers={"Cookie": f"__Host-se_console={planted}"})
        assert plain.status_code == 401


async def test_a_request_cannot_forge_lines_in_the_log(tmp_path, caplog):
    """The path is logged when a change is refused, decoded (``%0A`` is a line break); a name
    given with the shared token is logged at sign-in. Neither writes a line of its own."""
    caplog.set_level("INFO", logger="consumers.console")
    forged = "\n2030-01-01 INFO consumers.console: sign-in: mallory (operator, by password)"
    async with (
        console(tmp_path, token="a-long-shared-token") as c,
        c.client() as client,
        c.client() as other,
    ):
        await signed_in(client, "victor")
        refused = await client.post("/x%0A2030-01-01 INFO sign-in: mallory (operator, by password)")
        assert refused.status_code == 403
        named = await sign_in(other, f"ops{forged}", "a-long-shared-token")
        assert named.status_code == 401
    lines = [record.getMessage() for record in caplog.records]
    assert any(line.startswith("refused POST '/x\\n2030") for line in lines), lines
    assert not [line for line in lines if "\n" in line]


async def test_a_history_search_out_of_range_is_a_400_that_says_why(tmp_path):
    """A valid ISO time whose UTC falls outside years 1 to 9999, or a search term the database
    cannot hold (a NUL), is the searcher's mistake: a 400 that says which, not a 500."""
    async with console(tmp_path) as c, c.client() as client:
        await signed_in(client, "victor")
        for params, said in (
            ({"since": "0001-01-01T00:00:00+01:00"}, "since: "),
            ({"until": "9999-12-31T23:59:59-01:00"}, "until: "),
            ({"vm": "web\x00-1"}, "vm: "),
            ({"type": "x" * 201}, "type: "),
        ):
            response = await client.get("/api/history", params=params)
            assert response.status_code == 400, params
            assert response.json()["error"].startswith(said), response.json()
        assert (await client.get("/api/history", params={"since": "0001-01-02"})).status_code == 200


async def test_a_hostile_action_body_is_a_400_and_changes_nothing(tmp_path):
    """Nested arrays 8,000 deep (16 KiB allows them), a lone surrogate (valid JSON, no UTF-8 can
    store it) or a line break in a reason, version or VM: a 400 that says what is wrong, not a
    500, and nothing held, approved or recorded."""
    async with console(tmp_path) as c, c.client() as client:
        _ev, identity, message = scheduled("EVT-HOSTILE")
        await c.publish(heartbeat(identity, at=NOW), message)
        await c.known("EVT-HOSTILE")
        headers = {"X-CSRF-Token": await signed_in(client, "alice")}
        json_headers = headers | {"Content-Type": "application/json"}
        for action, body, said in (
            ("hold", b"[" * 8000, "nested"),
            ("hold", b'{"reason": "x\\ud800"}', "reason"),
            ("hold", b'{"reason": "x\\n2030-01-01 INFO forged"}', "reason"),
            ("release", b'{"reason": "\\u0000"}', "reason"),
            ("approve", b'{"version": "\\udfff"}', "version"),
            ("approve", b'{"version": "1", "vm": "web-1\\ud800"}', "vm"),
        ):
            response = await client.post(
                f"/api/events/EVT-HOSTILE/{action}", content=body, headers=json_headers
            )
            assert response.status_code == 400, (body, response.text)
            assert said in response.json()["error"], response.json()
        assert await ApproverState(c.db, "approver").holds() == {}
        assert await Ledger(c.db).history(event_id="EVT-HOSTILE") == []
        held = await client.post(
            "/api/events/EVT-HOSTILE/hold", json={"reason": "naïve café ☕"}, headers=headers
        )
        assert held.status_code == 200, held.text


async def test_a_users_file_that_cannot_be_read_signs_nobody_in(tmp_path, caplog):
    """Removing a user signs them out at once, even when the new file has a mistyped line
    elsewhere: a file that cannot be read is no reason to keep the old list (that kept the
    removed user in). Until it is fixed nobody signs in by password, and the log says why."""
    async with (
        console(tmp_path) as c,
        c.client() as alice,
        c.client() as victor,
        c.client() as other,
    ):
        await signed_in(alice, "alice")
        await signed_in(victor, "victor")
        users = tmp_path / "users"
        good = users.read_text()
        kept = [line for line in good.splitlines() if not line.startswith("alice:")]
        users.write_text("\n".join([*kept, "carol:operatr:-"]) + "\n")  # a typo on a new line
        assert (await alice.get("/api/me")).status_code == 401
        assert (await victor.get("/api/me")).status_code == 401
        assert (await sign_in(other, "victor")).status_code == 401
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1, errors  # once, not at every request
        assert f"{users}:3: role 'operatr' is not operator or viewer" in errors[0]
        assert "password sign-ins are refused" in errors[0]
        assert "usable again" not in caplog.text
        users.write_text(good)  # fixed: the sessions of users still in it hold again
        assert (await victor.get("/api/me")).status_code == 200
        assert (await alice.get("/api/me")).status_code == 200
        assert "usable again (2 users): password sign-ins resume" in caplog.text


async def test_a_deleted_users_file_signs_everybody_out(tmp_path, caplog):
    async with console(tmp_path) as c, c.client() as alice, c.client() as other:
        await signed_in(alice, "alice")
        (tmp_path / "users").unlink()
        assert (await alice.get("/api/me")).status_code == 401
        assert (await sign_in(other, "alice")).status_code == 401
    assert "cannot read the users file" in caplog.text


async def _streamed_after(c, client, end_session) -> tuple[list[str], bool]:
    """The events a stream already open delivers after ``end_session()`` (within 3 s), and
    whether it ended."""
    _ev, identity, message = scheduled("EVT-BEFORE")
    await c.publish(heartbeat(identity, at=NOW), message)
    await c.known("EVT-BEFORE")
    seen: list[str] = []
    async with client.stream("GET", "/api/stream") as response:
        lines = response.aiter_lines()
        await read_batches(lines, lambda b: b.get("final"), 3)
        await end_session()
        assert (await client.get("/api/me")).status_code == 401
        _, _, after = scheduled("EVT-AFTER", "web-9")
        await c.publish(after)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(3):
                async for line in lines:
                    if line.startswith("data: "):
                        seen += [e["id"] for e in json.loads(line[6:])["events"]]
                return seen, True
    return seen, False


@pytest.mark.parametrize("how", ["signed out", "removed", "new password"])
async def test_an_open_stream_ends_with_its_session(tmp_path, how):
    """The live stream is checked again at every batch and keep-alive, not only when the page
    connects: signed out (on another tab), removed from the users file or given a new
    password, it delivers nothing more and ends (the page then goes to the sign-in form)."""
    async with console(tmp_path) as c, c.client() as client, c.client() as other:
        csrf = await signed_in(client, "victor")
        users = tmp_path / "users"

        async def end_session():
            if how == "signed out":
                other.cookies.update(dict(client.cookies))
                response = await other.post("/logout", headers={"X-CSRF-Token": csrf})
                assert response.status_code == 200
            elif how == "removed":
                lines = users.read_text().splitlines()
                users.write_text("\n".join(x for x in lines if not x.startswith("victor:")) + "\n")
            else:
                write_user(users, "victor", Role.VIEWER, "a-new-password", iterations=1000)

        seen, ended = await _streamed_after(c, client, end_session)
        assert "EVT-AFTER" not in seen
        assert ended


async def sign_in_from(
    client: httpx.AsyncClient, address: str, name: str, password: str, token: str | None = None
):
    """A sign-in from ``address`` (X-Forwarded-For, which the console takes from 127.0.0.1,
    its reverse proxy's address); ``token``: the form's, already fetched."""
    token = token or _form_token((await client.get("/login")).text)
    return await client.post(
        "/login",
        data={"name": name, "password": password, "csrf": token},
        headers={"Origin": str(client.base_url).rstrip("/"), "X-Forwarded-For": address},
    )


async def test_concurrent_guesses_are_braked_like_sequential_ones(tmp_path):
    """An attempt counts before its password is checked: 40 guesses sent at once from one
    client get 5 password checks, like 40 one after the other, not 40."""
    async with console(tmp_path) as c, c.client() as client:
        write_user(
            tmp_path / "users",
            "alice",
            Role.OPERATOR,
            PASSWORDS["alice"],
            iterations=DEFAULT_ITERATIONS,  # the production cost: checks overlap
        )
        token = _form_token((await client.get("/login")).text)

        async def guess(n):
            response = await client.post(
                "/login",
                data={"name": "alice", "password": f"guess-{n}", "csrf": token},
                headers={"Origin": c.url},
            )
            return response.status_code

        codes = await asyncio.gather(*(guess(n) for n in range(40)))
        assert codes.count(401) <= 5, codes
        assert set(codes) <= {401, 429, 503}, codes


async def test_password_checks_run_a_few_at_a_time_and_the_rest_are_told_at_once(
    tmp_path, monkeypatch
):
    """Each check is a thread's worth of PBKDF2: guesses from many addresses at once do not
    queue threads without bound. Past a few checks at a time the answer is a 503 at once
    (try again shortly), and the attempt does not count against the name or the address."""
    lock = threading.Lock()
    running = most = 0
    check = UsersFile.verify

    def slow_check(self, user, password):
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        try:
            time.sleep(0.3)
            return check(self, user, password)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(UsersFile, "verify", slow_check)
    async with console(tmp_path) as c, c.client() as client, c.client() as alice:
        token = _form_token((await client.get("/login")).text)
        responses = await asyncio.gather(
            *(
                sign_in_from(client, f"198.51.100.{n}", f"user-{n}", "guess", token)
                for n in range(40)
            )
        )
        codes = [response.status_code for response in responses]
        assert most <= 8, most
        assert codes.count(401) >= 1
        busy = [response for response in responses if response.status_code == 503]
        assert busy, codes
        assert "Too many sign-ins at once" in busy[0].text
        assert int(busy[0].headers["retry-after"]) >= 1
        assert set(codes) == {401, 503}
        assert (
            await sign_in_from(alice, "198.51.100.1", "alice", PASSWORDS["alice"])
        ).status_code == 303


async def test_a_stranger_cannot_lock_an_operator_out(tmp_path):
    """Failures for a name count per client address: five wrong passwords for alice from a
    stranger's address brake that address for alice, not alice from hers. Failures for a name
    from anywhere slow its sign-ins down (a delay before the answer), never refuse them."""
    async with console(tmp_path) as c, c.client() as stranger, c.client() as alice:
        for n in range(5):
            assert (
                await sign_in_from(stranger, "203.0.113.7", "alice", f"guess-{n}")
            ).status_code == 401
        braked = await sign_in_from(stranger, "203.0.113.7", "alice", PASSWORDS["alice"])
        assert braked.status_code == 429
        assert "Too many failed sign-ins" in braked.text
        started = time.monotonic()
        mine = await sign_in_from(alice, "198.51.100.20", "alice", PASSWORDS["alice"])
        assert mine.status_code == 303
        assert time.monotonic() - started >= 0.9  # slowed: five failures of the name elsewhere
        # Her success clears what was counted against her name: no delay any more.
        started = time.monotonic()
        again = await sign_in_from(stranger, "192.0.2.1", "alice", PASSWORDS["alice"])
        assert again.status_code == 303
        assert time.monotonic() - started < 0.9


async def test_one_address_trying_many_names_is_braked(tmp_path):
    """Twenty failures from one address, whatever the names, brake that address (a password
    sprayed over many names); other addresses go on."""
    async with console(tmp_path) as c, c.client() as sprayer, c.client() as victor:
        for n in range(20):
            response = await sign_in_from(sprayer, "203.0.113.9", f"user-{n}", "Summer2024!")
            assert response.status_code == 401, n
        braked = await sign_in_from(sprayer, "203.0.113.9", "victor", PASSWORDS["victor"])
        assert braked.status_code == 429
        assert int(braked.headers["retry-after"]) > 0
        ok = await sign_in_from(victor, "198.51.100.30", "victor", PASSWORDS["victor"])
        assert ok.status_code == 303


async def test_behind_the_proxy_a_foreign_host_name_is_refused_first(tmp_path):
    """DNS rebinding: a page whose name now resolves to 127.0.0.1, in a browser on the
    console's host, is 'same origin' with itself and may set X-Forwarded-User. The console
    behind the proxy answers only to its --listen address and the --host-name names: anything
    else is a 400 before any session is made, saying what to pass if the name is right."""
    write_users(tmp_path / "users")
    write_user(tmp_path / "users", "carol@example.com", Role.OPERATOR, None)
    async with console(tmp_path, proxy="X-Forwarded-User") as c, c.client() as page:
        port = c.url.rsplit(":", 1)[1]
        carol = {"X-Forwarded-User": "carol@example.com"}
        for host in (f"rebind.evil.example:{port}", "rebind.evil.example", "127.0.0.2", ""):
            headers = carol | {"Host": host, "Origin": f"http://{host}"}
            me = await page.get("/api/me", headers=headers)
            assert me.status_code == 400, host
            assert "--host-name" in me.json()["error"]
            assert "set-cookie" not in me.headers
            held = await page.post("/api/events/ANY/hold", json={}, headers=headers)
            assert held.status_code == 400, host
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost."):
            me = await page.get("/api/me", headers=carol | {"Host": host})
            assert me.status_code == 200, host


async def test_the_proxy_may_pass_on_the_public_names_given_with_host_name(tmp_path):
    write_users(tmp_path / "users")
    write_user(tmp_path / "users", "carol@example.com", Role.OPERATOR, None)
    async with (
        console(tmp_path, proxy="X-Forwarded-User", host_names=("Console.Example.com",)) as c,
        c.client() as page,
    ):
        carol = {"X-Forwarded-User": "carol@example.com"}
        for host in ("console.example.com", "CONSOLE.example.com.:443", "127.0.0.1"):
            me = await page.get("/api/me", headers=carol | {"Host": host})
            assert me.status_code == 200, host
            assert me.json()["user"] == "carol@example.com"
        other = await page.get("/api/me", headers=carol | {"Host": "example.com"})
        assert other.status_code == 400
