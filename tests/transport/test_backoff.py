"""The one backoff (``schemas._backoff``): capped, exponential, jittered, reset after success."""

from __future__ import annotations

import random

import pytest

from schemas._backoff import Backoff


def test_delays_double_up_to_the_cap_with_jitter() -> None:
    backoff = Backoff(0.1, 1.0, rng=random.Random(7))
    delays = [backoff.next() for _ in range(8)]
    ceilings = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0]
    for delay, ceiling in zip(delays, ceilings, strict=True):
        assert ceiling / 2 <= delay <= ceiling
    assert len(set(delays)) == len(delays)  # jittered: no two alike


def test_reset_starts_again_from_the_base() -> None:
    backoff = Backoff(0.1, 5.0)
    for _ in range(40):  # the exponent stays bounded however long it fails
        backoff.next()
    assert backoff.next() <= 5.0
    backoff.reset()
    assert backoff.next() <= 0.1


@pytest.mark.parametrize(("base", "cap"), [(0, 1), (-1, 1), (2, 1)])
def test_a_bad_range_is_refused(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="0 < base <= cap"):
        Backoff(base, cap)
