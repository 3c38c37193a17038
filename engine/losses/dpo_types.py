"""DPO's loss types (``dpo_loss_type``), one function each, as TRL's DPOTrainer
``dpo_loss``: per-pair losses [B] from the policy's and the reference's log-probs.

With S the policy's log-probs of the chosen (w) and rejected (r) responses, R the
reference's, β the strength and ε the label smoothing (engine/losses/dpo.py picks summed or,
for ipo, length-averaged log-probs, as TRL does):
    z = (Sw − Sr) − (Rw − Rr),   ρw = Sw − Rw,   ρr = Sr − Rr
sigmoid    −(1−ε)·log σ(βz) − ε·log σ(−βz)                 Rafailov et al. 2023, Eq. 7
robust     (−(1−ε)·log σ(βz) + ε·log σ(−βz)) / (1 − 2ε)    Chowdhury et al. 2024 (rDPO)
exo_pair   σ(βz)·(log σ(βz) − log(1−ε)) + σ(−βz)·(log σ(−βz) − log ε), ε = 1e-3 if 0
                                                          Ji et al. 2024 (EXO), Eq. 16
hinge      max(0, 1 − βz)                                  Zhao et al. 2023 (SLiC)
ipo        (z − 1/(2β))²                                   Azar et al. 2023, Eq. 17
sppo_hard  (ρw − 1/(2β))² + (ρr + 1/(2β))²                 Wu et al. 2024 (SPPO), Eq. 4.7,
                                                          winner's P = 1, loser's 0
nca_pair   −log σ(βρw) − ½·log σ(−βρw) − ½·log σ(−βρr)     Chen et al. 2024 (NCA)
aot_pair   sigmoid's on δ = sort(ρw) − sort(ρr)            Melnyk et al. 2024 (AOT)
aot        sigmoid's on δ = sort(Sw − Sr) − sort(Rw − Rr)  Melnyk et al. 2024 (AOT)
apo_zero   (1 − σ(βρw)) + σ(βρr)                           D'Oosterlinck et al. 2024, Eq. 7
apo_down   σ(βρw) + (1 − σ(β(ρw − ρr)))                    D'Oosterlinck et al. 2024, Eq. 8
discopop   −log σ(βz)·(1 − m) + exp(−βz)·m, m = σ(βz/τ)    Lu et al. 2024 (DiscoPOP), Eq. 5
The sorts run over the micro-batch, as TRL's over its per-device batch. ``bco_pair`` needs a
running mean of the rewards across steps (TRL's RunningMoments): refused (dpo.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.losses.base import smoothed_sigmoid

EXO_EPS = 1e-3  # TRL's label smoothing for exo_pair when none is given (log 0 otherwise)


@dataclass(frozen=True)
class Margins:
    """One micro-batch's log-probs [B] as a type reads them: the policy's (chosen, rejected)
    and the reference's, and the type's settings."""

    chosen: mx.array
    rejected: mx.array
    ref_chosen: mx.array
    ref_rejected: mx.array
    beta: float
    smoothing: float
    tau: float

    @property
    def z(self) -> mx.array:
        return (self.chosen - self.rejected) - (self.ref_chosen - self.ref_rejected)

    @property
    def chosen_ratio(self) -> mx.array:
        return self.chosen - self.ref_chosen

    @property
    def rejected_ratio(self) -> mx.array:
        return self.rejected - self.ref_rejected


def _sigmoid(m: Margins) -> mx.array:
    return smoothed_sigmoid(m.beta * m.z, m.smoothing)


def _robust(m: Margins) -> mx.array:
    x, eps = m.beta * m.z, m.smoothing
    return (-(1 - eps) * nn.log_sigmoid(x) + eps * nn.log_sigmoid(-x)) / (1 - 2 * eps)


def _exo_pair(m: Margins) -> mx.array:
    x, eps = m.beta * m.z, m.smoothing or EXO_EPS
    return (mx.sigmoid(x) * (nn.log_sigmoid(x) - math.log(1 - eps))
            + mx.sigmoid(-x) * (nn.log_sigmoid(-x) - math.log(eps)))


def _hinge(m: Margins) -> mx.array:
    return mx.maximum(1 - m.beta * m.z, 0.0)


def _ipo(m: Margins) -> mx.array:
    return (m.z - 1.0 / (2.0 * m.beta)) ** 2


def _sppo_hard(m: Margins) -> mx.array:
    half = 0.5 / m.beta
    return (m.chosen_ratio - half) ** 2 + (m.rejected_ratio + half) ** 2


def _nca_pair(m: Margins) -> mx.array:
    w, r = m.beta * m.chosen_ratio, m.beta * m.rejected_ratio
    return -nn.log_sigmoid(w) - 0.5 * nn.log_sigmoid(-w) - 0.5 * nn.log_sigmoid(-r)


def _aot_pair(m: Margins) -> mx.array:
    delta = mx.sort(m.chosen_ratio) - mx.sort(m.rejected_ratio)
    return smoothed_sigmoid(m.beta * delta, m.smoothing)


def _aot(m: Margins) -> mx.array:
    delta = mx.sort(m.chosen - m.rejected) - mx.sort(m.ref_chosen - m.ref_rejected)
    return smoothed_sigmoid(m.beta * delta, m.smoothing)


def _apo_zero(m: Margins) -> mx.array:
    return (1 - mx.sigmoid(m.beta * m.chosen_ratio)) + mx.sigmoid(m.beta * m.rejected_ratio)


def _apo_down(m: Margins) -> mx.array:
    return (mx.sigmoid(m.beta * m.chosen_ratio)
            + (1 - mx.sigmoid(m.beta * (m.chosen_ratio - m.rejected_ratio))))


def _discopop(m: Margins) -> mx.array:
    x = m.beta * m.z
    modulation = mx.sigmoid(x / m.tau)
    # exp(−x)·m as exp(−x + log m): the same value, finite where exp(−x) alone overflows
    # float32 while m is 0 there (0·inf would be NaN)
    return -nn.log_sigmoid(x) * (1 - modulation) + mx.exp(-x + nn.log_sigmoid(x / m.tau))


LOSS_TYPES: dict[str, Callable[[Margins], mx.array]] = {
    "sigmoid": _sigmoid, "ipo": _ipo, "hinge": _hinge, "robust": _robust,
    "exo_pair": _exo_pair, "nca_pair": _nca_pair, "sppo_hard": _sppo_hard, "aot": _aot,
    "aot_pair": _aot_pair, "apo_zero": _apo_zero, "apo_down": _apo_down,
    "discopop": _discopop}
SMOOTHED = ("sigmoid", "robust", "exo_pair", "aot", "aot_pair")  # the types that read ε
NEEDS_STATE = {"bco_pair": "a running mean of the rewards across steps (TRL's "
                           "RunningMoments), state a Pomona loss does not keep"}
