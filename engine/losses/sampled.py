"""The settings of a loss that samples its own completions and rewards them with a verifier:
GRPO's rollouts (engine/losses/grpo.py), and a pair loss's verifier-built pairs
(``pairs: online``: engine/train/online_pairs.py). TRL's GRPOConfig names, unprefixed
(``num_generations``, ``temperature``, ``top_p``, ``max_completion_length``, ``reward``,
``reward_weights``), declared once here and shared by each loss that reads them: a loss
that reads none refuses them, naming the losses that do.

A pair loss (``OnlinePairs``: ORPO, SimPO, CPO, DPO) reads them only with ``pairs: online``;
with its default, ``fixed``, its fields are those it always had (its config, cache keys
and checkpoints unchanged), and any of these given is refused in one line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from engine.losses.base import LossSettings, setting
from engine.losses.rollout_settings import RolloutSettings

PAIRS = ("fixed", "online")


@dataclass(frozen=True)
class Sampled(LossSettings):
    """How completions are sampled from the policy as it trains, and rewarded."""

    samples: ClassVar[bool] = True  # reads the fields below (OnlinePairs: with pairs online)

    num_generations: int = setting(8, "GRPO, online pairs: completions sampled per prompt, "
                                      "one group (TRL's num_generations).", minimum=2)
    temperature: float = setting(1.0, "GRPO, online pairs: the rollouts' sampling "
                                      "temperature.", above=0)
    top_p: float = setting(1.0, "GRPO, online pairs: the rollouts' nucleus (1: off).",
                           above=0, maximum=1)
    max_completion_length: int = setting(256, "GRPO, online pairs: tokens a completion may "
                                              "take; it is cut there (TRL's).", minimum=1)
    reward: tuple[str, ...] = setting((), "GRPO, online pairs: the verifier, Pomona's scorers "
                                          "(task:NAME, contains, exact, regex:P, "
                                          "python:mod:fn; docs/evaluation.md); several sum.",
                                      items=str)
    reward_weights: tuple[float, ...] = setting((), "GRPO, online pairs: each reward "
                                                    "scorer's weight, in order (TRL's "
                                                    "reward_weights; none: 1 each).",
                                                items=float)
    score_timeout_s: float = setting(300.0, "GRPO, online pairs: seconds one step's rewards "
                                            "may take in all (a scorer that hangs stops the "
                                            "run).", above=0)

    def check(self) -> None:
        # Weights without a reward: refused as no reward (a spec checks each key alone).
        if self.reward and self.reward_weights and len(self.reward_weights) != len(
                self.reward):
            raise ValueError(f"reward_weights={list(self.reward_weights)}: one weight per "
                             f"reward scorer ({len(self.reward)} given: "
                             f"{list(self.reward)})")

    def rollout(self, seed: int) -> RolloutSettings:
        """How this run's completions are sampled, from ``seed``."""
        return RolloutSettings(self.num_generations, self.temperature, self.top_p,
                               self.max_completion_length, seed)


SAMPLED_FIELDS = tuple(f.name for f in dataclasses.fields(Sampled))


@dataclass(frozen=True)
class OnlinePairs(Sampled):
    """A pair loss that may build its pairs from its own samples (``pairs: online``): the
    best and the worst of G completions of a prompt by reward, where they differ."""

    samples: ClassVar[bool] = False  # unless pairs is online (``samples_now``)

    pairs: str = setting("fixed", "A pair loss's pairs: fixed (the data's) or online (each "
                                  "step, the best and the worst of num_generations samples "
                                  "of each prompt by reward: online DPO from a verifier).",
                         choices=PAIRS)

    @property
    def online(self) -> bool:
        return self.pairs == "online"

    def check(self) -> None:
        super().check()
        if self.online:
            return
        moved = [n for n in SAMPLED_FIELDS
                 if getattr(self, n) != type(self).field(n).default]
        if moved:
            raise ValueError(f"{moved[0]}: read by loss grpo, or by loss {self.kind} with "
                             "pairs: online (this run's pairs are fixed); give --pairs online "
                             f"or drop {moved[0]}")

    def fields(self) -> dict[str, Any]:
        """Its fields, those of sampling only with pairs online (fixed: what it always
        recorded, so a fixed run's config, keys and checkpoints are unchanged)."""
        every = super().fields()
        if self.online:
            return every
        return {k: v for k, v in every.items() if k not in (*SAMPLED_FIELDS, "pairs")}


def samples_now(loss: LossSettings) -> bool:
    """Whether ``loss`` samples and rewards completions in this run (GRPO; a pair loss
    with pairs online)."""
    return getattr(loss, "samples", False) or bool(getattr(loss, "online", False))
