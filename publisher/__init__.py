"""The VM agent: watches IMDS Scheduled Events, publishes every transition, applies approvals.

>>> from publisher import Agent, AgentSettings
>>> agent = Agent(AgentSettings(imds_url="http://127.0.0.1:8080/vm/web-7",
...                             broker="memory://demo", state_dir=None))
>>> # task = asyncio.create_task(agent.run()); await agent.started(); ...; agent.stop()

The CLI is ``python -m publisher`` (console script ``scheduled-events-agent``).
"""

from ._agent import AGENT_VERSION, Agent
from ._settings import ENV_PREFIX, AgentSettings, HookSpec, parse_settings

__all__ = ["AGENT_VERSION", "ENV_PREFIX", "Agent", "AgentSettings", "HookSpec", "parse_settings"]
