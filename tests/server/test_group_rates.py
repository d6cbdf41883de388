"""A group member's rate (positions written over the last :data:`RATE_SPAN_S`) and peak rate (the
highest of those over :data:`PEAK_SPAN_S`), kept as running figures, against their definitions
computed from the whole history, asked at times that do not go back. No daemon."""

from __future__ import annotations

import random

import pytest

from kspeed.server.production.groups import PEAK_SPAN_S, RATE_SPAN_S, GroupState


def rate_by_definition(history: list[tuple[float, int]], now: float) -> float:
    return sum(n for t, n in history if now - t <= RATE_SPAN_S) / RATE_SPAN_S


@pytest.mark.parametrize("seed", range(5))
def test_rate_and_peak_match_their_definitions_over_a_random_history(seed):
    rng = random.Random(seed)
    group = GroupState("g", 1000, 1000)
    history: list[tuple[float, int]] = []
    rates: list[tuple[float, float]] = []  # the rate when each write was reported
    now = 100.0
    for _ in range(600):
        now += rng.choice([0.001, 0.05, 0.3, 1.0, 4.0, 12.0])  # bursts, pauses past both spans
        n = rng.randint(1, 64)
        group.wrote("m", n, now)
        history.append((now, n))
        rates.append((now, rate_by_definition(history, now)))
        later = now + rng.choice([0.0, 0.5, 6.0, 31.0])  # asked again later, before the next write
        for when in (now, later):
            assert group.rate("m", when) == pytest.approx(rate_by_definition(history, when))
            expected = max((r for t, r in rates if when - t <= PEAK_SPAN_S), default=0.0)
            assert group.peak("m", when) == pytest.approx(expected)
        now = later  # (the production lock orders the asks: time does not go back)


def test_a_member_that_left_has_no_rate_and_others_keep_theirs():
    group = GroupState("g", 100, 100)
    group.join("a", "f1", 0)
    group.join("b", "f2", 0)
    group.wrote("a", 50, 10.0)
    group.wrote("b", 20, 10.0)
    assert group.leave("a", "f1")
    assert (group.rate("a", 10.0), group.peak("a", 10.0)) == (0.0, 0.0)
    assert group.rate("b", 10.0) == pytest.approx(20 / RATE_SPAN_S) == group.peak("b", 11.0)
