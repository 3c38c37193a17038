"""engine/settings/metric_order.py: the one better rule (the trainer's best, the sweep's
running best, the leaderboard's order), hand-checked."""

from __future__ import annotations

import math

import pytest

from engine.settings.metric_order import beats, rank_key

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("value", "best", "mode", "want"), [
    (0.5, 0.7, "min", True), (0.7, 0.5, "min", False), (0.5, 0.5, "min", False),
    (0.7, 0.5, "max", True), (0.5, 0.7, "max", False),
    (math.nan, 0.5, "min", False), (0.5, math.nan, "max", True),  # NaN is never best
    (None, 0.5, "max", False), (0.1, None, "min", True), (math.inf, 1.0, "max", False),
])
def test_beats(value, best, mode, want) -> None:
    assert beats(value, best, mode) is want


def test_rank_key_orders_best_first_and_missing_last() -> None:
    values = [0.2, None, 0.9, math.nan, 0.5]
    assert sorted(values, key=lambda v: rank_key(v, "max"))[:3] == [0.9, 0.5, 0.2]
    assert sorted(values, key=lambda v: rank_key(v, "min"))[:3] == [0.2, 0.5, 0.9]
