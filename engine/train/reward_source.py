"""The reward a loss that samples trains on (GRPO; a pair loss's online pairs), as the engine
takes it: a callable (``RewardFn``)
from completions to rewards, the way mlx-lm's trainer takes its loss. The engine imports no
scorer: the reward named in a run's settings (``reward``, ``reward_weights``) is built by
the resolver installed under the entry-point group ``pomona.rewards`` (Pomona's own
scorers, tasks/eval/rewards.py, declared in pyproject.toml), so ``python -m engine train``
and ``pomona train`` read ``--reward`` the same way, with no Prefect and no Ray."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from engine.data.prompts import PromptRow
from engine.losses.sampled import Sampled

# (prompts, completions, rows) -> (each completion's reward, each scorer's mean by metric).
# A resolver may mark its function with ``reads_answer``, the names of its scorers that
# read a row's answer: the trainer then refuses prompts without one before step 1.
RewardFn = Callable[[list[str], list[str], list[dict[str, Any]]],
                    tuple[list[float], dict[str, float]]]
GROUP = "pomona.rewards"
PRECHECK_ROWS = 8  # rows the reward is tried on before step 1, each answer as its completion
EXAMPLE = "--reward task:parity (a synthetic task's verifier), contains, or python:mod:fn"


def load_reward(loss: Sampled) -> RewardFn:
    """``loss``'s reward, built by the installed resolver; ValueError (one line) when none
    is named, none is installed, or the resolver refuses it (a scorer that cannot be
    imported, a bad weight)."""
    if not loss.reward:
        raise ValueError(f"loss {loss.kind} learns from a reward: give one ({EXAMPLE})")
    found = sorted(entry_points(group=GROUP), key=lambda e: e.name)
    if not found:
        raise ValueError(f"reward {list(loss.reward)}: no reward resolver is installed "
                         f"(entry-point group {GROUP}; `pip install -e .` installs Pomona's)")
    resolve = found[0].load()
    return resolve(loss.reward, loss.reward_weights or None, loss.score_timeout_s)


def precheck(reward: RewardFn, train: list[PromptRow]) -> None:
    """Before step 1: a reward that reads the answer refused where a train prompt has none
    (every completion would score alike: no signal), then the reward tried on the first
    rows, each answer as its completion: a scorer that fails on this data stops the run
    now, in one line naming it and the row."""
    reads = getattr(reward, "reads_answer", ())
    if reads and (empty := [r for r in train if not r.answer]):
        raise ValueError(f"{len(empty)} of {len(train)} train prompts have no answer (first: "
                         f"id {empty[0].id!r}), and reward {reads[0]} reads it; give each row "
                         "an answer, or a python: reward that needs none")
    rows = train[:PRECHECK_ROWS]
    rewards, _ = reward([r.prompt_text for r in rows], [r.answer for r in rows],
                        [r.row() for r in rows])
    if len(rewards) != len(rows):
        raise ValueError(f"reward: {len(rewards)} rewards for {len(rows)} completions")
