"""``python -m publisher.simulator`` as a subprocess: the first line, flags, signals."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from publisher.simulator.__main__ import main

from .conftest import HEADERS

SE = "/metadata/scheduledevents?api-version=2020-07-01"


@asynccontextmanager
async def simulator_process(*args: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """Start the CLI on port 0; yield the process and the URL of its first line."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "publisher.simulator",
        "--port",
        "0",
        "--log-level",
        "warning",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), timeout=20)).decode()
        assert line.startswith("listening on http://127.0.0.1:"), line
        yield process, line.removeprefix("listening on ").strip()
    finally:
        if process.returncode is None:
            process.kill()
            await asyncio.wait_for(process.wait(), timeout=10)


async def run_cli(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "publisher.simulator",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=20)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_it_serves_then_exits_cleanly_on_a_signal(signum: signal.Signals) -> None:
    async with simulator_process("--vm", "a", "--vm", "b_1") as (process, url):
        port = int(url.rsplit(":", 1)[1])
        assert port > 0
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            first = await client.get(SE, headers=HEADERS)
            assert first.json() == {"DocumentIncarnation": 1, "Events": []}
            compute = (
                await client.get(
                    "/vm/b_1/metadata/instance?api-version=2021-02-01", headers=HEADERS
                )
            ).json()["compute"]
            assert compute["vmScaleSetName"] == "b"
            default = (
                await client.get("/metadata/instance?api-version=2021-02-01", headers=HEADERS)
            ).json()["compute"]
            assert default["name"] == "a"
        process.send_signal(signum)
        assert await asyncio.wait_for(process.wait(), timeout=10) == 0
        assert process.stderr is not None
        assert "Traceback" not in (await process.stderr.read()).decode()


async def test_one_vm_by_default_and_flags_reach_the_simulator() -> None:
    async with simulator_process(
        "--rate-limit", "2", "--speed", "60", "--subscription-id", "sub-x", "--fleet", "3"
    ) as (process, url):
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            vms = (await client.get("/admin/vms")).json()["vms"]
            assert [v["name"] for v in vms] == ["fleet_0", "fleet_1", "fleet_2"]
            statuses = [(await client.get(SE, headers=HEADERS)).status_code for _ in range(3)]
            assert statuses == [200, 200, 429]
            created = (await client.post("/admin/events", json={"EventType": "Preempt"})).json()
            assert created["RunSeconds"] == 60
            compute = (await client.get("/admin/vms/fleet_0")).json()["compute"]
            assert compute["subscriptionId"] == "sub-x"
        process.terminate()
        assert await asyncio.wait_for(process.wait(), timeout=10) == 0

    async with (
        simulator_process() as (process, url),
        httpx.AsyncClient(base_url=url, timeout=5) as client,
    ):
        assert [v["name"] for v in (await client.get("/admin/vms")).json()["vms"]] == ["vm0"]


async def test_a_shipped_scenario_by_name_brings_its_vms() -> None:
    async with (
        simulator_process("--scenario", "live-migration", "--speed", "100") as (_, url),
        httpx.AsyncClient(base_url=url, timeout=5) as client,
    ):
        async with asyncio.timeout(10):
            while True:
                document = (await client.get(SE, headers=HEADERS)).json()
                if document["Events"]:
                    break
                await asyncio.sleep(0.02)
        assert document["Events"][0]["Resources"] == ["WestNO_0", "WestNO_1"]


async def test_a_bad_flag_exits_2_with_a_message() -> None:
    code, out, err = await run_cli("--bogus")
    assert code == 2
    assert "unrecognized arguments: --bogus" in err
    assert out == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--speed", "0"], "--speed: must be a positive number"),
        (["--speed", "fast"], "--speed: not a number"),
        (["--port", "70000"], "--port: must be 0..65535"),
        (["--rate-limit", "-1"], "--rate-limit: must be >= 0"),
        (["--first-call-delay", "x"], "--first-call-delay: not a number"),
        (["--vm", "bad/name"], "--vm: bad VM name"),
        (["--scenario", "no-such"], "no such file, nor a shipped scenario"),
    ],
)
def test_bad_input_exits_2_with_a_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same parser, in-process (a subprocess per case would be slow)."""
    with pytest.raises(SystemExit) as caught:
        main(args)
    assert caught.value.code == 2
    out, err = capsys.readouterr()
    assert message in err
    assert out == ""


async def test_a_bad_scenario_file_exits_2_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps(
            {
                "vms": ["a"],
                "actions": [
                    {
                        "at": 0,
                        "action": "create_event",
                        "event": {"EventType": "Freeze", "Resources": ["ghost"]},
                    }
                ],
            }
        ),
        encoding="utf-8",
    )
    code, _, err = await run_cli("--scenario", str(path))
    assert code == 2
    assert "actions[0].event.Resources: unknown VM(s) 'ghost'" in err


async def test_help_explains_every_flag() -> None:
    code, out, _ = await run_cli("--help")
    assert code == 0
    for flag in (
        "--host",
        "--port",
        "--vm",
        "--fleet",
        "--fleet-prefix",
        "--speed",
        "--scenario",
        "--list-scenarios",
        "--rate-limit",
        "--first-call-delay",
        "--subscription-id",
        "--resource-group",
        "--location",
        "--seed",
        "--log-level",
    ):
        assert flag in out, flag


async def test_list_scenarios() -> None:
    code, out, _ = await run_cli("--list-scenarios")
    assert code == 0
    names = {line.split(":", 1)[0] for line in out.splitlines()}
    assert {"live-migration", "fleet-wave", "hardware-failure"} <= names
    assert len(names) == 7


async def test_a_port_in_use_exits_1() -> None:
    async with simulator_process() as (_, url):
        port = url.rsplit(":", 1)[1]
        code, _, err = await run_cli("--port", port)
        assert code == 1
        assert "cannot serve" in err
