"""GRPO's training loop (Shao et al. 2024, as TRL's GRPOTrainer): each cycle samples G
completions of each prompt from the policy as it trains, rewards them with the run's
verifier and updates the LoRA on the loss family's objective (engine/train/group_steps.py).

    python -m engine train --loss grpo --reward task:parity --num-generations 4 ...

``batch_size`` counts prompts (G rows each), ``grad_accum`` micro-batches a step; one
cycle of rollouts serves μ = ``grpo_num_iterations`` steps. The run's output folder,
optimizer, checkpoints, resume and adapter are every recipe's (engine/train/run_parts.py).
metrics.jsonl carries TRL's names (``reward``, ``reward_std``, ``rewards/<label>/mean``,
``frac_reward_zero_std``, ``completions/mean_length``, ``completions/clipped_ratio``,
``kl``, ``clip_ratio/*``), the rollout's tokens/s and the update's; validation is the
valid prompts' greedy completions rewarded (``val/reward``: a run's best by default).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.backward.distributed import Ranks, init_ranks
from engine.backward.update import make_optimizer, make_update
from engine.data.prompts import PromptSet, prompts_for
from engine.forward.generation import greedy_batch
from engine.losses import validation_metrics
from engine.losses.grpo import Grpo
from engine.model.adapters import (
    load_adapter_weights,
    prepare_out,
    prune_checkpoints,
    save_checkpoint,
)
from engine.model.load import micro_seed, set_dropout_seed
from engine.settings.config import TrainConfig
from engine.train.group_backward import objective_for
from engine.train.group_reference import BASE_REFERENCE, KlReference, kl_reference
from engine.train.group_steps import (
    Sampler,
    group_update,
    mix_seed,
    prompt_batches,
    refuse_short,
    roll_out,
)
from engine.train.prepared import Prepared, prepare_training
from engine.train.resume import run_settings
from engine.train.reward_source import RewardFn, load_reward, precheck
from engine.train.run_books import Callback, better, emit, lora_blocks
from engine.train.run_parts import (
    TrainResult,
    claim_out,
    finish,
    fresh_result,
    memory_limit,
    resumed_step,
)

log = logging.getLogger(__name__)


@dataclass
class GroupRun:
    """A GRPO run set up: what ``finish`` (engine/train/run_parts.py) reads, and its reward."""

    cfg: TrainConfig
    loss: Grpo
    ranks: Ranks
    prepared: Prepared
    prompts: PromptSet
    reward: RewardFn
    reference: KlReference
    optimizer: Any
    update: Any
    start: int
    result: TrainResult
    started: float
    trained: int = 0  # prompts
    tokens: int = 0  # completion tokens updated on
    seconds: float = 0.0  # in updates

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)


def train_groups(cfg: TrainConfig, callbacks: Sequence[Callback] = ()) -> TrainResult:
    """Train one adapter with loss grpo as ``cfg`` says; write it to ``cfg.out``."""
    cfg.validate()
    with memory_limit(cfg.memory_limit_gb), ExitStack() as held:
        run = set_up(cfg, held)
        loop(run, callbacks)
        return finish(run)


def refuse_unsupported(cfg: TrainConfig, loss: Grpo) -> None:
    """What this loss cannot run yet, refused before any work, and levers it does not
    read, said."""
    if cfg.checkpoint_every % loss.grpo_num_iterations:
        raise ValueError(f"checkpoint_every={cfg.checkpoint_every} with grpo_num_iterations="
                         f"{loss.grpo_num_iterations}: a checkpoint must fall at a cycle's end "
                         "(a resume samples the next cycle afresh); give a multiple")
    if loss.grpo_beta == 0 and str(cfg.reference) != "base":
        log.warning("reference %s: not read with grpo_beta 0 (no KL term); give "
                    "--grpo-beta > 0 to pull the policy towards it", cfg.reference)
    unread = [n for n, default in (("prefix_attention", "auto"), ("pad_multiple", -1))
              if getattr(cfg, n) != default]  # the group layout is a block mask, unpadded
    if unread or cfg.verify:
        log.warning("%s: not read by loss grpo yet (its forward runs the plain rows or "
                    "the group layout's block mask, unpadded, and is not verified)",
                    ", ".join([*unread, *(["verify"] if cfg.verify else [])]))


def set_up(cfg: TrainConfig, held: ExitStack) -> GroupRun:
    """Everything before the first step, each refusal before any work: the reward (read
    first: a bad one costs no model load), the output folder, the model, the prompts, the
    reward tried on them, a checkpoint to resume."""
    started, loss = time.perf_counter(), cfg.loss
    assert isinstance(loss, Grpo)
    reward = load_reward(loss)
    refuse_unsupported(cfg, loss)
    ranks = init_ranks()
    if ranks.size > 1:
        raise ValueError(f"loss grpo trains in one process ({ranks.size} ranks given)")
    claim_out(cfg, held)
    prepared = prepare_training(cfg)
    if cfg.warm_start:
        load_adapter_weights(prepared.model, Path(cfg.warm_start))
    reference = (kl_reference(cfg.reference, prepared.model, cfg.model) if loss.grpo_beta > 0
                 else BASE_REFERENCE)
    prompts = group_prompts(cfg, loss, prepared)
    precheck(reward, prompts.train)
    best_of(cfg)  # a best_metric it never reports: refused now
    optimizer = make_optimizer(cfg)
    resumed = resumed_step(cfg, prepared.model, optimizer)
    prepare_out(Path(cfg.out), resumed)
    update = make_update(prepared.model, optimizer, cfg.grad_clip)
    result = fresh_result(cfg, resumed or 0, prepared, prompts.rejected, started)
    return GroupRun(cfg, loss, ranks, prepared, prompts, reward, reference, optimizer, update,
                    resumed or 0, result, started)


def group_prompts(cfg: TrainConfig, loss: Grpo, prepared: Prepared) -> PromptSet:
    """The run's prompts (a prompts dataset's, or a pair dataset's with its chosen
    responses the answers), refused without a train split or where a prompt and a whole
    completion pass the context, or fewer than a step's."""
    prompts = prompts_for(cfg.data, cfg.model, prepared.stack, prepared.tokenizer,
                          cfg.allow_tokenizer_mismatch)
    if not prompts.train:
        raise ValueError(f"{cfg.data}: no train prompts (every row is in valid or test)")
    refuse_short(prompts.train, cfg.batch_size * cfg.grad_accum)
    context = prepared.stack.context
    for row in [*prompts.train, *prompts.valid]:
        if context and len(row.prompt) + loss.max_completion_length > context:
            raise ValueError(f"{cfg.data}: prompt {row.id!r} ({len(row.prompt)} tokens) and "
                             f"max_completion_length={loss.max_completion_length} pass the "
                             f"model's context of {context} tokens")
    return prompts


def best_of(cfg: TrainConfig) -> tuple[str, str]:
    """The metric and mode a run's best evaluation is kept by: ``val/reward`` unless
    another was given (``val/loss`` is the pair losses' default); a reward's, the max.
    One this loss never reports is refused here, before any step, not at the end."""
    metric = "val/reward" if cfg.best_metric == TrainConfig.best_metric else cfg.best_metric
    reported = validation_metrics(cfg.loss_spec())
    if metric not in reported and not metric.startswith("val/rewards/"):
        raise ValueError(f"best_metric={metric!r}: loss {cfg.loss.kind} reports {reported} "
                         "and val/rewards/<scorer>/mean")
    return metric, "max" if metric.startswith("val/reward") else cfg.best_mode


def validate(run: GroupRun, step: int, callbacks: Sequence[Callback]) -> dict[str, Any]:
    """The valid prompts' greedy completions rewarded at ``step``: its record."""
    cfg, rows = run.cfg, run.prompts.valid
    if cfg.val_batches > 0:
        rows = rows[: cfg.val_batches * cfg.batch_size]
    model, tokenizer = run.prepared.model, run.prepared.tokenizer
    done = greedy_batch(model, tokenizer, [r.prompt for r in rows],
                        run.loss.max_completion_length, cfg.batch_size * run.loss.num_generations)
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in done.tokens]
    rewards, means = run.reward([r.prompt_text for r in rows], texts, [r.row() for r in rows])
    rec = {"step": step, "split": "valid", "val/reward": sum(rewards) / len(rewards),
           **{f"val/{k}": v for k, v in means.items()},
           "val/completions/mean_length": sum(map(len, done.tokens)) / len(rows),
           "val/rows": len(rows)}
    emit(rec, run.out, callbacks)
    return rec


def loop(run: GroupRun, callbacks: Sequence[Callback]) -> None:
    """Steps ``run.start + 1`` … ``cfg.steps``: a cycle of rollouts every μ steps, one
    update a step, a record every ``report_every``, validation and checkpoints as the
    pair trainer keeps them."""
    cfg, loss, model = run.cfg, run.loss, run.prepared.model
    mu, per_step = loss.grpo_num_iterations, cfg.batch_size * cfg.grad_accum
    batches = prompt_batches(run.prompts.train, per_step, cfg.seed, run.start // mu)
    objective = objective_for(model, run.prepared.stack, loss, cfg)
    sampler = Sampler(model, run.prepared.tokenizer, loss, run.reward, cfg.batch_size,
                      run.reference, cfg.head_chunk)
    settings = run_settings(cfg) if cfg.checkpoint_every else {}
    model.train()
    if run.prompts.valid and cfg.val_every and run.start == 0:
        validate(run, 0, callbacks)
    window: list[dict[str, float]] = []
    cycle = None
    mx.reset_peak_memory()
    for step in range(run.start + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        if cycle is None or (step - 1) % mu == 0:
            prompts = next(batches)
            cycle = roll_out(sampler, prompts, mix_seed(cfg.seed, step), run.prepared.pad_id,
                             run.prepared.stack, cfg.prefix_share)
            run.trained += len(prompts)
        t1 = time.perf_counter()
        value, metrics, norm = group_update(
            step, cycle, objective, loss, run.update,
            lambda micro, step=step: set_dropout_seed(model, micro_seed(cfg.seed, step, micro)))
        lr = float(run.optimizer.learning_rate)  # the rate this update used
        seconds = time.perf_counter() - t1
        run.tokens, run.seconds = run.tokens + cycle.tokens, run.seconds + seconds
        run.result.steps = step
        run.result.phases.setdefault("first_step", seconds)  # its update, as steps counts
        window.append({**cycle.metrics, **metrics, "loss": value, "grad_norm": norm,
                       "learning_rate": lr, "step_seconds": time.perf_counter() - t0,
                       "tokens_per_sec": cycle.tokens / max(seconds, 1e-9)})
        if step % cfg.report_every == 0 or step == cfg.steps:
            report(run, step, window, callbacks)
            window = []
        keep_books(run, step, settings, callbacks)


def report(run: GroupRun, step: int, window: list[dict[str, float]],
           callbacks: Sequence[Callback]) -> None:
    """The window's means as one train record."""
    keys = dict.fromkeys(k for w in window for k in w)
    rec: dict[str, Any] = {"step": step, "split": "train"}
    rec.update({k: sum(w[k] for w in window if k in w) / sum(k in w for w in window)
                for k in keys})
    rec["learning_rate"] = window[-1]["learning_rate"]
    rec["peak_memory_gb"] = mx.get_peak_memory() / 1e9
    run.result.final = rec
    run.result.peak_memory_gb = max(run.result.peak_memory_gb, rec["peak_memory_gb"])
    emit(rec, run.out, callbacks)
    mx.reset_peak_memory()


def keep_books(run: GroupRun, step: int, settings: dict[str, Any],
               callbacks: Sequence[Callback]) -> None:
    """After ``step``: validation where due (the best kept) and a checkpoint."""
    cfg, result = run.cfg, run.result
    if run.prompts.valid and ((cfg.val_every and step % cfg.val_every == 0)
                              or step == cfg.steps):
        rec = validate(run, step, callbacks)
        metric, mode = best_of(cfg)
        if better(rec, result.best_val, metric, mode):
            result.best_val = rec
    if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
        save_checkpoint(run.prepared.model, run.optimizer, run.out, step,
                        {"seed": cfg.seed, "settings": settings}, run.prepared.lora,
                        lora_blocks(run))
        prune_checkpoints(run.out, cfg.keep_checkpoints)
