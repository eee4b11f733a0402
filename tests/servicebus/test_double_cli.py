"""``python -m tests.servicebus_double`` as a separate process, as other tools would run it."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient

pytestmark = [pytest.mark.servicebus, pytest.mark.timeout(30)]

REPO_ROOT = Path(__file__).resolve().parents[2]


async def test_standalone_prints_its_address_serves_and_stops_on_sigterm() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.servicebus_double",
        "--port",
        "0",
        "--queue",
        "jobs",
        "--topic",
        "events:a,b",
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        first = (await asyncio.wait_for(process.stdout.readline(), 10)).decode().strip()
        assert first.startswith("listening on 127.0.0.1:")
        port = int(first.rsplit(":", 1)[1])
        assert port > 0
        connection_string = (await asyncio.wait_for(process.stdout.readline(), 5)).decode()
        assert f"sb://127.0.0.1:{port};" in connection_string
        async with ServiceBusClient.from_connection_string(connection_string.strip()) as client:
            async with client.get_topic_sender("events") as sender:
                await sender.send_messages(ServiceBusMessage(b"over the wire"))
            async with client.get_subscription_receiver("events", "b", max_wait_time=2) as rx:
                (got,) = await rx.receive_messages(max_message_count=1, max_wait_time=2)
                assert b"".join(got.body) == b"over the wire"
                await rx.complete_message(got)
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 10) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_control_lines_report_usage_and_the_end_of_input_stops_it() -> None:
    """Another process measures a client against the double through its stdin and stdout."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.servicebus_double",
        "--queue",
        "jobs",
        "--control",
        cwd=REPO_ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdin is not None
    assert process.stdout is not None
    try:
        await asyncio.wait_for(process.stdout.readline(), 10)
        connection_string = (await asyncio.wait_for(process.stdout.readline(), 5)).decode()

        async def ask(command: str) -> str:
            assert process.stdin is not None
            assert process.stdout is not None
            process.stdin.write(f"{command}\n".encode())
            await process.stdin.drain()
            return (await asyncio.wait_for(process.stdout.readline(), 5)).decode()

        assert await ask("restart-usage") == "ok\n"
        client = ServiceBusClient.from_connection_string(connection_string.strip())
        async with client, client.get_queue_sender("jobs") as sender:
            await sender.send_messages(ServiceBusMessage(b"x"))
            usage = json.loads(await ask("usage"))
        assert usage["connections"]["now"] == 1
        assert usage["send_links_by_entity"]["jobs"]["opened"] == 1
        assert "unknown command" in json.loads(await ask("nonsense"))["error"]
        process.stdin.close()
        assert await asyncio.wait_for(process.wait(), 10) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
