"""A run's loss as the engine computes it: ``LossSpec`` (one loss's settings and the NLL's
span) and ``pair_loss``, the one wrapper that applies masks and normalisers, adds the NLL
term and names the metrics (TRL's names) for whichever loss it is given.

- NLL: token-mean cross-entropy of the chosen sequence over ``nll_span`` = "full"
  (prompt + response) or "response" (the official ORPO code's ``--disable_prompt_loss``),
  weighted by the loss's ``nll_weight``;
- every loss also reports ``logps/accuracies``, the share of pairs whose chosen MEAN
  response log-prob beats the rejected one's, and ``logps/margin``, the mean ℓw − ℓr: one
  scale for all (what sweeps over losses rank on; DPO's ``rewards/accuracies`` is relative
  to its reference, its ``logps/*`` summed).

Reductions are sums divided by normalisers of the *whole* optimizer batch, so gradient
accumulation over micro-batches adds up to exactly the one-big-batch loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.losses.base import LossSettings, Norms, PairLogps, PairTerms, pair_logps
from engine.losses.orpo import Orpo

NLL_SPANS = ("full", "response")


@dataclass(frozen=True)
class LossSpec:
    """Which loss to compute (its settings: ``loss``), the NLL term's span, and whether it
    trains on unpaired rows (KTO's own data, whose KL partners are in the rows themselves:
    engine/data/unpaired.py; so no KL partners of their own)."""

    loss: LossSettings = field(default_factory=Orpo)
    nll_span: str = "full"
    unpaired: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.loss, LossSettings):
            raise ValueError(f"loss={self.loss!r}: expected a loss's settings")
        if self.nll_span not in NLL_SPANS:
            raise ValueError(f"nll_span={self.nll_span!r}: expected 'full' or 'response'")

    @property
    def kind(self) -> str:
        return self.loss.kind

    @property
    def needs_reference(self) -> bool:
        return self.loss.needs_reference

    @property
    def needs_kl(self) -> bool:
        return self.loss.needs_kl and not self.unpaired

    def to_dict(self) -> dict[str, Any]:
        """Plain values: the loss's name, its settings and the span (a cache key's part)."""
        return {"loss": self.kind, **self.loss.fields(), "nll_span": self.nll_span}


def pair_loss(
    token_logps: mx.array,
    resp_mask: mx.array,
    nll_mask: mx.array,
    spec: LossSpec,
    norms: Norms,
    ref: mx.array | None = None,
    kl: mx.array | None = None,
    labels: mx.array | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """Loss of one micro-batch and its summed metrics (TRL's names).

    token_logps, resp_mask, nll_mask: [2B, T], rows 0..B−1 chosen, B..2B−1 rejected;
    ``nll_mask`` marks the chosen rows' NLL span (zero on rejected rows); ``ref``: [2B]
    summed reference log-probs, same row order (a loss that reads them; None for others);
    ``kl``: the optimizer batch's KL reference point (engine/backward/step.py; KTO's, else None);
    ``labels``: [B] unpaired rows' labels (``PairBatch.labels``; None for pairs).
    Returns the micro-batch's share of the batch loss and per-pair metric *sums*
    (divide by ``norms.pairs`` for batch means; ``nll_sum`` by ``norms.nll_tokens``).
    """
    token_logps = token_logps.astype(mx.float32)
    nll_sum = -(token_logps * nll_mask).sum()
    loss = spec.loss.nll_weight * nll_sum / norms.nll_tokens
    # Pairs' maths on unpaired rows, or the reverse, would train silently on the wrong loss.
    if (labels is not None) != spec.unpaired:
        raise ValueError(f"loss {spec.kind}: the batch holds "
                         f"{'unpaired rows' if labels is not None else 'pairs'}, the loss "
                         f"was set up for {'unpaired rows' if spec.unpaired else 'pairs'}")
    lp = pair_logps(token_logps, resp_mask, ref, kl, labels)
    terms = spec.loss.terms(lp)
    loss = loss + terms.losses.sum() / norms.pairs
    return loss, {"nll_sum": nll_sum, **logp_metrics(lp, terms), **reward_metrics(terms)}


def logp_metrics(lp: PairLogps, terms: PairTerms) -> dict[str, mx.array]:
    """logps/chosen and logps/rejected (the loss's own: means, DPO's sums) and two
    loss-independent figures on mean log-probs: logps/accuracies (ℓw > ℓr) and
    logps/margin (ℓw − ℓr), summed."""
    chosen, rejected = terms.logps or (lp.chosen, lp.rejected)
    return {"logps/chosen": chosen.sum(), "logps/rejected": rejected.sum(),
            "logps/accuracies": (lp.chosen > lp.rejected).astype(mx.float32).sum(),
            "logps/margin": (lp.chosen - lp.rejected).sum()}


REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies",
                  "rewards/margins")
LOGP_METRICS = ("logps/chosen", "logps/rejected", "logps/accuracies", "logps/margin")


def reward_metrics(terms: PairTerms) -> dict[str, mx.array]:
    """TRL's reward metrics, and the loss's extras, summed over the pairs."""
    chosen, rejected = terms.chosen_rewards, terms.rejected_rewards
    return dict(zip(REWARD_METRICS, (
        chosen.sum(), rejected.sum(), (chosen > rejected).astype(mx.float32).sum(),
        (chosen - rejected).sum()), strict=True), **{k: v.sum() for k, v in terms.extra.items()})


def validation_metrics(spec: LossSpec | LossSettings) -> list[str]:
    """The ``val/*`` names a validation under ``spec`` reports (engine.forward.scoring.evaluate):
    the shared ones and the loss's declared extras."""
    loss = spec.loss if isinstance(spec, LossSpec) else spec
    if loss.on_groups:  # greedy completions of the valid prompts, rewarded (and per scorer)
        return ["val/completions/mean_length", "val/reward", "val/rows"]
    names = {"loss", "nll_loss", "rows", *LOGP_METRICS, *REWARD_METRICS, *loss.extras}
    return sorted(f"val/{k}" for k in names)


def per_pair_losses(lp: PairLogps, nll: mx.array, spec: LossSpec
                    ) -> tuple[mx.array, PairTerms]:
    """Each pair's own loss [B] (its NLL mean weighted, plus its pair term) for scoring:
    the batch loss of ``pair_loss`` with every pair alone."""
    terms = spec.loss.terms(lp)
    return spec.loss.nll_weight * nll + terms.losses, terms
