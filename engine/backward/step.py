"""One optimizer step's gradients: every micro-batch's loss, metrics and LoRA grads through
the configured path (engine/backward/segmented.py), normalised over the whole optimizer batch (so
4×1 equals 1×4) and, with several ranks, summed over all of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.backward.distributed import SINGLE, Ranks
from engine.backward.segmented import Grads, value_and_grad
from engine.data.batch import PairBatch, batch_norms
from engine.forward.prefix import PrefixBatch, pair_batch
from engine.forward.scoring import batch_kl, kl_point
from engine.losses import LossSpec, Norms, pair_loss
from engine.model.arch.stack import Stack
from engine.model.load import micro_seed, set_dropout_seed
from engine.settings.config import TrainConfig


@dataclass
class StepGrads:
    """One optimizer step's loss, metrics and grads, dispatched to the device but not yet
    read: the trainer queues the update behind them and then waits once (``read``)."""

    losses: list[mx.array]
    metrics: list[dict[str, mx.array]]
    grads: Grads
    counts: dict[str, float]  # micro_batches, shared_batches, tokens (host numbers)
    norms: Norms

    def read(self, ranks: Ranks = SINGLE) -> tuple[float, dict[str, float]]:
        """Summed loss and metric sums as host floats (with several ranks, every rank's)."""
        mx.eval(self.losses, self.metrics)
        total, sums = 0.0, {}
        for loss, metrics in zip(self.losses, self.metrics, strict=True):
            total += float(loss)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        sums.update(self.counts)
        sums["loss"] = total
        sums = ranks.sum_floats(sums)
        total = sums.pop("loss")
        sums["pairs"], sums["nll_tokens"] = self.norms.pairs, self.norms.nll_tokens
        return total, sums


@dataclass(frozen=True)
class Idle:
    """A rank's stand-in when the global micro-batch left it no pair (its last one holds
    fewer pairs than there are ranks): a real pair run through the same collectives at
    weight zero, so the other ranks' sums are exact and nobody waits forever."""

    batch: PairBatch | PrefixBatch
    ids: tuple[str, ...] = ()  # it trains no pair


def dispatch_grads(model: nn.Module, stack: Stack, micro: Sequence[PairBatch | PrefixBatch],
                   spec: LossSpec, cfg: TrainConfig, step: int, ranks: Ranks = SINGLE
                   ) -> StepGrads:
    """Loss, metrics and grads of one optimizer step's micro-batches (this rank's shards;
    with several ranks, normalised and summed over all of them), the last micro-batch's
    backward still running on return: nothing here waits for it."""
    live = [not isinstance(b, Idle) for b in micro]
    micro = [b.batch if isinstance(b, Idle) else b for b in micro]
    layouts = [pair_batch(b) for b in micro]
    counted = [pb for pb, on in zip(layouts, live, strict=True) if on]
    norms: Norms = ranks.sum_norms(batch_norms(counted) if counted else Norms(0.0, 0.0))
    kl = (step_kl(model, stack, layouts, live, cfg.head_chunk, ranks) if spec.needs_kl
          else None)
    losses, metric_list, grads = [], [], {}
    for i, (b, pb) in enumerate(zip(micro, layouts, strict=True)):
        if i:  # bound the accumulation: the earlier micro-batches finish first
            mx.eval(losses, metric_list, grads)
        set_dropout_seed(model, micro_seed(cfg.seed, step, i))
        resp, nll, ref = mx.array(pb.resp_mask), mx.array(pb.nll_mask), pb.ref_array()
        labels = pb.label_array()  # unpaired rows' (KTO), else None
        loss, metrics, g = value_and_grad(
            model, stack, b,
            lambda lp, r=resp, n=nll, f=ref, y=labels: pair_loss(
                lp, r, n, spec, norms, f, kl, y),
            cfg.segment_size, cfg.head_chunk, cfg.inflight)
        if not live[i]:  # weight zero: the collectives see this rank, its sums add nothing
            loss, g = loss * 0, {k: v * 0 for k, v in g.items()}
            metrics = {k: v * 0 for k, v in metrics.items()}
        grads = g if not grads else {k: grads[k] + g[k] for k in grads}
        losses.append(loss)
        metric_list.append(metrics)
    counts = {"micro_batches": sum(live),
              "shared_batches": sum(isinstance(b, PrefixBatch) and on
                                    for b, on in zip(micro, live, strict=True)),
              "tokens": sum(pb.tokens for pb in counted)}
    return StepGrads(losses, metric_list, ranks.sum_arrays(grads), counts, norms)


def step_kl(model: nn.Module, stack: Stack, layouts: Sequence[PairBatch], live: Sequence[bool],
            head_chunk: int, ranks: Ranks) -> mx.array:
    """KTO's KL reference point of one optimizer step: over every live micro-batch's KL
    partners on every rank, before any loss reads it (TRL takes each forward's batch; over
    the optimizer batch, 4×1 micro-batches still equal 1×4)."""
    total, rows = 0.0, 0
    for pb, on in zip(layouts, live, strict=True):
        if on:
            part, n = batch_kl(model, stack, pb, head_chunk)
            total, rows = total + part, rows + n
    sums = ranks.sum_floats({"kl": total, "rows": float(rows)})
    return kl_point(sums["kl"], sums["rows"])


def step_grads(model: nn.Module, stack: Stack, micro: Sequence[PairBatch | PrefixBatch],
               spec: LossSpec, cfg: TrainConfig, step: int, ranks: Ranks = SINGLE
               ) -> tuple[float, dict[str, float], Grads]:
    """``dispatch_grads``, waited for: summed loss, metric sums and evaluated grads."""
    pending = dispatch_grads(model, stack, micro, spec, cfg, step, ranks)
    mx.eval(pending.grads)
    return (*pending.read(ranks), pending.grads)
