"""SimPO (Meng et al. 2024): −log σ(β·ℓw − β·ℓr − γ) on mean log-probs (Eq. 6), with an
optional NLL term w (CPO's, TRL's ``cpo_alpha``; 0 = pure SimPO). Rewards β·ℓ as TRL's
CPOTrainer. Defaults: the paper's Llama-3 base settings (β = 2, γ/β = 0.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.losses.base import PairLogps, PairTerms, setting
from engine.losses.sampled import OnlinePairs


def margin_terms(chosen: mx.array, rejected: mx.array, gamma: float) -> mx.array:
    """−log σ(chosen − rejected − γ) per pair: SimPO's Eq. 6 on β-scaled rewards."""
    return -nn.log_sigmoid(chosen - rejected - gamma)


@dataclass(frozen=True)
class Simpo(OnlinePairs):
    kind = "simpo"
    summary = "simpo (reference-free, length-normalised margin)"

    simpo_beta: float = setting(2.0, "SimPO: β scaling the mean log-probs (TRL CPO's beta).",
                                above=0)
    simpo_gamma: float = setting(1.0, "SimPO: target margin γ (TRL's simpo_gamma).")
    simpo_nll_weight: float = setting(0.0, "SimPO: weight of the chosen NLL term (0 = pure "
                                           "SimPO; TRL's cpo_alpha).", minimum=0)

    @property
    def nll_weight(self) -> float:
        return self.simpo_nll_weight

    def terms(self, lp: PairLogps) -> PairTerms:
        chosen, rejected = self.simpo_beta * lp.chosen, self.simpo_beta * lp.rejected
        return PairTerms(margin_terms(chosen, rejected, self.simpo_gamma), chosen, rejected)
