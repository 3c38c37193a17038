"""GRPO's reward (``reward:`` in a spec, ``--reward`` on the command line): Pomona's own
scorers (tasks/eval/scorers.py) as the verifier, weighted as TRL's ``reward_weights``.

``reward: task:parity`` is one scorer, weight 1; ``[task:parity, contains]`` several, each
weight 1; ``{task:parity: 1.0, contains: 0.5}`` several with their weights. A completion's
reward is Σ_k w_k · s_k(prompt, completion, row), each score in [0, 1]. The scorers' rules
hold as they are: one that cannot be imported is refused when the reward is read, one that
raises, returns a non-number or takes longer than ``score_timeout_s`` is a one-line
ScorerError naming it and the row. The engine takes the result as a callable
(``RewardFn``), the way mlx-lm's trainer takes its loss: it imports no scorer, and finds
``reward_function`` through the entry point pyproject.toml declares
(engine/train/reward_source.py).
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.losses.base import LossSettings
from engine.losses.sampled import samples_now
from engine.train.reward_source import RewardFn
from tasks.eval.scorers import (
    Scorer,
    ScorerError,
    distinct,
    parse_scorer,
    score_rows,
    scorer_code,
)


@dataclass(frozen=True)
class Reward:
    """The scorers a reward sums and their weights, parsed and checked once."""

    scorers: tuple[Scorer, ...]
    weights: tuple[float, ...]

    @classmethod
    def parse(cls, value: Any, where: str = "reward") -> Reward:
        """A spec's or the CLI's value (one name, a list, or a mapping of name to weight);
        ScorerError (one line, naming ``where``) when it cannot be used."""
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list | tuple) and value:
            named = {v: 1.0 for v in value} if all(isinstance(v, str) for v in value) else None
            if named is None or len(named) < len(value):
                raise ScorerError(f"{where}: expected scorer names, each once, got {value!r}")
        elif isinstance(value, dict) and value:
            named = dict(value)
        else:
            raise ScorerError(f"{where}: expected a scorer (task:parity), a list of them, or "
                              f"a mapping of scorer to weight, got {value!r}")
        for name, w in named.items():
            if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
                raise ScorerError(f"{where}: {name}: weight {w!r}, expected a finite number")
        if not any(named.values()):
            raise ScorerError(f"{where}: every weight is 0: every reward would be 0")
        scorers = distinct(tuple(parse_scorer(n) for n in named))
        return cls(scorers, tuple(float(w) for w in named.values()))

    def function(self, limit_s: float) -> RewardFn:
        """This reward as the callable the trainer takes; each call scores within
        ``limit_s`` seconds in all (``score_rows``)."""
        def reward(prompts: list[str], completions: list[str], rows: list[dict[str, Any]]
                   ) -> tuple[list[float], dict[str, float]]:
            scored = score_rows(self.scorers, list(zip(prompts, completions, rows,
                                                       strict=True)), limit_s)
            totals = [sum(w * values[s.label] for s, w in zip(self.scorers, self.weights,
                                                            strict=True))
                      for values in scored]
            means = {f"rewards/{s.label}/mean": sum(v[s.label] for v in scored)
                     / max(len(scored), 1) for s in self.scorers}
            return totals, means

        return reward


def reward_function(names: tuple[str, ...], weights: tuple[float, ...] | None,
                    limit_s: float) -> RewardFn:
    """The engine's reward resolver (entry point ``pomona.rewards``): the scorers ``names``,
    weighted by ``weights`` (None: 1 each), as a ``RewardFn`` scoring within ``limit_s``."""
    if weights and len(set(names)) < len(names):  # a mapping would keep one of them
        raise ScorerError(f"reward: expected scorer names, each once, got {list(names)!r}")
    value: Any = dict(zip(names, weights, strict=True)) if weights else list(names)
    parsed = Reward.parse(value, "reward")
    fn = parsed.function(limit_s)
    fn.reads_answer = tuple(s.spec for s in parsed.scorers if reads_answer(s))  # type: ignore[attr-defined]
    return fn


def reads_answer(scorer: Scorer) -> bool:
    """Whether ``scorer`` compares a completion with the row's answer (``chosen``)."""
    if scorer.kind == "regex":  # only a group is compared with it
        return re.compile(scorer.arg).groups > 0
    return scorer.kind in ("exact", "contains", "task")


def trained_scorers(loss: LossSettings) -> tuple[Scorer, ...]:
    """The scorers ``loss`` learns from (a GRPO run's ``reward``, or a pair loss's with
    pairs online; fixed pairs': none)."""
    reward = getattr(loss, "reward", ()) if samples_now(loss) else ()
    return Reward.parse(list(reward)).scorers if reward else ()


def reward_code(loss: LossSettings) -> list[str]:
    """The digest of each ``python:`` scorer's module ``loss`` learns from (a trial's cache
    key: an edited verifier trains again, as an edited scorer scores again)."""
    return scorer_code(trained_scorers(loss))


def reward_sources(loss: LossSettings) -> dict[str, str]:
    """What a node needs to import each ``python:`` scorer ``loss`` learns from, by module
    name: a top-level module's file, or its top package's folder (its siblings with it), as
    this process imported it; sent to a trial's node by content (tasks/nodes/trial_inputs.py)."""
    sources = {}
    for scorer in trained_scorers(loss):
        if scorer.kind != "python":
            continue
        module = scorer.arg.partition(":")[0]
        top = sys.modules[module.split(".")[0]]  # imported when the reward was read
        where = getattr(top, "__file__", None) or next(iter(getattr(top, "__path__", [])))
        path = Path(where)
        sources[module] = str(path.parent if path.name == "__init__.py" else path)
    return sources
