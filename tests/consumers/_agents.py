"""Real agents for the consumer tests: the settings every such test starts from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from publisher import AgentSettings
from schemas.channels import ChannelNames


def agent_settings(
    imds_url: str,
    broker: str,
    channels: ChannelNames,
    trust_key: Path,
    state_dir: Path | None,
    **overrides: Any,
) -> AgentSettings:
    """A real agent's settings, quick for a test: it polls every 0.2 s and drains its outbox
    for at most 3 s when it stops (``overrides`` change any of them)."""
    fields: dict[str, Any] = {"poll_interval": 0.2, "drain_timeout": 3.0} | overrides
    return AgentSettings(
        imds_url=imds_url,
        broker=broker,
        state_dir=state_dir,
        trust_keys=(trust_key,),
        channels=channels,
        **fields,
    )
