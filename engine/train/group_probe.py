"""GRPO's probe: what one cycle costs at its worst, per engine setting, for loss grpo as
``probe_steps`` (engine/train/probe.py) measures a pair loss's step.

The worst cycle is a step's longest train prompts (``batch_size`` × ``grad_accum``), each
sampled G times to ``max_completion_length``: the run's own sampler (temperature,
``top_p``) with the stop tokens barred, so no completion ends early. Its two phases peak
apart and are measured apart:
- the rollout: the weights, the optimizer's state, the KV cache of ``batch_size`` × G rows
  (mlx-lm's decoder), the decode's logits, and the last cycle still held, as the trainer
  holds it while it samples the next;
- the update: the sampling and reference passes (μ > 1, β > 0) and the forward and
  backward (the plain rows or the group layout, segmented or not) of every micro-batch.
``peak_gb`` is the larger, the figure ``memory_limit_gb`` must hold. Completions are
rewarded by the run's own reward (its memory counts; their advantages do not change the
update's arrays). The KL is taken against the base (an adapter reference costs the same).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from engine.backward.update import make_optimizer, make_update
from engine.data.prompts import PromptRow
from engine.forward.generation import decode_groups, stop_ids
from engine.forward.rollouts import Rollouts, keyed_sampler
from engine.losses.grpo import Grpo
from engine.settings.config import TrainConfig
from engine.train.group_backward import objective_for
from engine.train.group_steps import (
    Cycle,
    Sampler,
    cycle_of,
    group_update,
    mix_seed,
    rewarded_as_drawn,
)
from engine.train.prepared import Prepared

GiB = 2**30


def probe_group_steps(cfg: TrainConfig, variants: list[dict[str, Any]], repeats: int = 1
                      ) -> list[dict[str, Any]]:
    """One row per variant (TrainConfig overrides): peak_gb (the larger of rollout_peak_gb
    and update_peak_gb), rollout_s, update_s, step_s, tokens (completion tokens a cycle),
    tokens_per_sec (the update's), shared_rate; or ``error`` when that setting failed."""
    from engine.train.grpo_trainer import group_prompts
    from engine.train.prepared import prepare_training
    from engine.train.reward_source import load_reward

    cfg.validate()
    assert isinstance(cfg.loss, Grpo)
    reward = load_reward(cfg.loss)  # a bad reward costs no model load
    prepared = prepare_training(cfg)
    train = group_prompts(cfg, cfg.loss, prepared).train
    worst = sorted(train, key=lambda r: len(r.prompt), reverse=True)
    worst = worst[: cfg.batch_size * cfg.grad_accum]
    rows = []
    for variant in variants:
        c = cfg.replace(**variant)
        try:
            c.validate()
            sampler = Sampler(prepared.model, prepared.tokenizer, c.loss, reward,
                              c.batch_size, head_chunk=c.head_chunk)
            with prepared.as_config(c):
                rows.append({**variant, **measured_cycles(prepared, sampler, worst, c,
                                                          repeats)})
        except Exception as err:  # one setting failing (e.g. out of memory) is its row
            rows.append({**variant, "error": f"{type(err).__name__}: {err}"[:300]})
    return rows


def longest_rollouts(sampler: Sampler, prompts: list[PromptRow], seed: int) -> Rollouts:
    """``prompts`` sampled G times each as the run samples them, every stop token barred:
    each completion runs to ``max_completion_length``."""
    loss, tokenizer = sampler.loss, sampler.tokenizer
    draw = keyed_sampler(loss.temperature, loss.top_p, seed)
    stops = mx.array(sorted(stop_ids(tokenizer)))

    def never_stop(logprobs: mx.array) -> mx.array:
        barred = mx.zeros((logprobs.shape[-1],), logprobs.dtype)
        barred[stops] = float("-inf")
        return draw(logprobs + barred)

    g = loss.num_generations
    groups = [[list(map(int, p.prompt))] * g for p in prompts]
    tokens, ends, generated, seconds = decode_groups(
        sampler.model, tokenizer, groups, loss.max_completion_length,
        sampler.batch_size * g, never_stop, least=1)
    return Rollouts(tokens, ends, generated, seconds)


def worst_cycle(sampler: Sampler, prompts: list[PromptRow], seed: int, prepared: Prepared,
                prefix_share: str) -> tuple[Cycle, float]:
    """The worst cycle of ``prompts`` (its rollouts longest, rewarded by the run's reward)
    and the rollout's peak in GiB (every array alive meanwhile, the caller's included);
    MLX's peak is reset after it, so the update's phase counts from its reference passes."""
    mx.reset_peak_memory()
    rollouts = longest_rollouts(sampler, prompts, seed)
    rollout_peak = mx.get_peak_memory() / GiB
    mx.reset_peak_memory()  # from here on: the update's phase
    drawn = rewarded_as_drawn(sampler, prompts, rollouts)
    return cycle_of(sampler, prompts, drawn, prepared.pad_id, prepared.stack,
                    prefix_share), rollout_peak


def measured_cycles(prepared: Prepared, sampler: Sampler, prompts: list[PromptRow],
                    c: TrainConfig, repeats: int) -> dict[str, Any]:
    """Peaks and times of ``repeats`` worst cycles under ``c`` (μ updates each), after one
    warm-up cycle (kernels, allocator, the update's compile) that both leave out."""
    loss = c.loss
    objective = objective_for(prepared.model, prepared.stack, loss, c)
    update = make_update(prepared.model, make_optimizer(c), c.grad_clip)
    peaks, seconds, cycle = {"rollout": 0.0, "update": 0.0}, {"rollout": 0.0, "update": 0.0}, None
    prepared.model.train()
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        cycle, rollout_peak = worst_cycle(sampler, prompts, mix_seed(c.seed, i), prepared,
                                          c.prefix_share)  # the last cycle held meanwhile
        t1 = time.perf_counter()
        for step in range(loss.grpo_num_iterations):
            group_update(step + 1, cycle, objective, loss, update)
        update_peak = mx.get_peak_memory() / GiB  # the reference passes and the updates
        if i:  # the first cycle warms up
            peaks = {"rollout": max(peaks["rollout"], rollout_peak),
                     "update": max(peaks["update"], update_peak)}
            seconds["rollout"] += (t1 - t0) / repeats
            seconds["update"] += (time.perf_counter() - t1) / repeats / loss.grpo_num_iterations
    assert cycle is not None
    mu = loss.grpo_num_iterations
    return {"peak_gb": max(peaks.values()), "rollout_peak_gb": peaks["rollout"],
            "update_peak_gb": peaks["update"], "rollout_s": seconds["rollout"],
            "update_s": seconds["update"], "step_s": seconds["rollout"] / mu + seconds["update"],
            "tokens": cycle.tokens, "tokens_per_sec": cycle.tokens / max(seconds["update"], 1e-9),
            "shared_rate": cycle.metrics["prefix_share_rate"]}
