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
from cryptography.hazmat.primitives import serialization

from publisher.simulator import AttestationCa
from publisher.simulator.__main__ import main

from .conftest import HEADERS, idle_then_ask_again

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


async def test_a_shipped_scenario_brings_its_topology() -> None:
    async with (
        simulator_process("--scenario", "scaleset-terminate") as (_, url),
        httpx.AsyncClient(base_url=url, timeout=5) as client,
    ):
        vms = [v["name"] for v in (await client.get("/admin/vms")).json()["vms"]]
    assert vms == ["web_0", "web_1", "web_2", "web_3"]


async def test_a_generated_fleet_with_scale_sets_zones_and_availability_sets() -> None:
    async with (
        simulator_process(
            "--vm",
            "lone",
            "--fleet",
            "30",
            "--scale-sets",
            "3",
            "--zones",
            "2",
            "--placement-group-size",
            "4",
            "--availability-sets",
            "2",
            "--availability-set-size",
            "3",
        ) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=5) as client,
    ):
        vms = [v["name"] for v in (await client.get("/admin/vms")).json()["vms"]]
        described = (await client.get("/admin/topology")).json()
        compute = (
            await client.get(
                "/vm/fleet-1_3/metadata/instance?api-version=2021-02-01", headers=HEADERS
            )
        ).json()["compute"]
    assert len(vms) == 1 + 30 + 6
    assert vms[:2] == ["lone", "fleet-0_0"]
    assert [s["name"] for s in described["scale_sets"]] == ["fleet-0", "fleet-1", "fleet-2"]
    groups = described["scale_sets"][0]["placement_groups"]
    assert [(g["zone"], len(g["vms"])) for g in groups] == [("1", 4), ("2", 4), ("1", 1), ("2", 1)]
    assert [a["name"] for a in described["availability_sets"]] == ["avset-0", "avset-1"]
    assert described["standalone"] == ["lone"]
    assert (compute["vmScaleSetName"], compute["zone"]) == ("fleet-1", "2")


async def test_a_topology_file(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(
        """
vms = ["jump"]
[[scale_sets]]
name = "web"
capacity = 4
zones = ["1", "2"]
[[availability_sets]]
name = "db"
vms = ["db-a", "db-b"]
""",
        encoding="utf-8",
    )
    async with (
        simulator_process("--topology", str(path)) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=5) as client,
    ):
        vms = [v["name"] for v in (await client.get("/admin/vms")).json()["vms"]]
        shown = (await client.get("/admin/vms/db-b")).json()
    assert vms == ["web_0", "web_1", "web_2", "web_3", "db-a", "db-b", "jump"]
    assert shown["availability_set"] == "db"
    assert shown["sees_events_of"] == ["db-a", "db-b"]


async def test_a_bad_topology_file_exits_2_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"scale_sets": [{"name": "web", "capacity": 0}]}), "utf-8")
    code, _, err = await run_cli("--topology", str(path))
    assert code == 2
    assert "scale_sets[0].capacity" in err


async def test_a_given_attestation_ca(tmp_path: Path) -> None:
    ca = AttestationCa.generate()
    (tmp_path / "ca.pem").write_bytes(ca.certificate_pem())
    (tmp_path / "ca.key").write_bytes(
        ca.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    args = ["--attestation-ca-cert", str(tmp_path / "ca.pem")]
    args += ["--attestation-ca-key", str(tmp_path / "ca.key")]
    async with (
        simulator_process(*args) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=5) as client,
    ):
        served = (await client.get("/admin/attestation/ca.pem")).content
    assert served == ca.certificate_pem()
    code, _, err = await run_cli("--attestation-ca-cert", str(tmp_path / "ca.pem"))
    assert code == 2
    assert "--attestation-ca-key" in err
    code, _, err = await run_cli(
        "--attestation-ca-cert", str(tmp_path / "ca.key"), "--attestation-ca-key",
        str(tmp_path / "ca.key"),
    )  # fmt: skip
    assert code == 2
    assert "not a PEM certificate" in err


async def test_keep_alive_seconds_reaches_the_server() -> None:
    async with simulator_process("--keep-alive-seconds", "1") as (process, url):
        port = int(url.rsplit(":", 1)[1])
        assert await idle_then_ask_again(port, 1.6) == b""  # closed after 1 s, not uvicorn's 5
        process.terminate()
        assert await asyncio.wait_for(process.wait(), timeout=10) == 0


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
        (["--keep-alive-seconds", "0"], "--keep-alive-seconds: must be >= 1"),
        (["--vm", "bad/name"], "--vm: bad VM name"),
        (["--scenario", "no-such"], "no such file, nor a shipped scenario"),
        (["--scale-sets", "0"], "--scale-sets: must be >= 1"),
        (["--availability-sets", "2"], "--availability-set-size"),
        (["--vm", "fleet_0", "--fleet", "2"], "fleet_0"),
        (["--topology", "/no/such/file.toml"], "/no/such/file.toml"),
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
        "--scale-sets",
        "--zones",
        "--placement-group-size",
        "--availability-sets",
        "--availability-set-size",
        "--topology",
        "--shard",
        "--attestation-ca-cert",
        "--attestation-ca-key",
        "--speed",
        "--scenario",
        "--list-scenarios",
        "--rate-limit",
        "--first-call-delay",
        "--keep-alive-seconds",
        "--subscription-id",
        "--resource-group",
        "--location",
        "--seed",
        "--log-level",
    ):
        assert flag in out, flag
    for fault in ('"stale"', '"reset"', '"drip_seconds"', '"huge_mb"', '"delay_seconds"'):
        assert fault in out, fault


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
