"""Small-sample statistics for the board: 95 % intervals and the paired test against base.

- A share of successes (preference accuracy, an exact-match rate: scores that are all 0
  or 1) gets Wilson's score interval (Wilson 1927; Agresti & Coull 1998 show it keeps its
  coverage near 95 % down to small n, where the normal ±1.96·√(p(1−p)/n) does not).
- A mean of scores in [0, 1] that are not all 0/1 gets the normal interval on the sample
  standard deviation, clipped to [0, 1].
- Two models scored on the same rows are compared pair by pair: wins, ties, losses, and
  the exact two-sided sign test on the rows that differ (for 0/1 scores this is
  McNemar's exact test): p = min(1, 2·P[X ≤ min(w, l)]), X ~ Binomial(w + l, ½).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile


@dataclass(frozen=True)
class Estimate:
    """A mean over ``n`` rows and its 95 % interval."""

    mean: float
    n: int
    low: float
    high: float

    def text(self, digits: int = 2) -> str:
        """``0.64 [0.52, 0.75] (n=69)``."""
        return (f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}] "
                f"(n={self.n})")


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a share ``successes / n``; (0, 1) for n = 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # At p = 0 or 1 a bound equals p exactly, and rounding put it past p (1 - 1e-16 for
    # 207 right of 207): the interval always holds its estimate.
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


def estimate(scores: Sequence[float]) -> Estimate | None:
    """The mean of ``scores`` (each in [0, 1]) with its 95 % interval; None for none."""
    n = len(scores)
    if n == 0:
        return None
    mean = math.fsum(scores) / n
    if all(s in (0.0, 1.0) for s in scores):
        return Estimate(mean, n, *wilson(math.fsum(scores), n))
    sd = math.sqrt(math.fsum((s - mean) ** 2 for s in scores) / (n - 1)) if n > 1 else 0.0
    half = Z95 * sd / math.sqrt(n)
    return Estimate(mean, n, max(0.0, mean - half), min(1.0, mean + half))


def sign_test(wins: int, losses: int) -> float:
    """The exact two-sided sign test's p-value for ``wins`` against ``losses`` (ties
    left out); 1.0 when no row differs."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = math.fsum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


@dataclass(frozen=True)
class Paired:
    """A model against the base on the rows both were scored on."""

    wins: int
    ties: int
    losses: int
    p: float

    @property
    def n(self) -> int:
        return self.wins + self.ties + self.losses

    def text(self) -> str:
        verdict = "significant" if self.p < 0.05 else "not significant"
        return (f"{self.wins} better, {self.ties} same, {self.losses} worse of {self.n}; "
                f"sign test p={self.p:.2g} ({verdict} at 0.05)")


def paired(model: Mapping[str, float], base: Mapping[str, float]) -> Paired | None:
    """``model``'s per-row scores against ``base``'s on the rows (ids) both have; None
    when they share none."""
    common = [k for k in model if k in base]
    if not common:
        return None
    wins = sum(model[k] > base[k] for k in common)
    losses = sum(model[k] < base[k] for k in common)
    return Paired(wins, len(common) - wins - losses, losses, sign_test(wins, losses))
