"""What a row is ranked by: its value of a metric, and which way that metric is better.

The sweep's progress line, the trials table, the plots and the leaderboard all read a
trial's figure here, so no two of them read another column or rank the other way.
"""

from __future__ import annotations

from typing import Any


def metric_value(summary: dict[str, Any], metric: str) -> float | None:
    """The trial's best value of the spec's validation ``metric`` (``val/…``: its best in
    training), or an evaluation's column as it is (``gen/valid/exact``, ``eval/…``)."""
    value = summary.get(metric if metric.startswith(("gen/", "eval/")) else f"best/{metric}")
    return None if value is None else float(value)


def rank_mode(metric: str, mode: str) -> str:
    """Which way ``metric`` ranks: a generation score (``gen/…``) is better higher; any
    other metric goes ``mode``."""
    return "max" if metric.startswith("gen/") else mode
