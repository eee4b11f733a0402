"""The simulator's settings: one typed object, built once at the edge (CLI or test)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ._attestation import AttestationCa
from ._errors import ConfigError
from ._identity import Placement

__all__ = ["Shard", "SimulatorConfig"]


@dataclass(frozen=True, slots=True)
class Shard:
    """Shard ``index`` (from 0) of ``count``: which part of the fleet one process serves.

    Every shard holds the whole fleet, so identities are the same everywhere, and with the same
    seed and the same inputs (scenario, admin calls) so are the events; but it answers IMDS
    requests only for its own VMs (404 for the others, naming their shard). A shard is a set of
    whole delivery groups (placement groups, availability sets, standalone VMs), dealt round-robin
    in the order they first appear, so every VM that sees an event of its group is on one shard.

    >>> Shard.parse("1/4")
    Shard(index=1, count=4)
    """

    index: int
    count: int

    def __post_init__(self) -> None:
        if not (self.count >= 1 and 0 <= self.index < self.count):
            raise ConfigError(f"a shard is K/N with 0 <= K < N, got {self.index}/{self.count}")

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"K/N"`` (K from 0)."""
        index, _, count = text.partition("/")
        try:
            return cls(int(index), int(count))
        except ValueError:
            raise ConfigError(f"a shard is K/N with 0 <= K < N, got {text!r}") from None

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


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
    - ``shard``: serve only that part of the fleet (see :class:`Shard`); None serves it all.
    - ``attestation_ca``: the CA that issues the certificate signing attested documents; None
      makes a test CA (derived from ``seed`` when there is one, so shards share it).

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
    attestation_ca: AttestationCa | None = None
    shard: Shard | None = None

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
