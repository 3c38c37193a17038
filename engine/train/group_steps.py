"""GRPO's step on the plain forward: a batch of rollouts made into what the update reads
(``Cycle``), and one optimizer update on it (``group_update``).

A cycle is one step's prompts (``batch_size`` × ``grad_accum``), G completions each,
sampled from the policy (engine/forward/rollouts.py), rewarded (``RewardFn``) and turned into
group advantages (engine/losses/group.py); it serves μ = ``grpo_num_iterations`` updates,
their ratio taken against the log-probs it was sampled under. Each row is
``[prompt | completion]``, right-padded (causal attention: a pad after the row changes
nothing before it), the completion mask 1 on its tokens and on the stop token it ended at
(TRL's: the policy learns to end). The update is ``nn.value_and_grad`` over every row
whole (the plain forward), or over one row a group, ``[prompt | c1 | … | cG]``, the prompt
computed once (the group-shared forward: engine/forward/group_layout.py), its hidden
states gathered back into the plain rows: the head and the loss read the same arrays.
The sampling and reference log-probs (no gradient: ``detached_logps``) run the head on the
completion tokens alone, ``head_chunk`` of them at a time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from engine.data.prompts import PromptRow
from engine.forward.group_layout import GroupLayout, group_layout, shares_group
from engine.forward.prefix_patch import layout_masks
from engine.forward.rollouts import Rollouts, sample_groups
from engine.losses.group import GroupLogps, group_advantages
from engine.losses.grpo import Grpo
from engine.model.arch.stack import Stack
from engine.model.head import token_logps
from engine.train.group_reference import BASE_REFERENCE, KlReference
from engine.train.reward_source import RewardFn
from engine.train.steps import NonFiniteLoss


@dataclass(frozen=True)
class GroupBatch:
    """One micro-batch of rollouts: rows [N, L] right-padded, the row position predicting
    each completion token [N, C] and their mask [N, C], advantages [N], and the sampling
    and reference log-probs [N, C] (None: μ = 1; β = 0)."""

    ids: mx.array
    at: mx.array
    mask: mx.array
    advantages: mx.array
    old: mx.array | None = None
    ref: mx.array | None = None
    layout: GroupLayout | None = None  # the group-shared forward's; None: the plain one


@dataclass
class Cycle:
    """One step's rollouts ready to update on: their micro-batches, the completion tokens
    of all of them (DAPO's normaliser) and the rollout's metrics (TRL's names)."""

    batches: list[GroupBatch]
    tokens: int
    metrics: dict[str, float] = field(default_factory=dict)


def predictors(batch: GroupBatch) -> np.ndarray:
    """[N, C]: each completion token's predicting position, a flat index into the
    forward's hidden states (the rows' ``[N, L − 1]``, or the group layout's)."""
    at = np.array(batch.at)
    if batch.layout is not None:
        return np.take_along_axis(batch.layout.gather, at, axis=1)
    width = batch.ids.shape[1] - 1  # the rows' inputs: every token but the last
    return np.arange(at.shape[0])[:, None] * width + at


def completion_logps(model: nn.Module, stack: Stack, batch: GroupBatch, temperature: float
                     ) -> mx.array:
    """Each completion token's log-prob [N, C] (``batch.at``) under the policy the rollouts
    were sampled from, its logits at ``temperature`` (TRL's): the plain forward over the
    rows, or the group-shared one gathered into them."""
    targets = mx.take_along_axis(batch.ids, batch.at + 1, axis=1)
    if batch.layout is None:  # the model's own call, every position's logits
        logits = mx.take_along_axis(model(batch.ids[:, :-1]), batch.at[..., None], axis=1)
    else:  # the completions' positions alone through the head
        with layout_masks(model, batch.layout) as masks:
            h = stack.hidden(mx.array(batch.layout.inputs), masks)
        logits = stack.head(h.reshape(-1, h.shape[-1])[mx.array(predictors(batch))])
    return token_logps(logits / temperature if temperature != 1 else logits, targets)


def detached_logps(model: nn.Module, stack: Stack, batch: GroupBatch, temperature: float,
                   head_chunk: int = 0) -> mx.array:
    """``completion_logps`` with no gradient (the sampling and reference passes), the head
    on the completion tokens alone, ``head_chunk`` of them at a time (0: all at once): the
    rows' [N, L − 1, V] logits never exist, only [N·C, V] or [head_chunk, V]."""
    targets = mx.take_along_axis(batch.ids, batch.at + 1, axis=1).reshape(-1)
    where = mx.array(predictors(batch).reshape(-1).astype(np.int32))
    if batch.layout is None:
        h = stack.hidden(batch.ids[:, :-1])
        picked = h.reshape(-1, h.shape[-1])[where]
    else:
        with layout_masks(model, batch.layout) as masks:
            h = stack.hidden(mx.array(batch.layout.inputs), masks)
            picked = h.reshape(-1, h.shape[-1])[where]
            mx.eval(picked)  # under the layout's ropes and masks
    del h  # the last hidden state of every position goes once the completions' are taken
    step, pieces = (head_chunk if head_chunk > 0 else targets.size), []
    for s in range(0, targets.size, step):
        logits = stack.head(picked[s : s + step])
        pieces.append(token_logps(logits / temperature if temperature != 1 else logits,
                                  targets[s : s + step]))
        mx.eval(pieces[-1])  # one chunk's logits alive at a time
    return mx.concatenate(pieces).reshape(batch.at.shape)


def group_rows(prompts: Sequence[PromptRow], rollouts: Rollouts, g: int, pad_id: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``[prompt | completion (+ its stop token)]`` [N, L]; for each completion token
    j, the row position that predicts it [N, C] (token t + 1 is predicted at t; C the
    longest completion) and the mask of real tokens [N, C]: the head runs on those
    positions alone."""
    rows, spans = [], []
    for i, completion in enumerate(completions(rollouts)):
        prompt = list(prompts[i // g].prompt)
        rows.append(prompt + completion)
        spans.append((len(prompt), len(completion)))
    width, longest = max(len(r) for r in rows), max(c for _, c in spans)
    ids = np.full((len(rows), width), pad_id, dtype=np.int32)
    at = np.zeros((len(rows), longest), dtype=np.int32)
    mask = np.zeros((len(rows), longest), dtype=np.float32)
    for i, (row, (p, c)) in enumerate(zip(rows, spans, strict=True)):
        ids[i, : len(row)] = row
        at[i, :c] = p - 1 + np.arange(c)
        mask[i, :c] = 1.0
    return ids, at, mask


@dataclass(frozen=True)
class Sampler:
    """What draws and rewards a step's rollouts: the policy as it trains, its tokenizer,
    the loss (G and the rollout settings), the reward, the prompts a micro-batch and the
    KL's reference."""

    model: nn.Module
    tokenizer: Any
    loss: Grpo
    reward: RewardFn
    batch_size: int
    reference: KlReference = BASE_REFERENCE  # β > 0: what the KL is taken against
    head_chunk: int = 0  # the sampling and reference passes' head: so many tokens at a time


def rewarded(sampler: Sampler, prompts: list[PromptRow], seed: int
             ) -> tuple[Rollouts, list[float], dict[str, float]]:
    """``prompts`` sampled G times each from ``seed`` and rewarded: the rollouts, each
    completion's reward and each scorer's mean."""
    rollouts = sample_groups(sampler.model, sampler.tokenizer, [p.prompt for p in prompts],
                             sampler.loss.rollout(seed),
                             sampler.batch_size * sampler.loss.num_generations)
    return rewarded_as_drawn(sampler, prompts, rollouts)


def rewarded_as_drawn(sampler: Sampler, prompts: list[PromptRow], rollouts: Rollouts
                      ) -> tuple[Rollouts, list[float], dict[str, float]]:
    """``rollouts`` of ``prompts`` (G a prompt) rewarded: the rollouts, each completion's
    reward and each scorer's mean."""
    g, tokenizer = sampler.loss.num_generations, sampler.tokenizer
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in rollouts.tokens]
    rows = [p for p in prompts for _ in range(g)]
    rewards, means = sampler.reward([p.prompt_text for p in rows], texts,
                                    [p.row() for p in rows])
    return rollouts, [float(r) for r in rewards], means


def flat_groups(rewards: list[float], g: int) -> list[int]:
    """The groups whose G rewards are equal (no advantage: no signal)."""
    return [i for i in range(len(rewards) // g) if len(set(rewards[i * g:(i + 1) * g])) == 1]


def resample_flat(sampler: Sampler, prompts: list[PromptRow], seed: int,
                  drawn: tuple[Rollouts, list[float]]) -> tuple[Rollouts, list[float], int]:
    """DAPO's dynamic sampling (Yu et al. 2025, §3.2): each group whose rewards are all
    equal sampled again, up to ``grpo_max_resample_rounds`` rounds, a new group kept where
    its rewards differ. (rollouts, rewards, groups replaced)."""
    g, (rollouts, rewards) = sampler.loss.num_generations, drawn
    tokens, stops, rewards = list(rollouts.tokens), list(rollouts.stop_tokens), list(rewards)
    generated, seconds, replaced = rollouts.generated, rollouts.seconds, 0
    for round_ in range(1, sampler.loss.grpo_max_resample_rounds + 1):
        flat = flat_groups(rewards, g)
        if not flat:
            break
        again, again_rewards, _ = rewarded(sampler, [prompts[i] for i in flat],
                                           mix_seed(seed, round_))
        generated, seconds = generated + again.generated, seconds + again.seconds
        for j, i in enumerate(flat):
            new = slice(j * g, (j + 1) * g)
            if len(set(again_rewards[new])) > 1:
                old = slice(i * g, (i + 1) * g)
                tokens[old], stops[old] = again.tokens[new], again.stop_tokens[new]
                rewards[old], replaced = again_rewards[new], replaced + 1
    return Rollouts(tokens, stops, generated, seconds), rewards, replaced


def drawn_groups(sampler: Sampler, prompts: list[PromptRow], seed: int
                 ) -> tuple[Rollouts, list[float], dict[str, float]]:
    """``prompts`` sampled G times each and rewarded, flat groups sampled again under
    dapo: (rollouts, rewards, metrics). The reward metrics are the first draw's: the
    policy's own, whatever resampling then kept."""
    loss, started = sampler.loss, time.perf_counter()
    rollouts, first, means = rewarded(sampler, prompts, seed)
    _, stats = group_advantages(mx.array(first, dtype=mx.float32), loss.num_generations,
                                loss.grpo_scale_rewards)
    metrics = {k: float(v) for k, v in stats.items()} | means | {
        "completions/mean_length": rollouts.mean_length,
        "completions/clipped_ratio": rollouts.clipped_ratio,
        "rollout_tokens_per_sec": rollouts.tokens_per_sec}
    rewards = first
    if loss.grpo_loss_type == "dapo" and loss.grpo_max_resample_rounds:
        rollouts, rewards, replaced = resample_flat(sampler, prompts, seed, (rollouts, first))
        metrics["dynamic_sampling/replaced_groups"] = replaced
    metrics["rollout_seconds"] = time.perf_counter() - started
    return rollouts, rewards, metrics


def roll_out(sampler: Sampler, prompts: list[PromptRow], seed: int, pad_id: int,
             stack: Stack, prefix_share: str = "off") -> Cycle:
    """``prompts`` drawn and rewarded (``drawn_groups``) and batched, ``batch_size``
    prompts a micro-batch; their sampling log-probs kept where μ > 1, the base's where
    β > 0; each micro-batch laid out for the group-shared forward where ``prefix_share``
    says (``shares_group``; it reads ``stack``)."""
    return cycle_of(sampler, prompts, drawn_groups(sampler, prompts, seed), pad_id, stack,
                    prefix_share)


def cycle_of(sampler: Sampler, prompts: list[PromptRow],
             drawn: tuple[Rollouts, list[float], dict[str, float]], pad_id: int, stack: Stack,
             prefix_share: str = "off") -> Cycle:
    """``drawn`` (rollouts of ``prompts``, their rewards and metrics) made into a cycle:
    ``batch_size`` prompts a micro-batch, laid out and given the log-probs its loss reads
    besides the policy's (``reference_parts``)."""
    loss, g, size = sampler.loss, sampler.loss.num_generations, sampler.batch_size
    rollouts, rewards, metrics = drawn
    advantages, _ = group_advantages(mx.array(rewards, dtype=mx.float32), g,
                                     loss.grpo_scale_rewards)
    ids, at, mask = group_rows(prompts, rollouts, g, pad_id)
    batches = []
    for start in range(0, len(prompts) * g, size * g):
        part = slice(start, start + size * g)
        own = [p.prompt for p in prompts[start // g:(start + size * g) // g]]
        tails = completions(rollouts)[part]
        share = shares_group([len(p) for p in own], [len(c) for c in tails], prefix_share)
        layout = group_layout(own, tails, pad_id) if share else None
        batches.append(reference_parts(sampler, stack, GroupBatch(
            mx.array(ids[part]), mx.array(at[part]), mx.array(mask[part]), advantages[part],
            layout=layout)))
    metrics["prefix_share_rate"] = sum(b.layout is not None for b in batches) / len(batches)
    return Cycle(batches, int(mask.sum()), metrics)


def completions(rollouts: Rollouts) -> list[list[int]]:
    """Each completion's tokens with the stop token it ended at (what the mask holds)."""
    return [t + ([s] if s is not None else []) for t, s in
            zip(rollouts.tokens, rollouts.stop_tokens, strict=True)]


def reference_parts(sampler: Sampler, stack: Stack, batch: GroupBatch
                    ) -> GroupBatch:
    """``batch`` with the log-probs its loss reads besides the policy's: those it was
    sampled under (μ > 1: the ratio's denominator, fixed for the cycle) and the
    reference's (β > 0: the KL's, ``sampler.reference``), computed once, detached."""
    model, loss, old, ref = sampler.model, sampler.loss, None, None
    chunk = sampler.head_chunk
    if loss.grpo_num_iterations > 1:
        old = detached_logps(model, stack, batch, loss.temperature, chunk)
    if loss.grpo_beta > 0:
        with sampler.reference.worn(model):
            ref = detached_logps(model, stack, batch, loss.temperature, chunk)
    mx.eval([a for a in (old, ref) if a is not None])
    return dataclasses.replace(batch, old=old, ref=ref)


def group_objective(model: nn.Module, stack: Stack, loss: Grpo) -> Callable[..., Any]:
    """``f(batch, batch_tokens, scale) → ((loss, metrics), grads)`` of the LoRA."""
    def objective(batch: GroupBatch, batch_tokens: float, scale: float
                  ) -> tuple[mx.array, dict[str, mx.array]]:
        logps = completion_logps(model, stack, batch, loss.temperature)
        terms = loss.group_terms(GroupLogps(logps, batch.mask, batch.advantages, batch.old,
                                            batch.ref),
                                 loss.max_completion_length, batch_tokens)
        return terms.loss * scale, terms.metrics

    return nn.value_and_grad(model, objective)


def group_update(step: int, cycle: Cycle, objective: Callable[..., Any], loss: Grpo,
                 update: Callable[[Any], mx.array],
                 reseed: Callable[[int], None] = lambda micro: None
                 ) -> tuple[float, dict[str, float], float]:
    """One optimizer update on ``cycle``: each micro-batch's gradient summed (DAPO's
    normaliser is the cycle's tokens; the other types' means over micro-batches), then the
    compiled clip + AdamW (engine/backward/update.py). (loss, metrics, grad norm); a
    non-finite loss or norm stops the run before the update is saved. ``reseed(i)`` runs
    before micro-batch i: its LoRA dropout masks, the pair trainer's (``micro_seed``)."""
    dapo = loss.grpo_loss_type == "dapo"
    scale = 1.0 if dapo else 1.0 / len(cycle.batches)
    total, value, sums = None, 0.0, {}
    for i, batch in enumerate(cycle.batches):
        reseed(i)
        (part, metrics), grads = objective(batch, float(cycle.tokens), scale)
        total = grads if total is None else tree_map(mx.add, total, grads)
        mx.eval(part, metrics, total)
        value += float(part)
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v) / len(cycle.batches)
    norm = float(update(dict(tree_flatten(total))))
    for name, x in (("loss", value), ("grad norm", norm)):
        if not np.isfinite(x):
            raise NonFiniteLoss(f"step {step}: {name} {x} on GRPO rollouts")
    return value, sums, norm


def prompt_batches(rows: list[PromptRow], size: int, seed: int, start: int = 0
                   ) -> Iterator[list[PromptRow]]:
    """Endless batches of ``size`` prompts, each epoch in its own order (a pure function of
    the seed and the epoch: a resume needs no saved state), from the ``start``-th on. An
    epoch's tail short of ``size`` is left out, as TRL's sampler leaves it: a short step
    would weigh its few prompts as a whole batch."""
    refuse_short(rows, size)
    epoch, index = 0, 0
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(len(rows))
        for s in range(0, len(order) - size + 1, size):
            if index >= start:
                yield [rows[i] for i in order[s : s + size]]
            index += 1
        epoch += 1


def refuse_short(rows: list[PromptRow], size: int) -> None:
    """Fewer train prompts than one step's ``size`` refused in one line."""
    if len(rows) < size:
        raise ValueError(f"{len(rows)} train prompts, fewer than one step's {size} "
                         "(batch_size × grad_accum): lower them, or give more prompts")


def mix_seed(seed: int, step: int) -> int:
    """A seed of its own for ``step`` (a step's rollouts, a resampling round's) from
    ``seed``: the two mixed."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0])
