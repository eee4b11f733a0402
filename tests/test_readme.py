"""The README's library example runs as written: copied out of README.md into a file, run as a
script against the real RabbitMQ (in a throwaway vhost, so its default entity names are its
own), it prints the Reboot a VM reports."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas.transport import open_transport
from schemas.wire import lifecycle_message
from tests.consumers._factory import event, transition, vm
from tests.deploy._rabbitmq import rabbitmqctl_or_skip

ROOT = Path(__file__).parents[1]


def readme_block(heading: str, language: str) -> str:
    """The first ``language`` code block after the heading line ``heading``."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n{heading}\n")
    found = re.search(rf"```{language}\n(.*?)```", text[start:], re.DOTALL)
    assert found is not None, f"no {language} block after {heading!r}"
    return found.group(1)


@pytest.fixture
def vhost(amqp_url: str) -> Iterator[str]:
    ctl = rabbitmqctl_or_skip()
    name = f"readme-{uuid.uuid4().hex[:8]}"

    def run(*args: str) -> None:
        subprocess.run([ctl, *args], check=True, capture_output=True, timeout=60)

    run("add_vhost", name)
    try:
        run("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield name
    finally:
        subprocess.run([ctl, "delete_vhost", name], capture_output=True, timeout=60, check=False)


@pytest.mark.rabbitmq
async def test_the_library_example_runs_as_written(
    amqp_url: str, vhost: str, tmp_path: Path
) -> None:
    script = tmp_path / "example.py"
    script.write_text(readme_block("### As a library", "python"))
    broker = amqp_url.rstrip("/") + "/" + vhost
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        cwd=tmp_path,
        env={**os.environ, "SCHEDULED_EVENTS_BROKER": broker, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        reboot = transition("scheduled", event("EVT-README", resources=("web-7",)), vm("web-7"))
        freeze = transition(
            "scheduled", event("EVT-OTHER", event_type="Freeze", resources=("web-8",)), vm("web-8")
        )
        async with open_transport(broker) as transport:
            for message in (freeze, reboot):
                await transport.publish(lifecycle_message(message))
        assert process.stdout is not None
        async with asyncio.timeout(30):
            line = (await process.stdout.readline()).decode()
        if not line:  # it ended: say why
            assert process.stderr is not None
            raise AssertionError((await process.stderr.read()).decode())
        assert "web-7" in line
        assert "EVT-README" in line
    finally:
        process.terminate()
        _, err = await process.communicate()
    assert b"Traceback" not in err, err.decode()
