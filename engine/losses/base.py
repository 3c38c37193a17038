"""The loss protocol: what every preference loss reads (``PairLogps``), returns
(``PairTerms``) and is configured by (a ``LossSettings`` subclass, one per loss file).

A loss is one module of this package holding one frozen ``LossSettings`` subclass: its
``kind`` (the name a spec, the CLI and an adapter's config give), its fields (each a
user-facing option: ``--orpo-lambda``, a spec's ``orpo_lambda``; ``setting`` gives its
default and help), its rules (``check``), the names of its extra metrics (``extras``),
its NLL weight and its maths (``terms``: per-pair losses and rewards from per-pair
log-probs, as torchtune's DPO-family losses are written). Nothing else in the engine
knows which losses exist but the registry (engine/losses/__init__.py).

Conventions (docs/design.md, = TRL's trainers): ℓw, ℓr are per-token MEAN response log-probs
(ORPO Eq. 4's length-normalised likelihood); ``*_sum`` the summed ones (DPO's, CPO's);
reference log-probs are summed (engine/train/reference.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import cache
from typing import Any, ClassVar, get_type_hints

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


@dataclass(frozen=True)
class PairLogps:
    """One micro-batch's per-pair log-probs [B] (float32), what a pair loss reads.

    chosen, rejected: mean response log-probs ℓw, ℓr; chosen_sum, rejected_sum: summed;
    chosen_tokens, rejected_tokens: response token counts; ref_chosen, ref_rejected: the
    reference model's summed log-probs (None without a reference); kl: the batch's KL
    reference point, a detached scalar (KTO's z0; None for a loss that reads none);
    labels: unpaired rows' (KTO's own data: engine/data/unpaired.py), 1 where the row's
    completion (the first branch) is desirable, 0 where not, the second branch its KL
    partner; None for pairs.
    """

    chosen: mx.array
    rejected: mx.array
    chosen_sum: mx.array
    rejected_sum: mx.array
    chosen_tokens: mx.array
    rejected_tokens: mx.array
    ref_chosen: mx.array | None = None
    ref_rejected: mx.array | None = None
    kl: mx.array | None = None
    labels: mx.array | None = None


def pair_logps(token_logps: mx.array, resp_mask: mx.array, ref: mx.array | None = None,
               kl: mx.array | None = None, labels: mx.array | None = None) -> PairLogps:
    """``PairLogps`` of a [2B, T] batch (rows 0..B−1 chosen), its reference [2B] or None,
    its KL reference point or None and its unpaired rows' labels [B] or None."""
    token_logps = token_logps.astype(mx.float32)
    sums = (token_logps * resp_mask).sum(axis=-1)
    counts = mx.maximum(resp_mask.sum(axis=-1), 1.0)
    means = sums / counts
    b = token_logps.shape[0] // 2
    refs = (None, None) if ref is None else (ref[:b].astype(mx.float32),
                                            ref[b:].astype(mx.float32))
    return PairLogps(means[:b], means[b:], sums[:b], sums[b:], counts[:b], counts[b:], *refs,
                     kl=kl, labels=labels)


def mean_logps(token_logps: mx.array, mask: mx.array) -> mx.array:
    """Per-row mean of ``token_logps`` [N, T] over ``mask`` [N, T] → [N] (float32)."""
    return (token_logps * mask).sum(axis=-1) / mx.maximum(mask.sum(axis=-1), 1.0)


@dataclass(frozen=True)
class PairTerms:
    """A pair loss's per-pair outputs [B]: the loss, both rewards, and extra metrics."""

    losses: mx.array
    chosen_rewards: mx.array
    rejected_rewards: mx.array
    extra: dict[str, mx.array] = field(default_factory=dict)
    logps: tuple[mx.array, mx.array] | None = None  # reported as logps/*; None: the means


def smoothed_sigmoid(x: mx.array, eps: float) -> mx.array:
    """−(1−ε)·log σ(x) − ε·log σ(−x): the sigmoid preference loss of a scaled margin x with
    a share ε of labels assumed flipped (cDPO's conservative loss; ε = 0: −log σ(x))."""
    return -(1 - eps) * nn.log_sigmoid(x) - eps * nn.log_sigmoid(-x)


def check_smoothing(name: str, eps: float, loss_type: str, smoothed: tuple[str, ...]) -> None:
    """ValueError naming ``name`` unless 0 ≤ ε < 0.5, and 0 for a loss type without it."""
    if not 0 <= eps < 0.5:  # 0.5: both labels equally likely, no signal
        raise ValueError(f"{name}={eps}: must be in [0, 0.5) (0.5 makes both labels equally "
                         "likely: no signal)")
    if eps and loss_type not in smoothed:
        raise ValueError(f"{name}={eps} with loss type {loss_type}: it has no label "
                         "smoothing; drop one of them")


# β ≥ this keeps IPO's target margin 1/(2β) ≤ 5e5 nats a token, beyond any margin of mean
# log-probs, with the loss (≤ ~2.5e11) and its gradient far inside float32, also squared in
# the grad norm; β = 1e-30 made the first step's loss inf.
IPO_MIN_BETA = 1e-6


def check_ipo_beta(name: str, beta: float, loss_type: str) -> None:
    """ValueError naming ``name`` when loss type ipo's target margin 1/(2β) is out of reach."""
    if loss_type == "ipo" and beta < IPO_MIN_BETA:
        raise ValueError(f"{name}={beta:g} with loss type ipo: its target margin 1/(2β) = "
                         f"{1 / (2 * beta):.3g} cannot be trained on in float32; use "
                         f"{name} >= {IPO_MIN_BETA:g}")


def setting(default: Any, help: str, **rules: Any) -> Any:
    """A loss field: its default, its help (the CLI's) and its rules, checked by
    ``LossSettings``: ``minimum`` (≥), ``above`` (>), ``below`` (<), ``choices``."""
    return field(default=default, metadata={"help": help, **rules})


def label_smoothing(what: str) -> Any:
    """A loss's label-smoothing field ε (TRL's ``label_smoothing``, cDPO), 0 by default;
    its rule, 0 ≤ ε < 0.5 and only on a loss type that smooths, is ``check_smoothing``."""
    return setting(0.0, f"{what}: the share of labels assumed flipped (TRL's "
                        "label_smoothing), in [0, 0.5).")


@dataclass(frozen=True)
class LossSettings:
    """One loss's settings, valid by construction (a bad field is a ValueError naming it)."""

    kind: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line for --loss's help
    needs_reference: ClassVar[bool] = False  # reads reference log-probs (engine/train/reference.py)
    # Reads a KL reference point: each pair's mismatched partner (its prompt, the previous
    # pair's responses: engine/train/reference.kl_partners) under the policy and the reference.
    needs_kl: ClassVar[bool] = False
    extras: ClassVar[tuple[str, ...]] = ()  # the names of PairTerms.extra it reports
    # Its rewards order pairs as mean log-probs do and its logps/* are means (ORPO's λ·ℓ,
    # SimPO's β·ℓ): trials of such losses rank on one scale (engine/losses: shared_metrics).
    mean_rewards: ClassVar[bool] = True
    # Trains on groups of sampled completions of prompt rows (engine/losses/group.py), not
    # on pairs: the trainer, the data it reads and what scores it differ.
    on_groups: ClassVar[bool] = False

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if "items" in f.metadata and isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))  # as JSON reads
            elif "items" in f.metadata and isinstance(value, str) and f.metadata["items"] is str:
                object.__setattr__(self, f.name, (value,))  # one name (an older config's)
        for f in dataclasses.fields(self):
            _check_field(f, hints[f.name], getattr(self, f.name))
        self.check()

    def check(self) -> None:
        """Rules across this loss's fields (ValueError naming them); none by default."""

    @property
    def nll_weight(self) -> float:
        """The chosen NLL term's weight (ORPO's and SFT's 1 by definition)."""
        return 1.0

    def terms(self, lp: PairLogps) -> PairTerms:
        raise NotImplementedError(f"loss {self.kind} has no terms")

    def fields(self) -> dict[str, Any]:
        """This loss's fields by name (what an adapter's config records)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def field(cls, name: str) -> dataclasses.Field | None:
        """The field ``name`` of this loss (its default, help and rules), or None."""
        return next((f for f in dataclasses.fields(cls) if f.name == name), None)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Its fields' names (ClassVars are not fields)."""
        return tuple(f.name for f in dataclasses.fields(cls))


class AgainstReference(LossSettings):
    """A loss that reads reference log-probs R (DPO, KTO): its rewards β·(S − R) are
    relative to its reference on summed log-probs, not on the mean-log-prob scale."""

    needs_reference = True
    mean_rewards = False

    def references(self, lp: PairLogps) -> tuple[mx.array, mx.array]:
        """(Rw, Rr) of this batch (and its KL point where the loss reads one), or a
        ValueError naming the loss when they were not attached."""
        what = "reference log-probs and a KL point" if self.needs_kl else "reference log-probs"
        kl_missing = self.needs_kl and lp.kl is None and lp.labels is None  # unpaired: its own
        if lp.ref_chosen is None or lp.ref_rejected is None or kl_missing:
            raise ValueError(f"loss {self.kind} needs {what} (engine/train/reference.py): none "
                             "were attached to this batch")
        return lp.ref_chosen, lp.ref_rejected


@cache
def _hints(cls: type) -> dict[str, Any]:
    """A loss class's field types, read once (``get_type_hints`` evaluates them each call)."""
    return get_type_hints(cls)


def _check_field(f: dataclasses.Field, hint: Any, value: Any) -> None:
    rules = f.metadata
    if "items" in rules:  # a tuple of strings or numbers (GRPO's reward, its weights)
        _check_items(f.name, value, rules["items"])
        wrong = [v for v in value if "choices" in rules and v not in rules["choices"]]
        if wrong:
            raise ValueError(f"{f.name}={list(value)!r}: {wrong[0]!r} is not one of "
                             f"{rules['choices']}")
        return
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{f.name}={value!r}: expected a number")
        if not math.isfinite(value):
            raise ValueError(f"{f.name}={value!r}: must be a finite number")
    elif hint is str and not isinstance(value, str):
        raise ValueError(f"{f.name}={value!r}: expected a string")
    if "choices" in rules and value not in rules["choices"]:
        raise ValueError(f"{f.name}={value!r}: expected one of {rules['choices']}")
    if "minimum" in rules and value < rules["minimum"]:
        raise ValueError(f"{f.name}={value}: must be >= {rules['minimum']:g}")
    if "above" in rules and not value > rules["above"]:
        raise ValueError(f"{f.name}={value}: must be > {rules['above']:g} (0 trains nothing: "
                         "every update is zero)")
    if "below" in rules and not value < rules["below"]:
        raise ValueError(f"{f.name}={value}: must be below {rules['below']:g}")
    if "maximum" in rules and value > rules["maximum"]:
        raise ValueError(f"{f.name}={value}: must be <= {rules['maximum']:g}")


def _check_items(name: str, value: Any, kind: type) -> None:
    """A tuple field's items: strings, or finite numbers (not booleans)."""
    if not isinstance(value, tuple):
        raise ValueError(f"{name}={value!r}: expected a list")
    for item in value:
        ok = isinstance(item, str) and item.strip() if kind is str else (
            isinstance(item, int | float) and not isinstance(item, bool)
            and math.isfinite(item))
        if not ok:
            raise ValueError(f"{name}={list(value)!r}: {item!r} is not "
                             + ("a name" if kind is str else "a finite number"))
