"""The VM agent: watches IMDS Scheduled Events, publishes every transition, applies approvals.

>>> from publisher import Agent, AgentSettings
>>> agent = Agent(AgentSettings(imds_url="http://127.0.0.1:8080/vm/web-7",
...                             broker="memory://demo", state_dir=None))
>>> # task = asyncio.create_task(agent.run()); await agent.started(); ...; agent.stop()

The CLI is ``python -m publisher`` (console script ``scheduled-events-agent``).
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from ._agent import AGENT_VERSION, Agent
    from ._settings import ENV_PREFIX, AgentSettings, HookSpec, parse_settings

__all__ = ["AGENT_VERSION", "ENV_PREFIX", "Agent", "AgentSettings", "HookSpec", "parse_settings"]

# Loaded on first use, so that ``python -m publisher.simulator`` does not import the agent.
_HOME = {
    "AGENT_VERSION": "._agent",
    "Agent": "._agent",
    "ENV_PREFIX": "._settings",
    "AgentSettings": "._settings",
    "HookSpec": "._settings",
    "parse_settings": "._settings",
}


def __getattr__(name: str) -> _typing.Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'publisher' has no attribute {name!r}")
    value = getattr(_importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value
