"""Probes of a pack: what one step of the pack of k trials costs (peak memory, time), for
k = 1, 2, ... of the trials given, the way ``engine/train/probe.py`` measures one trial.

A sweep's ``pack: auto`` takes the largest k whose peak stays within its memory budget.
Each pack is set up as ``train_pack`` sets it up (engine/train/prepared.py ``prepare_pack``)
and steps as it trains (engine/train/pack_steps.py), every check on, under the trials'
``memory_limit_gb`` as their pack will train (MLX's limit is soft: past it, evaluation
waits for memory to free, and a pack whose live set is larger goes over it anyway).
Memory grows with k (each adapter's copy of the batch's activations), so the probe goes up
from one and stops at the first pack over the budget: a pack far past the machine's memory
is never loaded.

    rows = probe_packs(cfgs, budget_gb=9.3)   # [{"pack": 1, "peak_gb": 7.1, ...}, ...]
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from engine.settings.config import TrainConfig

# Trials a probe packs at most: 8 adapters' copies of a batch are 8 batches' activations,
# past the sizes the packs measured so far paid at (docs/performance.md, "Packed trials").
PACK_AUTO_MAX = 8


def probe_packs(cfgs: Sequence[TrainConfig], budget_gb: float = 0.0,
                batches: str | int = "worst") -> list[dict[str, Any]]:
    """One row per pack size k (the first k of ``cfgs``, which must train as one pack):
    ``pack``, peak_gb, step_s and tokens (the batch's, which each adapter trains on); or
    ``error`` where that pack failed (out of memory). Ascending, it stops after the first
    pack whose peak passes ``budget_gb`` (> 0) or that failed."""
    from engine.train.pack_trainer import refuse_unpacked
    from engine.train.run_parts import memory_limit

    cfgs = list(cfgs)
    refuse_unpacked(cfgs)
    rows: list[dict[str, Any]] = []
    for k in range(1, len(cfgs) + 1):
        try:
            with memory_limit(cfgs[0].memory_limit_gb):  # as train_pack runs the pack
                rows.append({"pack": k, **_measure_pack(cfgs[:k], batches)})
        except Exception as err:  # one size failing (out of memory) is its row, and the last
            rows.append({"pack": k, "error": f"{type(err).__name__}: {err}"[:300]})
            return rows
        finally:  # the pack's model and buffers go before the next one loads
            gc.collect()
            mx.clear_cache()
        if budget_gb > 0 and rows[-1]["peak_gb"] > budget_gb:
            return rows
    return rows


def largest_pack(rows: list[dict[str, Any]], budget_gb: float) -> int:
    """The largest k below the first pack whose probed peak passed ``budget_gb`` (or that
    failed): a larger pack that measured under it holds more all the same. 0 where a pack
    of one went over it too."""
    fitting = 0
    for r in rows:
        if "peak_gb" not in r or r["peak_gb"] > budget_gb:
            break
        fitting = r["pack"]
    return fitting


def _measure_pack(cfgs: list[TrainConfig], batches: str | int) -> dict[str, Any]:
    """Peak and speed of one pass over the probe's micro-batches by the pack of ``cfgs``
    (the trainer's own steps: gradients, each adapter's clip + AdamW update and optimizer
    state, the finite check), after one warm-up pass that the peak and time leave out."""
    from engine.backward.update import make_adapter_update, make_optimizer
    from engine.forward.layout_policy import choose_layout, resolve_pad_multiple
    from engine.forward.prefix import pair_batch
    from engine.train.pack_steps import PackStepper
    from engine.train.prepared import prepare_pack
    from engine.train.probe import after_warmup, probe_batches

    prepared = prepare_pack(cfgs)
    model, stack, cfg = prepared[0].model, prepared[0].stack, cfgs[0]
    pad = resolve_pad_multiple(cfg.pad_multiple)
    layouts = [choose_layout(pairs, cfg, pad, prepared[0].pad_id)
               for pairs in probe_batches(cfgs, stack, batches)]
    live = list(range(len(cfgs)))
    updates = [make_adapter_update(model, functools.partial(live.index, i), make_optimizer(c),
                                   c.grad_clip) for i, c in enumerate(cfgs)]
    stepper = PackStepper(model, stack, cfgs, updates, live)
    order = iter([layouts[0], *layouts])  # the first again: the warm-up
    peak_gb, seconds = after_warmup(stepper.steps(lambda: [next(order)], 0, len(layouts)))
    tokens = sum(pair_batch(b).tokens for b in layouts)
    return {"peak_gb": peak_gb, "step_s": seconds / len(layouts), "tokens": tokens}
