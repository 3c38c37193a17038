"""One value of a sweep spec, checked as TrainConfig would take it: a parameter's name, a
grid value, a search-space dimension (tasks/sweep/spec_file.py reads the spec with these).

    check_value("learning_rate", "1e-4", "fixed")     # -> 0.0001 (YAML 1.1 kept a string)
    space_dist("lora_rank", {"choice": [8, 16]})      # -> Dist("choice", (8, 16))
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.losses import OWNERS
from engine.settings.config import TrainConfig, field_type
from tasks.sweep.spec_rules import SpecError
from tasks.sweep.trial_plan import AUTO, Auto, parse_auto

KINDS = ("choice", "uniform", "loguniform", "int")
# TrainConfig's fields and each loss's own settings (engine/losses/), by their flat names.
CONFIG_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)} | set(OWNERS)
FIELD_TYPES = {name: field_type(name) for name in CONFIG_FIELDS}
NOT_SWEPT = {"model", "data", "out", "resume",  # set by the sweep itself:
             "best_metric", "best_mode"}  # a trial's best is what the sweep ranks on


@dataclass(frozen=True)
class Dist:
    """One search-space dimension."""

    kind: str
    args: tuple

    def sample(self, rng: np.random.Generator) -> Any:
        if self.kind == "choice":
            return self.args[int(rng.integers(0, len(self.args)))]
        lo, hi = self.args
        if self.kind == "uniform":
            return float(rng.uniform(lo, hi))
        if self.kind == "loguniform":
            return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        return int(rng.integers(lo, hi + 1))


def check_param(name: str, where: str) -> None:
    """SpecError unless ``name`` is a training parameter a spec may set."""
    if name in NOT_SWEPT:
        raise SpecError(f"{where}.{name}: set by the sweep itself; remove it")
    if name not in CONFIG_FIELDS:
        raise SpecError(f"{where}.{name}: not a training parameter (see `pomona train "
                        "--help` for the names)")


def check_value(name: str, value: Any, where: str) -> Any:
    """``value`` checked as TrainConfig field ``name`` would take it (type, range, finite);
    a string that TrainConfig reads as a number (``1e-4``: YAML 1.1 keeps it a string) is
    returned as that number, so trials, ids and the results table hold the number."""
    if (auto := parse_auto(name, value)) is AUTO:
        return auto
    try:
        owner = OWNERS.get(name)  # a loss's own setting: checked on its loss
        config = TrainConfig(model="m", data="d", loss=owner.kind if owner else "orpo"
                             ).replace(**{name: value})
        config.validate()
    except (ValueError, TypeError) as err:
        message = str(err)
        raise SpecError(f"{where}.{message}" if message.startswith(f"{name}=") else
                        f"{where}.{name}={value!r}: {message}") from None
    plain = config.to_dict()  # a fixed pair loss's: without pairs (engine/losses/sampled.py)
    checked = plain[name] if name in plain else getattr(config.loss, name)
    return value if not isinstance(value, str) and checked == value else checked


def distinct(name: str, raw: list, values: list) -> list:
    """``values`` (grid.name's ``raw`` values, checked), refused when two are one value
    (``[8, 8.0, "8"]``): they would run one trial twice, under one id or two."""
    for i, value in enumerate(values):
        j = next((j for j in range(i) if values[j] == value), None)
        if j is not None:
            raise SpecError(f"grid.{name}: {raw[i]!r} repeats {raw[j]!r} (both are "
                            f"{value!r}); list each value once")
    return values


def space_dist(name: str, raw: Any) -> Dist:
    where = f"space.{name}"
    if not isinstance(raw, dict) or len(raw) != 1 or next(iter(raw)) not in KINDS:
        raise SpecError(f"{where}: expected one of {{{', '.join(KINDS)}: ...}}, got {raw!r}")
    kind, args = next(iter(raw.items()))
    if not isinstance(args, list) or not args:
        raise SpecError(f"{where}.{kind}: expected a non-empty list")
    if kind == "choice":
        return Dist(kind, tuple(check_value(name, v, f"{where}.choice") for v in args))
    if FIELD_TYPES[name] not in (int, float):
        raise SpecError(f"{where}.{kind}: {name} is not numeric; use choice: [...]")
    if kind != "int" and FIELD_TYPES[name] is int:
        raise SpecError(f"{where}.{kind}: {name} takes integers; use int: [low, high]")
    numbers = [number_of(a) for a in args]
    if len(args) != 2 or None in numbers:
        raise SpecError(f"{where}.{kind}: expected [low, high] numbers, got {args!r}")
    lo, hi = numbers
    if kind == "int" and not all(float(a).is_integer() for a in numbers):
        raise SpecError(f"{where}.int: bounds must be integers, got {args!r}")
    if not lo < hi or (kind == "loguniform" and lo <= 0):
        raise SpecError(f"{where}.{kind}: need 0 < low < high (log) or low < high")
    bounds = (int(lo), int(hi)) if kind == "int" else (lo, hi)
    for bound in bounds:  # the range is convex: both ends valid means every draw is
        check_value(name, bound, f"{where}.{kind}")
    return Dist(kind, bounds)


def number_of(value: Any) -> float | None:
    """A finite number from an int, float or numeric string (YAML 1.1: ``1e-4``), else None."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def pack_of(raw: Any, fixed: dict, grid: dict, space: dict) -> int | Auto:
    """A spec's ``pack``: an integer >= 1, or ``auto`` (which sets each pack's memory limit
    from ``memory_budget_gb``: a trial's own ``memory_limit_gb`` would split the two)."""
    if raw != "auto":
        number = number_of(raw)
        if number is None or number < 1 or not number.is_integer():
            raise SpecError(f"pack={raw!r}: expected an integer >= 1 or auto")
        return int(number)
    for where, section in (("fixed", fixed), ("grid", grid), ("space", space)):
        if "memory_limit_gb" in section:
            raise SpecError(f"{where}.memory_limit_gb: pack: auto fits each pack to "
                            "memory_budget_gb, its memory limit; drop it")
    return AUTO
