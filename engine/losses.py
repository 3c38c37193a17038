"""ORPO and SFT loss maths on per-token log-probabilities (Hong et al. 2024).

Conventions (DESIGN.md, = TRL's ORPOTrainer):
- ℓw, ℓr: per-token MEAN log-prob over response tokens only (Eq. 4's length-normalised
  likelihood, in log space);
- log_odds = (ℓw − ℓr) − (log1mexp(ℓw) − log1mexp(ℓr))            (Eq. 5, odds ratio);
- L = NLL + λ·mean(−log σ(log_odds))                                  (Eq. 6–7);
- NLL: token-mean cross-entropy of the chosen sequence over ``nll_span`` = "full"
  (prompt + response) or "response" (the official code's ``--disable_prompt_loss``).

Reductions are sums divided by normalisers of the *whole* optimizer batch, so gradient
accumulation over micro-batches adds up to exactly the one-big-batch loss.
Names: λ is our ``orpo_lambda``, TRL's ``beta`` and the official code's ``alpha``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

LN2 = math.log(2.0)
# Largest float32 below 0: keeps log1mexp finite when a mean log-prob rounds to 0.
LOGP_CEILING = -1.1920929e-07


def log1mexp(x: mx.array) -> mx.array:
    """log(1 − exp(x)) for x < 0, stable in float32 (Mächler 2012: branch at −ln 2)."""
    x = mx.minimum(x, LOGP_CEILING)
    return mx.where(x > -LN2, mx.log(-mx.expm1(x)), mx.log1p(-mx.exp(x)))


@dataclass(frozen=True)
class Norms:
    """Normalisers of one optimizer batch: NLL tokens and preference pairs in it."""

    nll_tokens: float
    pairs: float


@dataclass(frozen=True)
class LossSpec:
    """Which loss to compute. ``kind``: "orpo" or "sft" (NLL only)."""

    kind: str = "orpo"
    orpo_lambda: float = 0.1
    nll_span: str = "full"

    def __post_init__(self) -> None:
        if self.kind not in ("orpo", "sft"):
            raise ValueError(f"loss kind={self.kind!r}: expected 'orpo' or 'sft'")
        if self.nll_span not in ("full", "response"):
            raise ValueError(f"nll_span={self.nll_span!r}: expected 'full' or 'response'")


def mean_logps(token_logps: mx.array, mask: mx.array) -> mx.array:
    """Per-row mean of ``token_logps`` [N, T] over ``mask`` [N, T] → [N] (float32)."""
    return (token_logps * mask).sum(axis=-1) / mx.maximum(mask.sum(axis=-1), 1.0)


def orpo_pair_terms(lw: mx.array, lr: mx.array) -> tuple[mx.array, mx.array]:
    """Per pair: (log_odds, log σ(log_odds)) from mean log-probs ℓw, ℓr [B] (Eq. 5–6)."""
    lw, lr = lw.astype(mx.float32), lr.astype(mx.float32)
    log_odds = (lw - lr) - (log1mexp(lw) - log1mexp(lr))
    return log_odds, nn.log_sigmoid(log_odds)


def pair_loss(
    token_logps: mx.array,
    resp_mask: mx.array,
    nll_mask: mx.array,
    spec: LossSpec,
    norms: Norms,
) -> tuple[mx.array, dict[str, mx.array]]:
    """Loss of one micro-batch and its summed metrics.

    token_logps, resp_mask, nll_mask: [2B, T], rows 0..B−1 chosen, B..2B−1 rejected;
    ``nll_mask`` marks the chosen rows' NLL span (zero on rejected rows).
    Returns the micro-batch's share of the batch loss and per-pair metric *sums*
    (divide by ``norms.pairs`` for batch means).
    """
    token_logps = token_logps.astype(mx.float32)
    nll_sum = -(token_logps * nll_mask).sum()
    loss = nll_sum / norms.nll_tokens
    b = token_logps.shape[0] // 2
    logps = mean_logps(token_logps, resp_mask)
    lw, lr = logps[:b], logps[b:]
    metrics = {"nll_sum": nll_sum, "logps/chosen": lw.sum(), "logps/rejected": lr.sum()}
    if spec.kind == "sft":
        return loss, metrics
    log_odds, log_sig = orpo_pair_terms(lw, lr)
    loss = loss - spec.orpo_lambda * log_sig.sum() / norms.pairs
    chosen_r, rejected_r = spec.orpo_lambda * lw, spec.orpo_lambda * lr
    metrics.update({
        "rewards/chosen": chosen_r.sum(),
        "rewards/rejected": rejected_r.sum(),
        "rewards/accuracies": (chosen_r > rejected_r).astype(mx.float32).sum(),
        "rewards/margins": (chosen_r - rejected_r).sum(),
        "log_odds_ratio": log_sig.sum(),
        "log_odds_chosen": log_odds.sum(),
    })
    return loss, metrics
