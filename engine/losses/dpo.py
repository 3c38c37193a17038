"""DPO (Rafailov et al. 2023) and IPO (Azar et al. 2023) against precomputed reference
log-probs, as TRL's DPOTrainer ``dpo_loss``.

z = (Sw − Sr) − (Rw − Rr) on SUMMED response log-probs S and their reference values R
(IPO: both length-averaged, as TRL divides them);
sigmoid: L = mean(−(1−ε)·log σ(βz) − ε·log σ(−βz))  (Eq. 7; ε = label smoothing, cDPO);
ipo:     L = mean((z − 1/(2β))²)                     (IPO Eq. 17; β ≥ 1e-6);
rewards β·(S − R); the NLL term is TRL's ``rpo_alpha`` (its span: nll_span response).
"""

from __future__ import annotations

from dataclasses import dataclass

import engine.losses.base as base
from engine.losses.base import AgainstReference, PairLogps, PairTerms, label_smoothing, setting

LOSS_TYPES = ("sigmoid", "ipo")


@dataclass(frozen=True)
class Dpo(AgainstReference):
    kind = "dpo"
    summary = ("dpo (against reference log-probs computed once and cached: "
               "engine/train/reference.py)")

    dpo_beta: float = setting(0.1, "DPO: β, the strength of the pull to the reference "
                                   "(TRL's beta).", above=0)
    dpo_label_smoothing: float = label_smoothing("DPO sigmoid")
    dpo_loss_type: str = setting("sigmoid", "DPO: sigmoid (Rafailov et al., summed "
                                            "log-probs) or ipo (Azar et al., length-averaged), "
                                            "TRL's loss_type.", choices=LOSS_TYPES)
    rpo_alpha: float = setting(0.0, "DPO: weight of the chosen NLL term (TRL's rpo_alpha; "
                                    "0 = off; TRL's span is nll_span response).", minimum=0)

    def check(self) -> None:
        base.check_smoothing("dpo_label_smoothing", self.dpo_label_smoothing, self.dpo_loss_type,
                        ("sigmoid",))
        base.check_ipo_beta("dpo_beta", self.dpo_beta, self.dpo_loss_type)

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
        z = (pc - pr) - (rc - rr)
        beta = self.dpo_beta
        if self.dpo_loss_type == "ipo":
            losses = (z - 1.0 / (2.0 * beta)) ** 2
        else:
            losses = base.smoothed_sigmoid(beta * z, self.dpo_label_smoothing)
        return PairTerms(losses, beta * (pc - rc), beta * (pr - rr), logps=(pc, pr))
