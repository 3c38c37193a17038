"""Preference losses on per-token log-probabilities: ORPO (Hong et al. 2024), SimPO (Meng
et al. 2024) and SFT, behind one interface.

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
- NLL: token-mean cross-entropy of the chosen sequence over ``nll_span`` = "full"
  (prompt + response) or "response" (the official code's ``--disable_prompt_loss``).

SFT is the NLL alone (its rewards the mean log-probs). Adding a loss: one ``PairTerms``
function in PAIR_LOSSES, its NLL weight in ``nll_weight`` and its fields in LossSpec; the
segmented backward, head and prefix code see only the scalar loss of the token log-probs.

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
# settings (β = 2, γ/β = 0.5); its NLL weight 0 (pure SimPO).
ORPO_LAMBDA, SIMPO_BETA, SIMPO_GAMMA, SIMPO_NLL_WEIGHT = 0.1, 2.0, 1.0, 0.0
LOSSES = ("orpo", "simpo", "sft")


@dataclass(frozen=True)
class LossSpec:
    """Which loss to compute (``kind`` one of LOSSES; sft = NLL only) and its weights."""

    kind: str = "orpo"
    orpo_lambda: float = ORPO_LAMBDA
    nll_span: str = "full"
    simpo_beta: float = SIMPO_BETA
    simpo_gamma: float = SIMPO_GAMMA
    simpo_nll_weight: float = SIMPO_NLL_WEIGHT

    def __post_init__(self) -> None:
        if self.kind not in LOSSES:
            raise ValueError(f"loss kind={self.kind!r}: expected one of {LOSSES}")
        if self.nll_span not in ("full", "response"):
            raise ValueError(f"nll_span={self.nll_span!r}: expected 'full' or 'response'")


@dataclass(frozen=True)
class PairTerms:
    """A pair loss's per-pair outputs [B]: the loss, both rewards, and extra metrics."""

    losses: mx.array
    chosen_rewards: mx.array
    rejected_rewards: mx.array
    extra: dict[str, mx.array] = field(default_factory=dict)


def mean_logps(token_logps: mx.array, mask: mx.array) -> mx.array:
    """Per-row mean of ``token_logps`` [N, T] over ``mask`` [N, T] → [N] (float32)."""
    return (token_logps * mask).sum(axis=-1) / mx.maximum(mask.sum(axis=-1), 1.0)


def orpo_pair_terms(lw: mx.array, lr: mx.array) -> tuple[mx.array, mx.array]:
    """Per pair: (log_odds, log σ(log_odds)) from mean log-probs ℓw, ℓr [B] (Eq. 5–6)."""
    lw, lr = lw.astype(mx.float32), lr.astype(mx.float32)
    log_odds = (lw - lr) - (log1mexp(lw) - log1mexp(lr))
    return log_odds, nn.log_sigmoid(log_odds)


def orpo(lw: mx.array, lr: mx.array, spec: LossSpec) -> PairTerms:
    """ORPO's odds-ratio term, λ·(−log σ(log_odds)) (Eq. 7); rewards λ·ℓ as TRL's."""
    log_odds, log_sig = orpo_pair_terms(lw, lr)
    lam = spec.orpo_lambda
    return PairTerms(-lam * log_sig, lam * lw, lam * lr,
                     {"log_odds_ratio": log_sig, "log_odds_chosen": log_odds})


def simpo(lw: mx.array, lr: mx.array, spec: LossSpec) -> PairTerms:
    """SimPO, −log σ(β·ℓw − β·ℓr − γ) (Eq. 6); rewards β·ℓ as TRL's CPOTrainer."""
    lw, lr = lw.astype(mx.float32), lr.astype(mx.float32)
    chosen, rejected = spec.simpo_beta * lw, spec.simpo_beta * lr
    return PairTerms(-nn.log_sigmoid(chosen - rejected - spec.simpo_gamma), chosen, rejected)


def sft(lw: mx.array, lr: mx.array, spec: LossSpec) -> PairTerms:
    """No pair term; rewards are the mean log-probs themselves, so an SFT run still
    reports how often it prefers the chosen response (rewards/accuracies)."""
    return PairTerms(mx.zeros_like(lw), lw, lr)


PAIR_LOSSES: dict[str, Callable[[mx.array, mx.array, LossSpec], PairTerms]] = {
    "orpo": orpo, "simpo": simpo, "sft": sft}


def nll_weight(spec: LossSpec) -> float:
    """The NLL term's weight: ORPO's and SFT's are 1 by definition, SimPO's a choice."""
    return spec.simpo_nll_weight if spec.kind == "simpo" else 1.0


def pair_loss(
    token_logps: mx.array,
    resp_mask: mx.array,
    nll_mask: mx.array,
    spec: LossSpec,
    norms: Norms,
) -> tuple[mx.array, dict[str, mx.array]]:
    """Loss of one micro-batch and its summed metrics (TRL's names).

    token_logps, resp_mask, nll_mask: [2B, T], rows 0..B−1 chosen, B..2B−1 rejected;
    ``nll_mask`` marks the chosen rows' NLL span (zero on rejected rows).
    Returns the micro-batch's share of the batch loss and per-pair metric *sums*
    (divide by ``norms.pairs`` for batch means; ``nll_sum`` by ``norms.nll_tokens``).
    """
    token_logps = token_logps.astype(mx.float32)
    nll_sum = -(token_logps * nll_mask).sum()
    loss = nll_weight(spec) * nll_sum / norms.nll_tokens
    b = token_logps.shape[0] // 2
    logps = mean_logps(token_logps, resp_mask)
    lw, lr = logps[:b], logps[b:]
    metrics = {"nll_sum": nll_sum, "logps/chosen": lw.sum(), "logps/rejected": lr.sum()}
    terms = PAIR_LOSSES[spec.kind](lw, lr, spec)
    loss = loss + terms.losses.sum() / norms.pairs
    metrics.update(reward_metrics(terms))
    return loss, metrics


def validation_metrics(spec: LossSpec) -> list[str]:
    """The ``val/*`` names a validation under ``spec`` reports (engine.scoring.evaluate),
    read off one pair through ``pair_loss``: a new loss's extras are in by construction."""
    lp = mx.full((2, 2), -1.0)
    nll = mx.array([[1.0, 1.0], [0.0, 0.0]])
    _, metrics = pair_loss(lp, mx.ones((2, 2)), nll, spec, Norms(nll_tokens=2.0, pairs=1.0))
    return sorted(f"val/{k}" for k in {"loss", "nll_loss", "rows", *metrics} - {"nll_sum"})


def reward_metrics(terms: PairTerms) -> dict[str, mx.array]:
    """TRL's reward metrics, and the loss's extras, summed over the pairs."""
    chosen, rejected = terms.chosen_rewards, terms.rejected_rewards
    return {"rewards/chosen": chosen.sum(), "rewards/rejected": rejected.sum(),
            "rewards/accuracies": (chosen > rejected).astype(mx.float32).sum(),
            "rewards/margins": (chosen - rejected).sum(),
            **{k: v.sum() for k, v in terms.extra.items()}}


def per_pair_losses(lw: mx.array, lr: mx.array, nll: mx.array, spec: LossSpec
                    ) -> tuple[mx.array, PairTerms]:
    """Each pair's own loss [B] (its NLL mean weighted, plus its pair term) for scoring:
    the batch loss of ``pair_loss`` with every pair alone."""
    terms = PAIR_LOSSES[spec.kind](lw, lr, spec)
    return nll_weight(spec) * nll + terms.losses, terms
