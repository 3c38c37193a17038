"""CPO (Xu et al. 2024), TRL's CPOTrainer ``cpo_loss``: a reference-free DPO with the
chosen NLL added (weight ``cpo_alpha``; TRL's span is nll_span response).

logits = Sw − Sr on SUMMED response log-probs (sigmoid, hinge), or ℓw − ℓr on mean ones
(ipo, simpo: TRL's ``average_log_prob``);
sigmoid: −(1−ε)·log σ(β·logits) − ε·log σ(−β·logits)      (CPO Eq. 3; ε label smoothing);
simpo:   the same on logits − γ/β, γ ≥ 0                   (SimPO Eq. 6, TRL's CPO-SimPO);
hinge:   max(0, 1 − β·logits);  ipo: (logits − 1/(2β))²   (IPO Eq. 17; β ≥ 1e-6);
L = mean(losses) + cpo_alpha·NLL; rewards β·logps, as TRL logs them. TRL's AlphaPO reward
transform (``alpha``) is not offered.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

import engine.losses.base as base
from engine.losses.base import PairLogps, PairTerms, label_smoothing, setting
from engine.losses.sampled import OnlinePairs

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
SIMPO_GAMMA = 0.5  # TRL's default


@dataclass(frozen=True)
class Cpo(OnlinePairs):
    kind = "cpo"
    summary = "cpo (reference-free DPO plus the chosen NLL; its SimPO variant)"
    mean_rewards = False  # β·S on summed log-probs (sigmoid, hinge)

    cpo_beta: float = setting(0.1, "CPO: β, the temperature of the preference term (TRL's "
                                   "beta).", above=0)
    cpo_alpha: float = setting(1.0, "CPO: weight of the chosen NLL term (TRL's cpo_alpha; "
                                    "its span is nll_span response).", minimum=0)
    cpo_label_smoothing: float = label_smoothing("CPO sigmoid/simpo")
    cpo_loss_type: str = setting("sigmoid", "CPO: sigmoid or hinge on summed log-probs, ipo "
                                            "or simpo on mean ones (TRL's loss_type).",
                                 choices=LOSS_TYPES)
    cpo_simpo_gamma: float = setting(SIMPO_GAMMA, "CPO simpo: the target margin γ >= 0 "
                                                  "(TRL's simpo_gamma).", minimum=0)

    def check(self) -> None:
        super().check()
        base.check_smoothing("cpo_label_smoothing", self.cpo_label_smoothing, self.cpo_loss_type,
                        ("sigmoid", "simpo"))
        base.check_ipo_beta("cpo_beta", self.cpo_beta, self.cpo_loss_type)
        # TRL's default γ is not 0, so only a γ moved off it can be a mistake: an untouched
        # one passes with every loss type (nothing tells a typed 0.5 from the default).
        gamma = self.cpo_simpo_gamma
        if self.cpo_loss_type != "simpo" and gamma != SIMPO_GAMMA:
            raise ValueError(f"cpo_simpo_gamma={gamma} with loss type {self.cpo_loss_type}: "
                             "only loss type simpo reads it; drop one of them")

    @property
    def nll_weight(self) -> float:
        return self.cpo_alpha

    def terms(self, lp: PairLogps) -> PairTerms:
        mean = self.cpo_loss_type in ("ipo", "simpo")
        pc, pr = (lp.chosen, lp.rejected) if mean else (lp.chosen_sum, lp.rejected_sum)
        beta, logits = self.cpo_beta, pc - pr
        if self.cpo_loss_type == "hinge":
            losses = mx.maximum(1 - beta * logits, 0.0)
        elif self.cpo_loss_type == "ipo":
            losses = (logits - 1 / (2 * beta)) ** 2
        else:
            # β·(logits − γ/β) as β·logits − γ: the same, and no γ/β to overflow float32
            gamma = self.cpo_simpo_gamma if self.cpo_loss_type == "simpo" else 0.0
            losses = base.smoothed_sigmoid(beta * logits - gamma, self.cpo_label_smoothing)
        return PairTerms(losses, beta * pc, beta * pr, logps=(pc, pr))
