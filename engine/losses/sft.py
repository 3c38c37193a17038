"""SFT: the chosen sequence's NLL alone. No pair term; its rewards are the mean log-probs,
so an SFT run still reports how often it prefers the chosen response."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.losses.base import LossSettings, PairLogps, PairTerms


@dataclass(frozen=True)
class Sft(LossSettings):
    kind = "sft"
    summary = "sft (NLL on the chosen sequence only)"

    def terms(self, lp: PairLogps) -> PairTerms:
        return PairTerms(mx.zeros_like(lp.chosen), lp.chosen, lp.rejected)
