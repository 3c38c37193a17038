"""When a run that finished has collapsed: zero gradients, or preference accuracy below
chance on enough pairs that a coin would rarely score so low.

A degenerate run keeps its adapter and metrics but is never ranked: the trial marks it
(tasks/sweep/trial.py) and the leaderboard refuses to crown one (tasks/board/leaderboard.py).
"""

from __future__ import annotations

import math
from typing import Any

ZERO_GRAD_REPORTS = 2  # trailing training reports at exactly 0.0 that mean "stopped learning"
BELOW_CHANCE = 0.15  # validation accuracy this far under 0.5 ...
BELOW_CHANCE_P = 1e-3  # ... and this unlikely for a coin (one-sided binomial tail)


def degenerate_reason(reports: list[tuple[int, float]], best_val: dict[str, Any],
                      tied: frozenset[int] = frozenset()) -> str:
    """Why a run that finished has collapsed or never learned ("" if neither).

    A learning rate far too high can saturate the model: every gradient is then exactly 0
    (a float32 gradient norm is never 0.0 while anything is learned) and the pairs' logps
    tie, so held-out preference accuracy falls to 0 while the loss looks low (issue 14:
    lr 1e8 ranked first). A GRPO run's gradient is exactly 0 too where every group's G
    rewards tie (``tied``: the steps reporting ``frac_reward_zero_std`` 1): no signal.
    """
    zeros = 0
    for _, norm in reversed(reports):
        if norm != 0.0:
            break
        zeros += 1
    if zeros and zeros >= min(ZERO_GRAD_REPORTS, len(reports)):
        first = reports[len(reports) - zeros][0]
        if all(step in tied for step, _ in reports[len(reports) - zeros:]):
            return (f"degenerate: no signal: every group's rewards tied for {zeros} report(s) "
                    f"(frac_reward_zero_std 1.0 from step {first}, so grad_norm 0.0): a "
                    "policy fallen onto one answer, or a verifier it never meets; a lower "
                    "learning rate, a warm start, more generations or a higher temperature "
                    "spread the groups")
        return (f"degenerate: zero gradients for {zeros} report(s) (grad_norm 0.0 from step "
                f"{first}): the model stopped learning")
    return below_chance(best_val.get("val/logps/accuracies"), best_val.get("val/rows"),
                        f"val accuracy at step {best_val.get('step')}")


def below_chance(accuracy: float | None, rows: int | None, what: str) -> str:
    """A reason when preference ``accuracy`` on ``rows`` pairs is below chance (0.5) by
    more than BELOW_CHANCE, on enough pairs that a coin would rarely score so low."""
    if accuracy is None or not rows or not accuracy < 0.5 - BELOW_CHANCE:
        return ""
    rows, hits = int(rows), round(float(accuracy) * int(rows))
    tail = sum(math.comb(rows, k) for k in range(hits + 1)) / 2**rows
    if tail >= BELOW_CHANCE_P:
        return ""
    return (f"degenerate: {what} {accuracy:.3f} on {rows} pairs, below chance (0.5) by more "
            f"than {BELOW_CHANCE}")
