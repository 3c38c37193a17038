"""KTO (Ethayarajh et al. 2024), TRL's KTOTrainer ``kto_loss``, on paired data (each pair
one desirable example, its chosen response, and one undesirable, its rejected, as TRL's
``unpair_preference_dataset`` makes them) and on unpaired rows (TRL's own layout: a
prompt, one completion, its ``label``).

r = S − R, a response's summed log-prob under the policy less the reference's;
z0 = max(0, mean over mismatched pairs of S − R)  (the KL reference point: each pair's
     partner is its prompt with the previous pair's responses, engine/train/reference.kl_partners;
     a constant to the gradient, over the whole optimizer batch: engine/backward/step.py);
desirable:   L = w_d·(1 − σ(β·(r_w − z0)))        (Eq. 7: the value of a gain);
undesirable: L = w_u·(1 − σ(β·(z0 − r_l)))        (the value of a loss);
the loss is the mean over all 2B examples (TRL's ``losses.nanmean()``); rewards β·r, as
TRL logs them; no NLL term (TRL's KTO has none).

Unpaired rows (``PairLogps.labels``; engine/data/unpaired.py): each row's first branch is
its completion, its second its KL partner's completion under its prompt. Then
z0 = max(0, mean over the micro-batch of S − R of the partners), detached: TRL's, which
takes each forward's batch (its ``per_device_train_batch_size``, Pomona's ``batch_size``);
the row's loss is the desirable or undesirable one above by its label, and the loss the
mean over the rows. ``rewards/chosen`` and ``rewards/rejected`` are the desirable and the
undesirable rows' β·r summed over all rows (TRL's ``rewards/chosen_sum`` over the batch).
TRL's ``apo_zero_unpaired`` variant is not offered.
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
        if lp.labels is not None:
            return self.unpaired_terms(lp)
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

    def unpaired_terms(self, lp: PairLogps) -> PairTerms:
        """Unpaired rows: each one's loss by its label, z0 from their KL partners."""
        ref_row, ref_partner = self.references(lp)
        beta, desirable = self.kto_beta, lp.labels
        ratio = lp.chosen_sum - ref_row
        z0 = mx.maximum(mx.stop_gradient(lp.rejected_sum - ref_partner).mean(), 0.0)
        gain = self.kto_desirable_weight * (1 - mx.sigmoid(beta * (ratio - z0)))
        loss = self.kto_undesirable_weight * (1 - mx.sigmoid(beta * (z0 - ratio)))
        rewards = beta * ratio
        return PairTerms(desirable * gain + (1 - desirable) * loss, desirable * rewards,
                         (1 - desirable) * rewards, {"kl": mx.broadcast_to(z0, ratio.shape)},
                         logps=(desirable * lp.chosen_sum, (1 - desirable) * lp.chosen_sum))
