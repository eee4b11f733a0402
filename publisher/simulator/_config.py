"""The simulator's settings: one typed object, built once at the edge (CLI or test)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ._errors import ConfigError
from ._identity import Placement

__all__ = ["SimulatorConfig"]


@dataclass(frozen=True, slots=True)
class SimulatorConfig:
    """How the simulated IMDS behaves.

    - ``speed``: every simulated duration (notice, run time, delays) is divided by it; NotBefore
      stays a real wall-clock time.
    - ``rate_limit``: requests per real second per VM before 429; 0 turns throttling off.
    - ``first_call_delay``: simulated seconds the first Scheduled Events call of each VM waits
      (Azure: up to 120).
    - ``seed``: makes EventIds reproducible; None draws them at random.
    - ``finished_events_kept``: how many Completed/Canceled events stay visible to the admin API.

    >>> SimulatorConfig(speed=60, rate_limit=0).speed
    60
    """

    speed: float = 1.0
    rate_limit: int = 5
    first_call_delay: float = 0.0
    placement: Placement = field(default_factory=Placement)
    request_log_size: int = 1000
    seed: int | None = None
    finished_events_kept: int = 10_000

    def __post_init__(self) -> None:
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise ConfigError(f"speed must be a positive number, got {self.speed!r}")
        if self.rate_limit < 0:
            raise ConfigError(f"rate_limit must be >= 0 (0 = off), got {self.rate_limit!r}")
        if not (math.isfinite(self.first_call_delay) and self.first_call_delay >= 0):
            raise ConfigError(f"first_call_delay must be >= 0, got {self.first_call_delay!r}")
        if self.request_log_size < 0:
            raise ConfigError(f"request_log_size must be >= 0, got {self.request_log_size!r}")
        if self.finished_events_kept < 0:
            raise ConfigError(
                f"finished_events_kept must be >= 0, got {self.finished_events_kept!r}"
            )
