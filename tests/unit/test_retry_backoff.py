"""The retry policy's backoff: exponential with equal jitter (between half the step and the
step), so retries never all wait next to nothing: at defaults five retries span at least
31 s, more than a PostgreSQL restart takes."""

from __future__ import annotations

import random

import pytest

from tasks.base import retry_backoff_s

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(("retries", "low", "high"), [
    (0, 1.0, 2.0), (1, 2.0, 4.0), (2, 4.0, 8.0), (3, 8.0, 16.0), (4, 16.0, 32.0),
    (8, 150.0, 300.0), (60, 150.0, 300.0),  # capped at the maximum step
])
def test_each_retry_waits_between_half_the_step_and_the_step(retries: int, low: float,
                                                             high: float) -> None:
    assert retry_backoff_s(retries, 2.0, 300.0, draw=lambda: 0.0) == low
    assert retry_backoff_s(retries, 2.0, 300.0, draw=lambda: 1.0) == high
    draws = random.Random(retries)
    for _ in range(200):
        assert low <= retry_backoff_s(retries, 2.0, 300.0, draw=draws.random) <= high


def test_five_retries_at_defaults_outlast_a_15_s_store_restart_whatever_the_draws() -> None:
    unluckiest = sum(retry_backoff_s(n, 2.0, 300.0, draw=lambda: 0.0) for n in range(5))
    assert unluckiest == 31.0


def test_sub_second_bases_keep_their_fractions() -> None:
    assert retry_backoff_s(0, 0.2, 0.5, draw=lambda: 0.0) == pytest.approx(0.1)
    assert retry_backoff_s(5, 0.2, 0.5, draw=lambda: 1.0) == pytest.approx(0.5)
