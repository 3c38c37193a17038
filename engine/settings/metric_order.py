"""Which metric value is better: one rule for the trainer's best validation, the sweep's
running best and the leaderboard's order. ``mode`` min or max; a missing or non-finite
value is never better than a finite one."""

from __future__ import annotations

import math

MODES = ("min", "max")


def rank_key(value: float | None, mode: str) -> float:
    """Ascending key: the best first, a missing or NaN value last (inf)."""
    if value is None or not math.isfinite(value):
        return math.inf
    return value if mode == "min" else -value


def beats(value: float | None, best: float | None, mode: str) -> bool:
    """Whether ``value`` is strictly better than ``best`` under ``mode``."""
    return rank_key(value, mode) < rank_key(best, mode)
