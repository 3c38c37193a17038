"""Probes: what one training step costs (peak memory, time, tokens/s) per engine setting.

The sweep's ``segment_size: auto`` picks the largest segment size whose probed peak fits a
trial's memory budget, and its memory mode tabulates every (segment_size, head_chunk,
prefix_share) setting. A probe runs real steps of the configured model on real batches of
the dataset (loss grpo: its worst cycle of rollouts and update, engine/train/group_probe.py):
``batches="worst"`` takes the ``batch_size`` longest training pairs (the
micro-batch that sets a run's peak); an integer n takes the first n micro-batches of the
training order (the real length distribution). Run it in a fresh process per model: MLX's
peak is per process and weights count in it.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from engine.data.data_fit import load_pairs_for
from engine.data.pairs import micro_batches, pair_length
from engine.settings.config import TrainConfig
from engine.train.reference import kl_partners, with_partners


def placeholder_references(pairs: list, kl: bool) -> list:
    """``pairs`` with zero reference log-probs (and, with ``kl``, KL partners carrying
    zeros): the arrays a step reads, made without the reference's pass."""
    zeros = [dataclasses.replace(p, ref=(0.0, 0.0)) for p in pairs]
    if not kl:
        return zeros
    partners = {q.id: (0.0, 0.0) for q in kl_partners(zeros)}
    return with_partners(zeros, partners, "the probe's placeholders")


def probe_steps(cfg: TrainConfig, variants: list[dict[str, Any]],
                batches: str | int = "worst", repeats: int = 1) -> list[dict[str, Any]]:
    """One row per variant (TrainConfig overrides): peak_gb, step_s, tokens, tokens_per_sec,
    shared_rate; or ``error`` when that setting failed (out of memory, invalid). A group loss
    (grpo) measures its worst cycle instead, rollout and update (engine/train/group_probe.py):
    ``batches`` is a pair loss's."""
    from engine.train.prepared import prepare_training

    cfg.validate()
    if cfg.loss.on_groups:  # sampled groups, not pairs: its own cycle
        from engine.train.group_probe import probe_group_steps

        return probe_group_steps(cfg, variants, repeats)
    prepared = prepare_training(cfg)  # as the trainer sets it up: one function for both
    chosen = probe_batches([cfg], prepared.stack, batches)
    rows = []
    for variant in variants:
        try:
            rows.append({**variant, **_measure(prepared, chosen, cfg.replace(**variant),
                                               repeats)})
        except Exception as err:  # one setting failing (e.g. out of memory) is its row
            rows.append({**variant, "error": f"{type(err).__name__}: {err}"[:300]})
    return rows


def probe_batches(cfgs: list[TrainConfig], stack: Any, batches: str | int) -> list[list]:
    """The micro-batches a probe of ``cfgs`` (one trial, or a pack's) measures: the
    ``batch_size`` longest training pairs (``worst``), or the first ``batches`` of the
    training order; with zero reference log-probs where a loss reads them (a step's memory
    and time never read the values: no reference pass)."""
    cfg = cfgs[0]
    data = load_pairs_for(cfg.data, cfg.model, stack, cfg.allow_tokenizer_mismatch)
    if any(c.loss_spec().needs_reference for c in cfgs):
        data.train = placeholder_references(data.train, any(c.loss.needs_kl for c in cfgs))
    if batches == "worst":
        return [sorted(data.train, key=pair_length, reverse=True)[: cfg.batch_size]]
    stream = micro_batches(data.train, cfg.batch_size, cfg.seed)
    return [next(stream) for _ in range(int(batches))]


def _measure(prepared: Any, chosen: list, c: TrainConfig, repeats: int) -> dict[str, Any]:
    """Peak and speed of ``repeats`` passes over ``chosen`` micro-batches under ``c``, its
    levers set as training sets them (engine/train/prepared.py)."""
    c.validate()
    with prepared.as_config(c):
        return _measured(prepared.model, prepared.stack, chosen, c, prepared.pad_id, repeats)


def _measured(model, stack, chosen: list, c: TrainConfig, pad_id: int,
              repeats: int) -> dict[str, Any]:
    """The trainer's own steps (engine/train/steps.py: gradients, the clip + AdamW update
    and its optimizer state, the finite check) over ``chosen``, after one warm-up step
    (kernels, allocator, the update's compile) that the peak and the time leave out."""
    from engine.backward.distributed import SINGLE
    from engine.backward.update import make_optimizer, make_update
    from engine.forward.layout_policy import choose_layout, resolve_pad_multiple
    from engine.forward.prefix import PrefixBatch, pair_batch
    from engine.train.steps import Stepper

    pad = resolve_pad_multiple(c.pad_multiple)
    layouts = [choose_layout(pairs, c, pad, pad_id) for pairs in chosen]
    stepper = Stepper(model, stack, c.loss_spec(), c, SINGLE,
                      make_update(model, make_optimizer(c), c.grad_clip))
    order = iter([layouts[0], *layouts * repeats])
    steps = stepper.steps(lambda: [next(order)], 0, len(layouts) * repeats)
    peak_gb, seconds = after_warmup(steps)
    seconds /= repeats
    tokens = sum(pair_batch(b).tokens for b in layouts)
    return {"peak_gb": peak_gb, "step_s": seconds / len(layouts),
            "tokens": tokens, "tokens_per_sec": tokens / max(seconds, 1e-9),
            "shared_rate": sum(isinstance(b, PrefixBatch) for b in layouts) / len(layouts)}


def after_warmup(steps: Iterator[Any]) -> tuple[float, float]:
    """The peak (GiB) and seconds of ``steps`` after their first, the warm-up (kernels,
    allocator, the update's compile), which both leave out."""
    next(steps)
    mx.synchronize()  # the warm-up's queued work done: none of its buffers in the peak
    gc.collect()  # arrays an earlier run left in reference cycles: not this run's peak
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    for _ in steps:
        pass
    return mx.get_peak_memory() / 2**30, time.perf_counter() - t0


def largest_fitting(peaks: dict[int, float], budget_gb: float) -> int | None:
    """The largest segment size whose peak fits ``budget_gb`` (fewest segments: fastest),
    or None when none does. Size 0 (plain autograd) counts as the largest of all."""
    fitting = [k for k, peak in peaks.items() if peak <= budget_gb]
    if not fitting:
        return None
    return 0 if 0 in fitting else max(fitting)
