"""Without Starlette or uvicorn (the ``[simulator]`` extra), the CLI says what to install and
exits 2; the in-process simulator still works."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

BLOCK = textwrap.dedent(
    """
    import sys

    class Missing:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == {module!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, Missing())
    """
)

RUN_MODULE = """
import runpy
sys.argv = ["publisher.simulator", "--port", "0"]
runpy.run_module("publisher.simulator", run_name="__main__", alter_sys=True)
"""

RUN_SCRIPT = """
from publisher.simulator.__main__ import main
sys.exit(main(["--port", "0"]))
"""

IN_PROCESS = """
from publisher.simulator import EventSpec, EventType, Simulator
sim = Simulator(vms=["a"])
sim.add_event(EventSpec(event_type=EventType.FREEZE))
assert sim.scheduled_events_document("a")["DocumentIncarnation"] == 2
assert "starlette" not in sys.modules
print("ok")
"""


async def _python(code: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout=30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.mark.parametrize("module", ["starlette", "uvicorn"])
@pytest.mark.parametrize("entry", [RUN_MODULE, RUN_SCRIPT], ids=["-m", "script"])
async def test_the_cli_names_the_extra_and_exits_2(module: str, entry: str) -> None:
    code, out, err = await _python(BLOCK.format(module=module) + entry)
    assert code == 2, err
    assert out == ""
    assert err.count("\n") == 1, err
    assert "pip install 'scheduled-events-relay[simulator]'" in err
    assert module in err
    assert "Traceback" not in err


async def test_the_in_process_simulator_needs_no_extra() -> None:
    code, out, err = await _python(BLOCK.format(module="starlette") + IN_PROCESS)
    assert (code, out.strip()) == (0, "ok"), err
