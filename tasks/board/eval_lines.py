"""An evaluation's metrics as the lines its log shows: one a split, the headline figures
with their 95 % intervals (the board's own notation, tasks/board/leaderboard.py), e.g.

    t-983b valid: loss 0.683, acc 0.61 [.52–.70] n=64; exact 0.20 [.12–.31] n=64; 410 tok/s

The whole record stays in the task's result and the board's parquet.
"""

from __future__ import annotations

from typing import Any

from tasks.board.leaderboard import gen_labels, with_interval


def split_line(metrics: dict[str, Any], split: str) -> str | None:
    """``split``'s figures in one line, or None when the evaluation has none there."""
    pref = f"eval/{split}/"
    parts = []
    if isinstance(metrics.get(f"{pref}loss"), int | float):
        acc = with_interval(metrics, f"{pref}logps/accuracies")
        rows = metrics.get(f"{pref}rows")
        parts.append(f"loss {metrics[f'{pref}loss']:.3g}, acc {acc}"
                     + (f" n={rows}" if rows else ""))
    for label in gen_labels([metrics], split):
        n = metrics.get(f"gen/{split}/{label}/n")
        parts.append(f"{label} {with_interval(metrics, f'gen/{split}/{label}')}"
                     + (f" n={n}" if n else ""))
    if isinstance(metrics.get(f"gen/{split}/tokens_per_sec"), int | float):
        parts.append(f"{metrics[f'gen/{split}/tokens_per_sec']:.0f} tok/s")
    return "; ".join(parts) if parts else None


def evaluation_lines(name: str, metrics: dict[str, Any]) -> list[str]:
    """One line a split holding figures, named ``name split:``."""
    return [f"{name} {split}: {line}" for split in ("valid", "test")
            if (line := split_line(metrics, split)) is not None]
