"""DPO (Rafailov et al. 2023) and its loss types against precomputed reference log-probs,
as TRL's DPOTrainer ``dpo_loss``.

z = (Sw − Sr) − (Rw − Rr) on SUMMED response log-probs S and their reference values R
(IPO: both length-averaged, as TRL divides them);
sigmoid: L = mean(−(1−ε)·log σ(βz) − ε·log σ(−βz))  (Eq. 7; ε = label smoothing, cDPO);
ipo:     L = mean((z − 1/(2β))²)                     (IPO Eq. 17; β ≥ 1e-6);
TRL's other types (hinge, robust, exo_pair, nca_pair, sppo_hard, aot, aot_pair, apo_zero,
apo_down, discopop): engine/losses/dpo_types.py, each with its paper. Rewards β·(S − R);
the NLL term is TRL's ``rpo_alpha`` (its span: nll_span response).
"""

from __future__ import annotations

from dataclasses import dataclass

import engine.losses.base as base
from engine.losses.base import AgainstReference, PairLogps, PairTerms, label_smoothing, setting
from engine.losses.dpo_types import LOSS_TYPES as TYPES
from engine.losses.dpo_types import NEEDS_STATE, SMOOTHED, Margins

LOSS_TYPES = (*TYPES, *NEEDS_STATE)
DISCOPOP_TAU = 0.05  # TRL's discopop_tau


@dataclass(frozen=True)
class Dpo(AgainstReference):
    kind = "dpo"
    summary = ("dpo (against reference log-probs computed once and cached: "
               "engine/train/reference.py)")

    dpo_beta: float = setting(0.1, "DPO: β, the strength of the pull to the reference "
                                   "(TRL's beta).", above=0)
    dpo_label_smoothing: float = label_smoothing("DPO sigmoid, robust, exo_pair, aot, "
                                                 "aot_pair")
    dpo_loss_type: str = setting("sigmoid", "DPO: sigmoid (Rafailov et al., summed "
                                            "log-probs), ipo (Azar et al., length-averaged) "
                                            "or another of TRL's loss_type "
                                            "(engine/losses/dpo_types.py).", choices=LOSS_TYPES)
    dpo_discopop_tau: float = setting(DISCOPOP_TAU, "DPO discopop: τ, the temperature of its "
                                                    "mix of the logistic and exponential "
                                                    "losses (TRL's discopop_tau).", above=0)
    rpo_alpha: float = setting(0.0, "DPO: weight of the chosen NLL term (TRL's rpo_alpha; "
                                    "0 = off; TRL's span is nll_span response).", minimum=0)

    def check(self) -> None:
        if why := NEEDS_STATE.get(self.dpo_loss_type):
            raise ValueError(f"dpo_loss_type={self.dpo_loss_type}: it needs {why}; use "
                             "another type")
        base.check_smoothing("dpo_label_smoothing", self.dpo_label_smoothing, self.dpo_loss_type,
                             SMOOTHED)
        base.check_ipo_beta("dpo_beta", self.dpo_beta, self.dpo_loss_type)
        if self.dpo_discopop_tau != DISCOPOP_TAU and self.dpo_loss_type != "discopop":
            raise ValueError(f"dpo_discopop_tau={self.dpo_discopop_tau} with loss type "
                             f"{self.dpo_loss_type}: only discopop reads it; drop one of them")

    @property
    def nll_weight(self) -> float:
        return self.rpo_alpha

    def terms(self, lp: PairLogps) -> PairTerms:
        ref_chosen, ref_rejected = self.references(lp)
        if self.dpo_loss_type == "ipo":
            pc, pr = lp.chosen, lp.rejected
            rc, rr = ref_chosen / lp.chosen_tokens, ref_rejected / lp.rejected_tokens
        else:
            pc, pr, rc, rr = lp.chosen_sum, lp.rejected_sum, ref_chosen, ref_rejected
        beta = self.dpo_beta
        margins = Margins(pc, pr, rc, rr, beta, self.dpo_label_smoothing, self.dpo_discopop_tau)
        losses = TYPES[self.dpo_loss_type](margins)
        return PairTerms(losses, beta * (pc - rc), beta * (pr - rr), logps=(pc, pr))
