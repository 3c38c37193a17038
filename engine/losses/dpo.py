"""DPO (Rafailov et al. 2023) and its loss types against precomputed reference log-probs,
as TRL's DPOTrainer ``dpo_loss``.

z = (Sw − Sr) − (Rw − Rr) on SUMMED response log-probs S and their reference values R
(IPO: both length-averaged, as TRL divides them);
sigmoid: L = mean(−(1−ε)·log σ(βz) − ε·log σ(−βz))  (Eq. 7; ε = label smoothing, cDPO);
ipo:     L = mean((z − 1/(2β))²)                     (IPO Eq. 17; β ≥ 1e-6);
TRL's other types (hinge, robust, exo_pair, nca_pair, sppo_hard, aot, aot_pair, apo_zero,
apo_down, discopop): engine/losses/dpo_types.py, each with its paper. Several types
(TRL's list, ``dpo_loss_weights`` its loss_weights): L = Σ_k w_k·L_k, ``sft`` among them
the chosen NLL term at its weight (= ``rpo_alpha``). Rewards β·(S − R); the NLL term is
TRL's ``rpo_alpha`` (its span: nll_span response).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

import engine.losses.base as base
from engine.losses.base import AgainstReference, PairLogps, PairTerms, label_smoothing, setting
from engine.losses.dpo_types import LOSS_TYPES as TYPES
from engine.losses.dpo_types import NEEDS_STATE, SMOOTHED, Margins
from engine.losses.sampled import OnlinePairs

LOSS_TYPES = (*TYPES, "sft", *NEEDS_STATE)  # sft: TRL's NLL of the chosen response
DISCOPOP_TAU = 0.05  # TRL's discopop_tau


@dataclass(frozen=True)
class Dpo(AgainstReference, OnlinePairs):
    kind = "dpo"
    summary = ("dpo (against reference log-probs computed once and cached: "
               "engine/train/reference.py)")

    dpo_beta: float = setting(0.1, "DPO: β, the strength of the pull to the reference "
                                   "(TRL's beta).", above=0)
    dpo_label_smoothing: float = label_smoothing("DPO sigmoid, robust, exo_pair, aot, "
                                                 "aot_pair")
    dpo_loss_type: tuple[str, ...] = setting(
        ("sigmoid",), "DPO: sigmoid (Rafailov et al., summed log-probs), ipo (Azar et al., "
                      "length-averaged) or another of TRL's loss_type "
                      "(engine/losses/dpo_types.py); several: their weighted sum, sft the "
                      "chosen NLL (TRL's list).", items=str, choices=LOSS_TYPES)
    dpo_loss_weights: tuple[float, ...] = setting((), "DPO: each loss type's weight, in "
                                                      "order (TRL's loss_weights; none: 1 "
                                                      "each).", items=float)
    dpo_discopop_tau: float = setting(DISCOPOP_TAU, "DPO discopop: τ, the temperature of its "
                                                    "mix of the logistic and exponential "
                                                    "losses (TRL's discopop_tau).", above=0)
    rpo_alpha: float = setting(0.0, "DPO: weight of the chosen NLL term (TRL's rpo_alpha; "
                                    "0 = off; TRL's span is nll_span response).", minimum=0)

    def check(self) -> None:
        super().check()
        types = self.dpo_loss_type
        self._check_mixture(types)
        smoothed = next((t for t in types if t in SMOOTHED), types[0])
        base.check_smoothing("dpo_label_smoothing", self.dpo_label_smoothing, smoothed,
                             SMOOTHED)
        base.check_ipo_beta("dpo_beta", self.dpo_beta, types[0])
        if self.dpo_discopop_tau != DISCOPOP_TAU and "discopop" not in types:
            raise ValueError(f"dpo_discopop_tau={self.dpo_discopop_tau} with loss type "
                             f"{'+'.join(types)}: only discopop reads it; drop one of them")

    def _check_mixture(self, types: tuple[str, ...]) -> None:
        """One or several distinct types, a weight ≥ 0 each if any given; none needing what
        Pomona lacks; ipo alone (its log-probs are length-averaged, the others' summed);
        sft or rpo_alpha, not both (one NLL term)."""
        name = f"dpo_loss_type={list(types)}"
        if not types or len(set(types)) < len(types):
            raise ValueError(f"{name}: expected loss types, each once")
        if bad := next((t for t in types if t in NEEDS_STATE), None):
            raise ValueError(f"dpo_loss_type={bad}: it needs {NEEDS_STATE[bad]}; use another "
                             "type")
        if "ipo" in types and len(types) > 1:
            raise ValueError(f"{name}: ipo reads length-averaged log-probs, the others "
                             "summed ones; train ipo alone")
        weights = self.dpo_loss_weights
        if weights and (len(weights) != len(types) or min(weights) < 0):
            raise ValueError(f"dpo_loss_weights={list(weights)}: one weight >= 0 per loss "
                             f"type ({name})")
        if "sft" in types and self.rpo_alpha:
            raise ValueError(f"{name} with rpo_alpha={self.rpo_alpha}: both are the chosen "
                             "NLL term; give one of them")

    @property
    def weights(self) -> dict[str, float]:
        """Each loss type's weight (TRL's loss_weights; 1 each when none are given)."""
        given = self.dpo_loss_weights or (1.0,) * len(self.dpo_loss_type)
        return dict(zip(self.dpo_loss_type, given, strict=True))

    @property
    def nll_weight(self) -> float:
        return self.rpo_alpha + self.weights.get("sft", 0.0)

    def terms(self, lp: PairLogps) -> PairTerms:
        ref_chosen, ref_rejected = self.references(lp)
        if self.dpo_loss_type == ("ipo",):
            pc, pr = lp.chosen, lp.rejected
            rc, rr = ref_chosen / lp.chosen_tokens, ref_rejected / lp.rejected_tokens
        else:
            pc, pr, rc, rr = lp.chosen_sum, lp.rejected_sum, ref_chosen, ref_rejected
        beta = self.dpo_beta
        margins = Margins(pc, pr, rc, rr, beta, self.dpo_label_smoothing, self.dpo_discopop_tau)
        losses = mx.zeros_like(pc)  # sft alone: the NLL term, nll_weight's
        for kind, weight in self.weights.items():
            if kind != "sft":  # Σ_k w_k · ℓ_k per pair, as TRL sums its types' means
                losses = losses + weight * TYPES[kind](margins)
        return PairTerms(losses, beta * (pc - rc), beta * (pr - rr), logps=(pc, pr))
