"""A pack's training step (engine/model/packed_lora.py): the micro-batches' rows repeated
once per adapter, every adapter's own loss on its copy summed into one backward through the
configured path, then each adapter's own clip and AdamW update (its learning rate, schedule
and clip), so each adapter takes the steps its lone run takes (engine/train/steps.py;
tests/test_pack_steps.py holds the weights to the parity tolerance).

    stepper = PackStepper(model, stack, cfgs, updates)
    for done in stepper.steps(next_micro_batches, first=1, last=steps):  # trial -> StepDone
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from engine.backward.segmented import Grads, value_and_grad
from engine.data.batch import PairBatch, batch_norms, repeat_rows
from engine.forward.prefix import PrefixBatch, pair_batch, repeat_layout
from engine.forward.scoring import forward_logps, kl_point
from engine.host.prefetch import Prefetch
from engine.losses import Norms, pair_loss
from engine.model.load import micro_seed, set_dropout_seed
from engine.model.packed_lora import drop_adapter
from engine.settings.config import TrainConfig
from engine.train.steps import NonFiniteLoss, StepDone, check_finite

# What every trial of a pack shares: its batches, its path through the model, the adapted
# projections. The rest (learning rate and schedule, AdamW, clip, the loss and its
# settings, LoRA rank, scale and dropout, validation, outputs) is each adapter's own.
SHARED = ("model", "data", "nll_span", "batch_size", "grad_accum", "steps", "seed",
          "segment_size",
          "head_chunk", "mlp_chunk", "inflight", "prefix_share", "prefix_attention",
          "pad_multiple", "lora_keys", "lora_layers", "allow_tokenizer_mismatch",
          "memory_limit_gb")


def check_pack(cfgs: Sequence[TrainConfig]) -> None:
    """ValueError naming the first setting the trials of a pack do not share. Trials whose
    loss reads a reference (DPO, KTO) share it: its log-probs, and KTO's KL partners with
    theirs, ride on the pack's one batch."""
    for name in SHARED:
        values = [getattr(c, name) for c in cfgs]
        if any(v != values[0] for v in values):
            raise ValueError(f"a pack's trials share {name}; got {values}")
    readers = [c for c in cfgs if c.loss_spec().needs_reference]
    for name in ("reference", "reference_logps"):
        values = [str(getattr(c, name)) for c in readers]
        if any(v != values[0] for v in values):
            raise ValueError(f"a pack's trials that read a reference share {name}; got "
                             f"{values}")


@dataclass
class PackStepper:
    """What a pack's step needs: the model with its pack, the trials' configs (their
    shared settings run the step; each one's loss is its adapter's) and each adapter's
    update (engine/backward/update.py ``make_adapter_update``). ``live``: the trials still
    in the pack, by their first position; an adapter whose loss or norm turns non-finite
    leaves it (its trial fails as a lone run fails) and the others go on."""

    model: Any
    stack: Any
    cfgs: list[TrainConfig]
    updates: list[Callable[[Grads], mx.array]]
    live: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cfgs, self.updates = list(self.cfgs), list(self.updates)
        # ``live`` itself is kept, not copied: the updates find their adapters through it
        self.live = self.live or list(range(len(self.cfgs)))

    def steps(self, batches: Callable[[], list[PairBatch | PrefixBatch]], first: int,
              last: int) -> Iterator[dict[int, StepDone | NonFiniteLoss]]:
        """Steps ``first`` to ``last`` while any trial is live, each on the micro-batches
        one call of ``batches`` makes: per step, each live trial's StepDone, or the
        NonFiniteLoss that takes it out of the pack (its last)."""
        prefetch = Prefetch(batches, last - first + 1)  # built ahead, as a lone run's are
        for step in range(first, last + 1):
            if not self.live:
                return
            t0 = time.perf_counter()
            micro = prefetch.next()
            losses, sums, grads = self.grads(micro, step)
            norms = [u(g) for u, g in zip(self.updates, grads, strict=True)]
            mx.eval(losses, sums, norms)
            seconds = time.perf_counter() - t0
            tokens = sum(pair_batch(b).tokens for b in micro)
            pairs = sum(len(b.ids) for b in micro)
            done: dict[int, StepDone | NonFiniteLoss] = {}
            for p, trial in enumerate(self.live):
                try:
                    check_finite(step, float(losses[p]), float(norms[p]), micro)
                except NonFiniteLoss as err:
                    done[trial] = err
                    continue
                own = {n: float(v) for n, v in sums[p].items()}
                done[trial] = StepDone(step, float(losses[p]), own, float(norms[p]), tokens,
                                       seconds, pairs)
            self.drop([t for t, d in done.items() if isinstance(d, NonFiniteLoss)])
            yield done

    def drop(self, trials: list[int]) -> None:
        """``trials`` out of the pack: their adapters, configs and updates removed, so the
        others step on as a pack without them would."""
        for trial in trials:
            p = self.live.index(trial)
            drop_adapter(self.model, p)
            del self.cfgs[p], self.updates[p], self.live[p]

    def position(self, trial: int) -> int:
        """Where ``trial``'s adapter sits in the pack now."""
        return self.live.index(trial)

    def grads(self, micro: list[PairBatch | PrefixBatch], step: int
              ) -> tuple[list[mx.array], list[dict[str, mx.array]], list[Grads]]:
        """Each adapter's loss, metric sums and grads (named as a lone adapter's) over one
        step's micro-batches, normalised over the whole step as a lone run's are."""
        cfg, k = self.cfgs[0], len(self.cfgs)
        norms = batch_norms([pair_batch(b) for b in micro])
        losses = [mx.array(0.0)] * k
        sums: list[dict[str, mx.array]] = [{} for _ in range(k)]
        total: Grads = {}
        kls = self.kl_points(micro)  # before the step's masks are seeded, as a lone step
        for j, b in enumerate(micro):
            if j:  # bound the accumulation: the earlier micro-batches finish first
                mx.eval(losses, sums, total)
            set_dropout_seed(self.model, micro_seed(cfg.seed, step, j))
            _, metrics, g = value_and_grad(self.model, self.stack, repeat_layout(b, k),
                                           self.loss_of(pair_batch(b), norms, kls),
                                           cfg.segment_size, cfg.head_chunk, cfg.inflight)
            total = g if not total else {n: total[n] + g[n] for n in total}
            for i in range(k):
                losses[i] = losses[i] + metrics[f"{i}/loss"]
                for n, v in metrics.items():
                    if n.startswith(f"{i}/") and n != f"{i}/loss":
                        key = n.split("/", 1)[1]
                        sums[i][key] = sums[i].get(key, 0.0) + v
        for i in range(k):
            sums[i].update(micro_batches=len(micro), pairs=norms.pairs,
                           nll_tokens=norms.nll_tokens,
                           shared_batches=sum(isinstance(b, PrefixBatch) for b in micro))
        return losses, sums, [adapter_grads(total, i) for i in range(k)]

    def kl_points(self, micro: list[PairBatch | PrefixBatch]) -> list[mx.array | None]:
        """Each adapter's KL reference point over the step's micro-batches, where its loss
        reads one (KTO; engine/backward/step.py ``step_kl`` for a lone run): the KL
        partners' rows repeated once per adapter, each copy's log-ratio summed apart."""
        k, chunk = len(self.cfgs), self.cfgs[0].head_chunk
        if not any(c.loss.needs_kl for c in self.cfgs):
            return [None] * k
        totals, rows = [0.0] * k, 0
        for b in micro:
            partners = pair_batch(b).kl
            if partners is None or partners.ref is None:
                raise ValueError("a KTO trial's pack needs KL partners with reference "
                                 "log-probs: none were attached to this batch")
            lp = forward_logps(self.model, self.stack, repeat_rows(partners, k), chunk,
                               np.concatenate([partners.resp_mask > 0] * k))
            resp, ref = mx.array(partners.resp_mask), mx.array(partners.ref)
            for i, part in enumerate(mx.split(lp, k)):
                totals[i] += float(((part * resp).sum(axis=-1) - ref).sum())
            rows += 2 * partners.pairs
        return [kl_point(t, rows) if c.loss.needs_kl else None
                for t, c in zip(totals, self.cfgs, strict=True)]

    def loss_of(self, b: PairBatch, norms: Norms, kls: list[mx.array | None]
                ) -> Callable[[mx.array], Any]:
        """The loss of a micro-batch's k copies: the sum of each adapter's own loss on its
        copy (its gradient w.r.t. adapter i is adapter i's loss's; its KL point, where it
        reads one, its own); each one's metrics apart, as ``i/name``."""
        resp, nll, ref = mx.array(b.resp_mask), mx.array(b.nll_mask), b.ref_array()
        specs = [c.loss_spec() for c in self.cfgs]

        def loss(lp: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
            total, metrics = mx.array(0.0), {}
            parts = mx.split(lp, len(specs))
            for i, (spec, part, kl) in enumerate(zip(specs, parts, kls, strict=True)):
                own, m = pair_loss(part, resp, nll, spec, norms, ref, kl)
                total = total + own
                metrics.update({f"{i}/{n}": v for n, v in m.items()}, **{f"{i}/loss": own})
            return total, metrics

        return loss


def adapter_grads(grads: Grads, i: int) -> Grads:
    """Adapter ``i``'s grads of a pack's (``….lora_a.i``), named as a lone adapter's."""
    return {n.removesuffix(f".{i}"): g for n, g in grads.items() if n.endswith(f".{i}")}
