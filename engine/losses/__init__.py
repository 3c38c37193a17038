"""The losses, one file each under one protocol (engine/losses/base.py): the preference
losses over pairs, ORPO (Hong et al. 2024), SimPO (Meng et al. 2024), DPO (Rafailov et al.
2023; IPO, Azar et al. 2023), CPO (Xu et al. 2024), KTO (Ethayarajh et al. 2024) and SFT; and
the group losses over sampled completions (engine/losses/group.py), GRPO's family.

This registry is the one place that lists them. Adding a loss is one module holding a
``LossSettings`` subclass (its fields, rules, extras and maths) and its line in
``REGISTRY``; the trainer, CLI, sweep spec, scoring and adapters read the rest from it.
"""

from __future__ import annotations

from typing import Any

from engine.losses.base import (
    LOGP_CEILING,
    LossSettings,
    Norms,
    PairLogps,
    PairTerms,
    log1mexp,
    mean_logps,
    pair_logps,
)
from engine.losses.cpo import Cpo
from engine.losses.dpo import Dpo
from engine.losses.grpo import Grpo
from engine.losses.kto import Kto
from engine.losses.orpo import Orpo, orpo_pair_terms
from engine.losses.sft import Sft
from engine.losses.simpo import Simpo
from engine.losses.spec import (
    NLL_SPANS,
    LossSpec,
    pair_loss,
    per_pair_losses,
    validation_metrics,
)

REGISTRY: tuple[type[LossSettings], ...] = (Orpo, Simpo, Sft, Dpo, Cpo, Kto, Grpo)

LOSSES: dict[str, type[LossSettings]] = {cls.kind: cls for cls in REGISTRY}
# The losses over preference pairs (what pair data, score, the board and sweeps train on);
# the others train on sampled groups (engine/train/grpo_trainer.py).
PAIR_LOSSES: dict[str, type[LossSettings]] = {
    k: cls for k, cls in LOSSES.items() if not cls.on_groups}
# Each loss field's name -> the losses that read it: one loss's own (``orpo_lambda``), or
# the sampling settings every loss that samples shares (engine/losses/sampled.py).
READERS: dict[str, tuple[type[LossSettings], ...]] = {
    f: tuple(cls for cls in REGISTRY if f in cls.names())
    for f in dict.fromkeys(f for cls in REGISTRY for f in cls.names())}
# Each loss field's name -> the loss that declares its help and type (a shared sampling
# setting's: grpo's, the loss that always reads it).
OWNERS: dict[str, type[LossSettings]] = {f: readers[-1] for f, readers in READERS.items()}


# Validation metrics every loss reports on one scale: what trials of different losses are
# ranked on (val/loss and the reward values are each loss's own: λ·ℓ for ORPO, β·ℓ for
# SimPO, ℓ for SFT). Without DPO, which response wins, rewards/accuracies, is the same for
# all, and logps/* are mean log-probs; DPO's rewards are relative to its reference and its
# logps summed (TRL's), so a search with DPO ranks on logps/accuracies, logps/margin or
# nll_loss.
ACROSS_LOSSES = ("val/logps/accuracies", "val/logps/margin", "val/nll_loss")
ACROSS_NON_REFERENCE_LOSSES = (*ACROSS_LOSSES, "val/rewards/accuracies",
                               "val/logps/chosen", "val/logps/rejected")


def shared_metrics(losses: set[str]) -> tuple[str, ...]:
    """The validation metrics trials of ``losses`` are ranked on together."""
    same = all(LOSSES[k].mean_rewards for k in losses if k in LOSSES)
    return ACROSS_NON_REFERENCE_LOSSES if same else ACROSS_LOSSES


def loss_named(kind: str, **fields: Any) -> LossSettings:
    """The settings of loss ``kind`` with ``fields`` (ValueError naming a bad one)."""
    if kind not in LOSSES:
        raise ValueError(f"loss={kind!r}: expected one of {tuple(LOSSES)}")
    cls = LOSSES[kind]
    foreign = sorted(set(fields) - set(cls.names()))
    if foreign:
        raise ValueError(foreign_message(foreign[0], kind))
    return cls(**fields)


def foreign_message(name: str, kind: str) -> str:
    """Why field ``name`` cannot be set on a run of loss ``kind``."""
    readers = READERS.get(name)
    if readers is None:
        return f"{name}: not a loss setting"
    if len(readers) == 1:
        return f"{name}: a setting of loss {readers[0].kind}, and this run's loss is {kind}"
    pairs = ", ".join(r.kind for r in readers if not r.on_groups)
    if len(pairs.split(", ")) == len(readers):  # ``pairs`` itself
        return f"{name}: a setting of losses {pairs}, and this run's loss is {kind}"
    return (f"{name}: a setting of loss grpo, and of {pairs} with pairs: online; this "
            f"run's loss is {kind}")


def spec_of(kind: str = "orpo", nll_span: str = "full", **fields: Any) -> LossSpec:
    """A ``LossSpec`` from a loss name, the NLL's span and that loss's fields."""
    return LossSpec(loss_named(kind, **fields), nll_span)


__all__ = ["ACROSS_LOSSES", "ACROSS_NON_REFERENCE_LOSSES", "LOGP_CEILING", "LOSSES", "NLL_SPANS",
           "OWNERS", "PAIR_LOSSES", "READERS", "REGISTRY", "Dpo", "Grpo", "LossSettings",
           "LossSpec", "Norms", "Orpo", "PairLogps", "PairTerms", "Sft", "Simpo",
           "foreign_message", "log1mexp", "loss_named", "mean_logps", "orpo_pair_terms",
           "pair_logps", "pair_loss", "per_pair_losses", "shared_metrics", "spec_of",
           "validation_metrics"]
