"""Preference losses on per-token log-probabilities: ORPO (Hong et al. 2024), SimPO (Meng
et al. 2024), DPO (Rafailov et al. 2023; IPO, Azar et al. 2023) and SFT, behind one
interface.

Conventions (DESIGN.md, = TRL's ORPOTrainer and CPOTrainer):
- ℓw, ℓr: per-token MEAN log-prob over response tokens only (ORPO Eq. 4's length-
  normalised likelihood; SimPO's β/|y|·log π(y) is β·ℓ);
- a pair loss maps (ℓw, ℓr) [B] → per-pair losses and rewards [B] (``PairTerms``), as
  torchtune's DPO-family losses do; ``pair_loss`` is the one wrapper that applies masks and
  normalisers, adds the NLL term and names the metrics (TRL's names);
- ORPO: log_odds = (ℓw − ℓr) − (log1mexp(ℓw) − log1mexp(ℓr))   (Eq. 5, odds ratio);
  L = NLL + λ·mean(−log σ(log_odds))                              (Eq. 6–7);
- SimPO: L = w·NLL + mean(−log σ(β·(ℓw − ℓr) − γ))               (SimPO Eq. 6; w > 0 is
  CPO's NLL term, TRL's ``cpo_alpha``);
- DPO (= TRL's DPOTrainer, reference log-probs precomputed): SUMMED response log-probs
  Sw, Sr (TRL's convention; IPO's are length-averaged, as TRL's), their reference values
  Rw, Rr (engine/reference.py); z = (Sw − Sr) − (Rw − Rr);
  sigmoid: L = mean(−(1−ε)·log σ(βz) − ε·log σ(−βz))  (Eq. 7; ε = label smoothing, cDPO);
  ipo:     L = mean((z − 1/(2β))²)                     (IPO Eq. 17);
  rewards β·(S − R); the NLL term is TRL's ``rpo_alpha`` (its span: nll_span response);
- every loss also reports ``logps/accuracies``, the share of pairs whose chosen MEAN
  response log-prob beats the rejected one's, and ``logps/margin``, the mean ℓw − ℓr: one
  scale for all (what sweeps over losses rank on; DPO's ``rewards/accuracies`` is relative
  to its reference, its ``logps/*`` summed);
- NLL: token-mean cross-entropy of the chosen sequence over ``nll_span`` = "full"
  (prompt + response) or "response" (the official code's ``--disable_prompt_loss``).

SFT is the NLL alone (its rewards the mean log-probs). Adding a loss: one ``PairTerms``
function of ``PairLogps`` in PAIR_LOSSES, its NLL weight in ``nll_weight`` and its fields
in LossSpec; the segmented backward, head and prefix code see only the scalar loss of the
token log-probs.

Reductions are sums divided by normalisers of the *whole* optimizer batch, so gradient
accumulation over micro-batches adds up to exactly the one-big-batch loss.
Names: λ is our ``orpo_lambda``, TRL's ORPO ``beta`` and the official code's ``alpha``;
SimPO's β and γ are ``simpo_beta`` and ``simpo_gamma`` (TRL's CPO ``beta``, ``simpo_gamma``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

LN2 = math.log(2.0)
# Largest float32 below 0: keeps log1mexp finite when a mean log-prob rounds to 0.
LOGP_CEILING = -1.1920929e-07


def log1mexp(x: mx.array) -> mx.array:
    """log(1 − exp(x)) for x < 0, stable in float32 (Mächler 2012: branch at −ln 2)."""
    x = mx.minimum(x, LOGP_CEILING)
    return mx.where(x > -LN2, mx.log(-mx.expm1(x)), mx.log1p(-mx.exp(x)))


@dataclass(frozen=True)
class Norms:
    """Normalisers of one optimizer batch: NLL tokens and preference pairs in it."""

    nll_tokens: float
    pairs: float


# Defaults, written once: ORPO's λ as TRL; SimPO's β and γ as the paper's Llama-3 base
# settings (β = 2, γ/β = 0.5); its NLL weight 0 (pure SimPO); DPO's β, label smoothing
# and rpo_alpha (0 = off, TRL's None) as TRL's.
ORPO_LAMBDA, SIMPO_BETA, SIMPO_GAMMA, SIMPO_NLL_WEIGHT = 0.1, 2.0, 1.0, 0.0
DPO_BETA, DPO_LABEL_SMOOTHING, RPO_ALPHA = 0.1, 0.0, 0.0
LOSSES = ("orpo", "simpo", "sft", "dpo")
DPO_LOSS_TYPES = ("sigmoid", "ipo")
REFERENCE_LOSSES = ("dpo",)  # losses that read reference log-probs (engine/reference.py)


@dataclass(frozen=True)
class LossSpec:
    """Which loss to compute (``kind`` one of LOSSES; sft = NLL only) and its weights."""

    kind: str = "orpo"
    orpo_lambda: float = ORPO_LAMBDA
    nll_span: str = "full"
    simpo_beta: float = SIMPO_BETA
    simpo_gamma: float = SIMPO_GAMMA
    simpo_nll_weight: float = SIMPO_NLL_WEIGHT
    dpo_beta: float = DPO_BETA
    dpo_label_smoothing: float = DPO_LABEL_SMOOTHING
    dpo_loss_type: str = "sigmoid"
    rpo_alpha: float = RPO_ALPHA

    def __post_init__(self) -> None:
        if self.kind not in LOSSES:
            raise ValueError(f"loss kind={self.kind!r}: expected one of {LOSSES}")
        if self.nll_span not in ("full", "response"):
            raise ValueError(f"nll_span={self.nll_span!r}: expected 'full' or 'response'")
        if self.dpo_loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"dpo_loss_type={self.dpo_loss_type!r}: expected one of "
                             f"{DPO_LOSS_TYPES}")
        if not (math.isfinite(self.dpo_beta) and self.dpo_beta > 0):
            raise ValueError(f"dpo_beta={self.dpo_beta}: must be a number > 0")
        if not 0 <= self.dpo_label_smoothing < 0.5:  # 0.5 makes the loss symmetric: no signal
            raise ValueError(f"dpo_label_smoothing={self.dpo_label_smoothing}: must be in "
                             "[0, 0.5)")

    @property
    def needs_reference(self) -> bool:
        return self.kind in REFERENCE_LOSSES


@dataclass(frozen=True)
class PairLogps:
    """One micro-batch's per-pair log-probs [B] (float32), what a pair loss reads.

    chosen, rejected: mean response log-probs ℓw, ℓr; chosen_sum, rejected_sum: summed
    (DPO's); chosen_tokens, rejected_tokens: response token counts; ref_chosen,
    ref_rejected: the reference model's summed log-probs (None without a reference).
    """

    chosen: mx.array
    rejected: mx.array
    chosen_sum: mx.array
    rejected_sum: mx.array
    chosen_tokens: mx.array
    rejected_tokens: mx.array
    ref_chosen: mx.array | None = None
    ref_rejected: mx.array | None = None


def pair_logps(token_logps: mx.array, resp_mask: mx.array, ref: mx.array | None = None
               ) -> PairLogps:
    """``PairLogps`` of a [2B, T] batch (rows 0..B−1 chosen) and its reference [2B] or None."""
    token_logps = token_logps.astype(mx.float32)
    sums = (token_logps * resp_mask).sum(axis=-1)
    counts = mx.maximum(resp_mask.sum(axis=-1), 1.0)
    means = sums / counts
    b = token_logps.shape[0] // 2
    refs = (None, None) if ref is None else (ref[:b].astype(mx.float32),
                                            ref[b:].astype(mx.float32))
    return PairLogps(means[:b], means[b:], sums[:b], sums[b:], counts[:b], counts[b:], *refs)


@dataclass(frozen=True)
class PairTerms:
    """A pair loss's per-pair outputs [B]: the loss, both rewards, and extra metrics."""

    losses: mx.array
    chosen_rewards: mx.array
    rejected_rewards: mx.array
    extra: dict[str, mx.array] = field(default_factory=dict)
    logps: tuple[mx.array, mx.array] | None = None  # reported as logps/*; None: the means


def mean_logps(token_logps: mx.array, mask: mx.array) -> mx.array:
    """Per-row mean of ``token_logps`` [N, T] over ``mask`` [N, T] → [N] (float32)."""
    return (token_logps * mask).sum(axis=-1) / mx.maximum(mask.sum(axis=-1), 1.0)


def orpo_pair_terms(lw: mx.array, lr: mx.array) -> tuple[mx.array, mx.array]:
    """Per pair: (log_odds, log σ(log_odds)) from mean log-probs ℓw, ℓr [B] (Eq. 5–6)."""
    lw, lr = lw.astype(mx.float32), lr.astype(mx.float32)
    log_odds = (lw - lr) - (log1mexp(lw) - log1mexp(lr))
    return log_odds, nn.log_sigmoid(log_odds)


def orpo(lp: PairLogps, spec: LossSpec) -> PairTerms:
    """ORPO's odds-ratio term, λ·(−log σ(log_odds)) (Eq. 7); rewards λ·ℓ as TRL's."""
    log_odds, log_sig = orpo_pair_terms(lp.chosen, lp.rejected)
    lam = spec.orpo_lambda
    return PairTerms(-lam * log_sig, lam * lp.chosen, lam * lp.rejected,
                     {"log_odds_ratio": log_sig, "log_odds_chosen": log_odds})


def simpo(lp: PairLogps, spec: LossSpec) -> PairTerms:
    """SimPO, −log σ(β·ℓw − β·ℓr − γ) (Eq. 6); rewards β·ℓ as TRL's CPOTrainer."""
    chosen, rejected = spec.simpo_beta * lp.chosen, spec.simpo_beta * lp.rejected
    return PairTerms(-nn.log_sigmoid(chosen - rejected - spec.simpo_gamma), chosen, rejected)


def sft(lp: PairLogps, spec: LossSpec) -> PairTerms:
    """No pair term; rewards are the mean log-probs themselves, so an SFT run still
    reports how often it prefers the chosen response (rewards/accuracies)."""
    return PairTerms(mx.zeros_like(lp.chosen), lp.chosen, lp.rejected)


def dpo(lp: PairLogps, spec: LossSpec) -> PairTerms:
    """DPO against precomputed reference log-probs, as TRL's ``dpo_loss``: sigmoid (Eq. 7,
    with cDPO's label smoothing) on summed log-probs, or IPO (Eq. 17) on length-averaged
    ones (TRL divides both policy and reference by the response length for IPO)."""
    if lp.ref_chosen is None or lp.ref_rejected is None:
        raise ValueError("loss dpo needs reference log-probs (engine/reference.py): none "
                         "were attached to this batch")
    if spec.dpo_loss_type == "ipo":
        pc, pr = lp.chosen, lp.rejected
        rc, rr = lp.ref_chosen / lp.chosen_tokens, lp.ref_rejected / lp.rejected_tokens
    else:
        pc, pr, rc, rr = lp.chosen_sum, lp.rejected_sum, lp.ref_chosen, lp.ref_rejected
    z = (pc - pr) - (rc - rr)
    beta = spec.dpo_beta
    if spec.dpo_loss_type == "ipo":
        losses = (z - 1.0 / (2.0 * beta)) ** 2
    else:
        eps = spec.dpo_label_smoothing
        losses = -(1 - eps) * nn.log_sigmoid(beta * z) - eps * nn.log_sigmoid(-beta * z)
    return PairTerms(losses, beta * (pc - rc), beta * (pr - rr), logps=(pc, pr))


PAIR_LOSSES: dict[str, Callable[[PairLogps, LossSpec], PairTerms]] = {
    "orpo": orpo, "simpo": simpo, "sft": sft, "dpo": dpo}


def nll_weight(spec: LossSpec) -> float:
    """The NLL term's weight: ORPO's and SFT's are 1 by definition, SimPO's and DPO's
    (TRL's rpo_alpha) a choice."""
    return {"simpo": spec.simpo_nll_weight, "dpo": spec.rpo_alpha}.get(spec.kind, 1.0)


def pair_loss(
    token_logps: mx.array,
    resp_mask: mx.array,
    nll_mask: mx.array,
    spec: LossSpec,
    norms: Norms,
    ref: mx.array | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """Loss of one micro-batch and its summed metrics (TRL's names).

    token_logps, resp_mask, nll_mask: [2B, T], rows 0..B−1 chosen, B..2B−1 rejected;
    ``nll_mask`` marks the chosen rows' NLL span (zero on rejected rows); ``ref``: [2B]
    summed reference log-probs, same row order (DPO; None for the others).
    Returns the micro-batch's share of the batch loss and per-pair metric *sums*
    (divide by ``norms.pairs`` for batch means; ``nll_sum`` by ``norms.nll_tokens``).
    """
    token_logps = token_logps.astype(mx.float32)
    nll_sum = -(token_logps * nll_mask).sum()
    loss = nll_weight(spec) * nll_sum / norms.nll_tokens
    lp = pair_logps(token_logps, resp_mask, ref)
    terms = PAIR_LOSSES[spec.kind](lp, spec)
    loss = loss + terms.losses.sum() / norms.pairs
    return loss, {"nll_sum": nll_sum, **logp_metrics(lp, terms), **reward_metrics(terms)}


def logp_metrics(lp: PairLogps, terms: PairTerms) -> dict[str, mx.array]:
    """logps/chosen and logps/rejected (the loss's own: means, DPO's sums) and two
    loss-independent figures on mean log-probs: logps/accuracies (ℓw > ℓr) and
    logps/margin (ℓw − ℓr), summed."""
    chosen, rejected = terms.logps or (lp.chosen, lp.rejected)
    return {"logps/chosen": chosen.sum(), "logps/rejected": rejected.sum(),
            "logps/accuracies": (lp.chosen > lp.rejected).astype(mx.float32).sum(),
            "logps/margin": (lp.chosen - lp.rejected).sum()}


def validation_metrics(spec: LossSpec) -> list[str]:
    """The ``val/*`` names a validation under ``spec`` reports (engine.scoring.evaluate),
    read off one pair through ``pair_loss``: a new loss's extras are in by construction."""
    lp = mx.full((2, 2), -1.0)
    nll = mx.array([[1.0, 1.0], [0.0, 0.0]])
    _, metrics = pair_loss(lp, mx.ones((2, 2)), nll, spec, Norms(nll_tokens=2.0, pairs=1.0),
                           mx.full((2,), -2.0))
    return sorted(f"val/{k}" for k in {"loss", "nll_loss", "rows", *metrics} - {"nll_sum"})


def reward_metrics(terms: PairTerms) -> dict[str, mx.array]:
    """TRL's reward metrics, and the loss's extras, summed over the pairs."""
    chosen, rejected = terms.chosen_rewards, terms.rejected_rewards
    return {"rewards/chosen": chosen.sum(), "rewards/rejected": rejected.sum(),
            "rewards/accuracies": (chosen > rejected).astype(mx.float32).sum(),
            "rewards/margins": (chosen - rejected).sum(),
            **{k: v.sum() for k, v in terms.extra.items()}}


def per_pair_losses(lp: PairLogps, nll: mx.array, spec: LossSpec
                    ) -> tuple[mx.array, PairTerms]:
    """Each pair's own loss [B] (its NLL mean weighted, plus its pair term) for scoring:
    the batch loss of ``pair_loss`` with every pair alone."""
    terms = PAIR_LOSSES[spec.kind](lp, spec)
    return nll_weight(spec) * nll + terms.losses, terms
