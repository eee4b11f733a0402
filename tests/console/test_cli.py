"""``scheduled-events console`` and ``demo --console`` as an operator runs them: the first line
is the address, bad settings are one line and exit 2, SIGTERM/SIGINT stop them cleanly."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from consumers.__main__ import main

from ._stack import write_users

ROOT = Path(__file__).parent.parent.parent

MISSING = textwrap.dedent(
    """
    import sys

    class Missing:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == {module!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, Missing())
    from consumers.__main__ import main
    sys.exit(main(["console", "--broker", "memory://x", "--db", {db!r}, "--token", "t"]))
    """
)


async def _spawn(*args: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


async def _console(
    tmp_path: Path, broker: str, *flags: str, env: dict[str, str] | None = None
) -> asyncio.subprocess.Process:
    """``scheduled-events console`` on ``broker`` with its database in ``tmp_path``, listening
    on a free loopback port, with ``flags``."""
    return await _spawn(
        "-m", "consumers", "console", "--broker", broker, "--db", str(tmp_path / "central.db"),
        "--listen", "127.0.0.1:0", *flags, env=env,
    )  # fmt: skip


async def _finish(process: asyncio.subprocess.Process, within: float = 20) -> tuple[str, str]:
    try:
        out, err = await asyncio.wait_for(process.communicate(), within)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return out.decode(), err.decode()


@pytest.mark.parametrize("module", ["starlette", "uvicorn"])
async def test_without_the_extra_it_names_it_and_exits_2(module, tmp_path):
    process = await _spawn("-c", MISSING.format(module=module, db=str(tmp_path / "c.db")))
    out, err = await _finish(process)
    assert process.returncode == 2, err
    assert out == ""
    assert err.count("\n") == 1, err
    assert "pip install 'scheduled-events-relay[console]'" in err
    assert module in err


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ([], "the console needs a way to sign in"),
        (
            ["--token", "t", "--listen", "0.0.0.0:8600", "--trust-proxy-header", "X-User"],
            "listen on loopback only",
        ),
        (["--trust-proxy-header", "X-User", "--token", "t"], "drop --token"),
        (["--token", "t", "--listen", "nowhere"], "expected HOST:PORT"),
        (["--token", "t", "--tls-cert", "c.pem"], "both --tls-cert and --tls-key"),
        (["--users", "/nonexistent/users"], "cannot read the users file"),
        (["--token", "t", "--host-name", "https://console.example.com/"], "--host-name"),
        (["--token", "t", "--host-name", "console.example.com:443"], "without scheme, port"),
    ],
)
def test_bad_settings_are_one_line_and_exit_2(tmp_path, capsys, extra, said):
    argv = ["console", "--broker", "memory://x", "--db", str(tmp_path / "c.db"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err
    assert err.count("\n") == 1, err


def test_no_database_is_a_clear_error(capsys):
    assert main(["console", "--broker", "memory://x", "--token", "t"]) == 2
    assert "needs the approver's database" in capsys.readouterr().err


async def test_the_console_prints_its_address_first_and_stops_on_sigterm(tmp_path):
    users = write_users(tmp_path / "users")
    process = await _console(
        tmp_path, "memory://cli", "--users", str(users), env={"SCHEDULED_EVENTS_SESSION_HOURS": "1"}
    )
    try:
        assert process.stdout is not None
        first = (await asyncio.wait_for(process.stdout.readline(), 20)).decode().strip()
        assert first.startswith("listening on http://127.0.0.1:"), first
        url = first.removeprefix("listening on ")
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/login")).status_code == 200
            assert (await client.get("/api/me")).status_code == 401
        process.send_signal(signal.SIGTERM)
        _out, err = await _finish(process)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, err
    assert "Traceback" not in err


@pytest.mark.slow
async def test_the_demo_serves_the_console_and_prints_its_address(tmp_path):
    process = await _spawn(
        "-m", "consumers", "demo", "--console", "127.0.0.1:0", "--speed", "120", "--quiet"
    )
    try:
        assert process.stdout is not None
        url = token = None
        seen: list[str] = []
        async with asyncio.timeout(40):
            while True:
                line = (await process.stdout.readline()).decode()
                assert line, "".join(seen)
                seen.append(line)
                if line.startswith("console: "):
                    url = line.split()[1].rstrip("/")
                    token = line.rsplit(" ", 1)[1].strip().rstrip(")")
                    async with httpx.AsyncClient(base_url=url) as client:
                        page = await client.get("/login")
                        assert page.status_code == 200
                        found = re.search(r'name="csrf" value="([^"]+)"', page.text)
                        assert found is not None
                        csrf = found.group(1)
                        signed = await client.post(
                            "/login",
                            data={"name": "demo-operator", "password": token, "csrf": csrf},
                        )
                        assert signed.status_code == 303
                        me = (await client.get("/api/me")).json()
                        assert me["operator_name"] == "demo-operator (shared token)"
                if line.startswith("scenario over"):
                    break
        assert url is not None
        process.send_signal(signal.SIGINT)
        out, err = await _finish(process, 30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, err
    assert "demo passed: every event ended as expected" in out


@pytest.mark.parametrize("hours", ["inf", "nan", "1e300", "0", "-1"])
async def test_a_session_length_that_is_no_number_of_hours_is_refused_at_start(tmp_path, hours):
    """``inf`` and ``nan`` parse as floats: the console started, printed its address, and then
    every sign-in was a 500. A bad flag is one line and exit 2, like the others."""
    process = await _console(
        tmp_path, "memory://cli", "--token", "a-long-shared-token", "--session-hours", hours
    )
    out, err = await _finish(process, within=15)
    assert process.returncode == 2, (out, err)
    assert out == ""
    assert err.count("\n") == 1, err
    assert "--session-hours " in err
    assert "a number of hours from 0.1 (6 minutes) to 720 (30 days)" in err


async def test_behind_the_proxy_the_console_answers_to_its_host_names_only(tmp_path):
    users = write_users(tmp_path / "users")
    process = await _console(
        tmp_path,
        "memory://cli-hosts",
        "--users",
        str(users),
        "--trust-proxy-header",
        "X-Forwarded-User",
        "--host-name",
        "console.example.com",
    )
    try:
        assert process.stdout is not None
        first = (await asyncio.wait_for(process.stdout.readline(), 20)).decode().strip()
        url = first.removeprefix("listening on ")
        who = {"X-Forwarded-User": "alice"}
        async with httpx.AsyncClient(base_url=url) as client:
            for host, status in (
                ("console.example.com", 200),
                (url.removeprefix("http://"), 200),
                ("rebind.example.net", 400),
            ):
                response = await client.get("/api/me", headers=who | {"Host": host})
                assert response.status_code == status, host
        process.send_signal(signal.SIGTERM)
        _out, err = await _finish(process)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, err
    assert "the Host 'rebind.example.net' is not a name of this console" in err
    assert "--host-name rebind.example.net" in err
