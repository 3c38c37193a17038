"""Verifier-built pairs ("online pairs"): a pair loss (ORPO, SimPO, CPO, DPO) with ``pairs:
online`` and a ``reward`` builds each step's pairs from its own samples, online DPO from a
verifier (TRL's OnlineDPOTrainer and mlx-lm-lora's take a judge; here Pomona's scorers
judge, as they reward GRPO).

    python -m engine train --loss orpo --pairs online --reward task:parity --num-generations 4

Each step takes ``batch_size × grad_accum`` train prompts (the pair data's distinct
prompts, each first pair's chosen response the answer the verifier reads), samples G =
``num_generations`` completions of each from the policy as it trains (the prompt prefilled
once a group: engine/forward/rollouts.py) and rewards them. The best and the worst of a
group by reward, where they differ, become that prompt's chosen and rejected (the first
drawn of equals); a prompt whose G rewards tie gives none, and is counted. The step trains
on those pairs with the loss unchanged, through the pair trainer's own step
(engine/train/steps.py: the two-branch prefix-shared forward where ``prefix_share`` takes
it), ``batch_size`` pairs a micro-batch. A step whose every prompt tied draws another
batch of prompts, up to ``EXTRA_DRAWS`` times, then stops the run naming the step (a
collapsed policy or a verifier never met: no pair to learn from).

Each step's prompts and samples are a pure function of the seed and the step (a resume
samples what the run would have). DPO's reference log-probs of each step's pairs are
taken as they are made, under its ``reference`` worn by the policy's own LoRA layers (the
base: LoRA off; an adapter: its LoRA tensors swapped in: engine/train/group_reference.py),
one forward-only pass with no second model held. Validation scores the data's valid pairs,
as fixed pairs do (DPO's against their reference, computed once as for fixed pairs).
Each record carries TRL's names for the samples (``reward``, ``reward_std``,
``rewards/<label>/mean``, ``frac_reward_zero_std``, ``completions/mean_length``) and
``online/pairs``, ``online/tied_prompts`` and ``online/extra_draws``, per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import numpy as np

from engine.data.batch import Pair
from engine.data.prompts import PromptRow, prompts_of_pairs
from engine.forward.layout_policy import scoring_layout
from engine.forward.rollouts import Rollouts
from engine.losses.group import group_advantages
from engine.losses.sampled import OnlinePairs
from engine.settings.config import TrainConfig
from engine.train.group_reference import kl_reference
from engine.train.group_steps import Sampler, completions, mix_seed, prompt_batches, rewarded
from engine.train.reference import REFERENCE_HEAD_CHUNK, reference_logps, resolved_reference
from engine.train.reward_source import load_reward, precheck
from engine.train.run_books import Callback
from engine.train.run_parts import Run, TrainResult, finish, memory_limit
from engine.train.trainer import loop, set_up

EXTRA_DRAWS = 3  # more batches of prompts a step draws while every prompt's rewards tie


class NoPairs(ValueError):
    """A step found no prompt whose samples' rewards differ: nothing to train on."""


def best_and_worst(prompts: list[PromptRow], rollouts: Rollouts, rewards: list[float],
                   g: int, step: int) -> list[Pair]:
    """Each prompt's pair, its best-rewarded completion chosen and its worst rejected
    (the first drawn of equals), each with the stop token it ended at; none where its G
    rewards tie."""
    tails, pairs = completions(rollouts), []
    for i, row in enumerate(prompts):
        r = rewards[i * g:(i + 1) * g]
        best, worst = int(np.argmax(r)), int(np.argmin(r))
        if r[best] > r[worst]:
            pairs.append(Pair(f"{row.id}@{step}", row.prompt, tails[i * g + best],
                              tails[i * g + worst]))
    return pairs


def sample_stats(rewards: list[float], g: int) -> dict[str, float]:
    """TRL's reward metrics of one draw (``reward``, ``reward_std``,
    ``frac_reward_zero_std``), as GRPO's records compute them (engine/losses/group.py)."""
    _, stats = group_advantages(mx.array(rewards, dtype=mx.float32), g)
    return {k: float(v) for k, v in stats.items()}


@dataclass
class OnlineSource:
    """Makes each step's micro-batches from the policy's samples (``__call__``, one step
    a call, in order from ``step``) and keeps their metrics until a record reads them."""

    sampler: Sampler
    prompts: list[PromptRow]
    batch_of: Callable[[list[Pair]], Any]
    per_step: int
    seed: int
    step: int  # the step the last call made
    referenced: Callable[[list[Pair]], list[Pair]] = list  # DPO's: each pair's reference
    order: Any = None
    window: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.order = prompt_batches(self.prompts, self.per_step, self.seed, self.step)

    def __call__(self) -> list:
        self.step += 1
        pairs = self.pairs_of(self.step)
        size = self.sampler.batch_size
        return [self.batch_of(pairs[i:i + size]) for i in range(0, len(pairs), size)]

    def pairs_of(self, step: int) -> list[Pair]:
        """Step ``step``'s pairs: its batch of prompts sampled, then further draws (a pure
        function of the seed, the step and the draw) while every prompt ties."""
        g, prompts = self.sampler.loss.num_generations, next(self.order)
        tied = 0
        for draw in range(EXTRA_DRAWS + 1):
            if draw:
                rng = np.random.default_rng([self.seed, step, draw])
                prompts = [self.prompts[i] for i in
                           rng.choice(len(self.prompts), self.per_step, replace=False)]
            seed = mix_seed(self.seed, step)
            rollouts, rewards, means = rewarded(self.sampler, prompts,
                                                mix_seed(seed, draw) if draw else seed)
            pairs = best_and_worst(prompts, rollouts, rewards, g, step)
            tied += len(prompts) - len(pairs)
            if draw == 0:  # the policy's own figures: the first draw's
                metrics = {**sample_stats(rewards, g), **means,
                           "completions/mean_length": rollouts.mean_length,
                           "rollout_tokens_per_sec": rollouts.tokens_per_sec}
            if pairs:
                self.window.append({**metrics, "online/pairs": len(pairs),
                                    "online/tied_prompts": tied, "online/extra_draws": draw})
                return self.referenced(pairs)
        raise NoPairs(f"step {step}: every prompt's {g} samples were rewarded alike in "
                      f"{EXTRA_DRAWS + 1} draws of {self.per_step} prompts: no pair to train "
                      "on (a collapsed policy, or a verifier it never meets); try a higher "
                      "temperature, more num_generations, a lower learning rate or a warm "
                      "start")

    def report(self) -> dict[str, float]:
        """The means of the steps since the last record (then forgotten)."""
        window, self.window = self.window, []
        keys = dict.fromkeys(k for w in window for k in w)
        return {k: sum(w[k] for w in window if k in w) / sum(k in w for w in window)
                for k in keys}


def train_online(cfg: TrainConfig, callbacks: Sequence[Callback] = ()) -> TrainResult:
    """Train one adapter on pairs it builds from its own samples (module docstring)."""
    cfg.validate()
    loss = cfg.loss
    assert isinstance(loss, OnlinePairs) and loss.online
    reward = load_reward(loss)  # a bad reward costs no model load
    with memory_limit(cfg.memory_limit_gb), ExitStack() as held:
        run = set_up(cfg, held)
        source = online_source(run, reward)
        loop(run, run.stepper.loss, source, callbacks, online=source)
        return finish(run)


def online_source(run: Run, reward: Any) -> OnlineSource:
    """The run's sampler of pairs, its reward tried on the train prompts first (a scorer
    that fails on this data stops the run before step 1); one process only."""
    cfg, prepared = run.cfg, run.prepared
    if run.ranks.size > 1:
        raise ValueError(f"pairs: online trains in one process ({run.ranks.size} ranks given)")
    prompts = prompts_of_pairs(run.data, prepared.tokenizer).train
    per_step = cfg.batch_size * cfg.grad_accum
    if len(prompts) < per_step:
        raise ValueError(f"{cfg.data}: {len(prompts)} distinct train prompts, fewer than one "
                         f"step's {per_step} (batch_size × grad_accum) with pairs: online")
    context, longest = prepared.stack.context, max(len(r.prompt) for r in prompts)
    if context and longest + cfg.loss.max_completion_length > context:
        raise ValueError(f"{cfg.data}: a prompt of {longest} tokens and max_completion_length="
                         f"{cfg.loss.max_completion_length} pass the model's context of "
                         f"{context} tokens")
    precheck(reward, prompts)
    sampler = Sampler(prepared.model, prepared.tokenizer, cfg.loss, reward, cfg.batch_size)
    return OnlineSource(sampler, prompts, run.batch_of, per_step, cfg.seed, run.start,
                        reference_pass(run) if cfg.loss.needs_reference else list)


def reference_pass(run: Run) -> Callable[[list[Pair]], list[Pair]]:
    """``pairs`` given their reference's summed response log-probs (DPO's), taken under
    the run's reference worn by the policy (read and checked once, here)."""
    cfg, model, stack = run.cfg, run.prepared.model, run.prepared.stack
    reference = kl_reference(resolved_reference(cfg.reference), model, cfg.model)
    layout = scoring_layout(cfg.prefix_share, run.prepared.pad_id, "full")

    def referenced(pairs: list[Pair]) -> list[Pair]:
        with reference.worn(model):
            refs = reference_logps(model, stack, pairs, layout, cfg.batch_size,
                                   cfg.head_chunk or REFERENCE_HEAD_CHUNK)
        return [replace(p, ref=refs[p.id]) for p in pairs]

    return referenced
