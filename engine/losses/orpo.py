"""ORPO (Hong et al. 2024), TRL's ORPOTrainer: the NLL plus λ times the odds-ratio term.

log_odds = (ℓw − ℓr) − (log1mexp(ℓw) − log1mexp(ℓr))   (Eq. 5, the log odds ratio);
L = NLL + λ·mean(−log σ(log_odds))                      (Eq. 6–7); rewards λ·ℓ as TRL's.
λ is ``orpo_lambda``: TRL's ORPO ``beta``, the official code's ``alpha``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.losses.base import PairLogps, PairTerms, log1mexp, setting
from engine.losses.sampled import OnlinePairs


def orpo_pair_terms(lw: mx.array, lr: mx.array) -> tuple[mx.array, mx.array]:
    """Per pair: (log_odds, log σ(log_odds)) from mean log-probs ℓw, ℓr [B] (Eq. 5–6)."""
    lw, lr = lw.astype(mx.float32), lr.astype(mx.float32)
    log_odds = (lw - lr) - (log1mexp(lw) - log1mexp(lr))
    return log_odds, nn.log_sigmoid(log_odds)


@dataclass(frozen=True)
class Orpo(OnlinePairs):
    kind = "orpo"
    summary = "orpo (NLL + odds ratio, reference-free)"
    extras = ("log_odds_ratio", "log_odds_chosen")

    orpo_lambda: float = setting(0.1, "ORPO: λ weighting the odds-ratio term (TRL's beta).",
                                 minimum=0)

    def terms(self, lp: PairLogps) -> PairTerms:
        log_odds, log_sig = orpo_pair_terms(lp.chosen, lp.rejected)
        lam = self.orpo_lambda
        return PairTerms(-lam * log_sig, lam * lp.chosen, lam * lp.rejected,
                         {"log_odds_ratio": log_sig, "log_odds_chosen": log_odds})
