"""KTO (Ethayarajh et al. 2024), TRL's KTOTrainer ``kto_loss`` on paired data: each pair is
one desirable example (its chosen response) and one undesirable (its rejected), as TRL's
``unpair_preference_dataset`` makes them.

r = S − R, a response's summed log-prob under the policy less the reference's;
z0 = max(0, mean over mismatched pairs of S − R)  (the KL reference point: each pair's
     partner is its prompt with the previous pair's responses, engine/train/reference.kl_partners;
     a constant to the gradient, over the whole optimizer batch: engine/backward/step.py);
desirable:   L = w_d·(1 − σ(β·(r_w − z0)))        (Eq. 7: the value of a gain);
undesirable: L = w_u·(1 − σ(β·(z0 − r_l)))        (the value of a loss);
the loss is the mean over all 2B examples (TRL's ``losses.nanmean()``); rewards β·r, as
TRL logs them; no NLL term (TRL's KTO has none). TRL's ``apo_zero_unpaired`` variant and
unpaired rows with a label are not offered.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.losses.base import AgainstReference, PairLogps, PairTerms, setting


@dataclass(frozen=True)
class Kto(AgainstReference):
    kind = "kto"
    summary = ("kto (prospect-theoretic, against reference log-probs and a KL point "
               "from mismatched pairs)")
    needs_kl = True
    extras = ("kl",)

    kto_beta: float = setting(0.1, "KTO: β, the value function's steepness (TRL's beta).",
                              above=0)
    kto_desirable_weight: float = setting(1.0, "KTO: weight of the desirable (chosen) "
                                               "examples' losses (TRL's desirable_weight).",
                                          minimum=0)
    kto_undesirable_weight: float = setting(1.0, "KTO: weight of the undesirable (rejected) "
                                                 "examples' losses (TRL's "
                                                 "undesirable_weight).", minimum=0)

    def check(self) -> None:
        if not (self.kto_desirable_weight or self.kto_undesirable_weight):
            raise ValueError("kto_desirable_weight and kto_undesirable_weight are both 0: "
                             "nothing would train; give one of them a weight")

    @property
    def nll_weight(self) -> float:
        return 0.0

    def terms(self, lp: PairLogps) -> PairTerms:
        ref_chosen, ref_rejected = self.references(lp)
        beta, z0 = self.kto_beta, lp.kl
        chosen = lp.chosen_sum - ref_chosen
        rejected = lp.rejected_sum - ref_rejected
        gain = 1 - mx.sigmoid(beta * (chosen - z0))
        loss = 1 - mx.sigmoid(beta * (z0 - rejected))
        losses = (self.kto_desirable_weight * gain + self.kto_undesirable_weight * loss) / 2
        return PairTerms(losses, beta * chosen, beta * rejected,
                         {"kl": mx.broadcast_to(z0, chosen.shape)},
                         logps=(lp.chosen_sum, lp.rejected_sum))
