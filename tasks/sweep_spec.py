"""Sweep specs: a YAML file → validated trials (each a TrainConfig override set).

    name: tiny
    model: runs/demo/model
    data: runs/demo/data
    fixed: {steps: 100, batch_size: 8}
    grid: {segment_size: [1, 2]}
    space:
      learning_rate: {loguniform: [1.0e-4, 1.0e-3]}
      lora_rank: {choice: [8, 16]}
    search: random          # grid | random | optuna
    num_samples: 4          # random draws per grid point; optuna: trials in all
    metric: val/loss        # a validation metric (val/...), as in metrics.jsonl
    mode: min
    pruning: true           # optuna only: true, or {startup_trials: 2, warmup_steps: 0}
    max_concurrent: 2
    time_limit_s: 600       # per trial; 0 = none
    retries: 2              # re-runs of a trial whose process or node died
    retry_delay_s: 5
    memory_budget_gb: 0     # per trial: MLX's memory limit, and what segment_size: auto fits
    seed: 0

Every error names the key and file that is wrong. Parameter names are TrainConfig fields;
``segment_size: auto`` is allowed with a ``memory_budget_gb`` (resolved per trial from a
memory probe: tasks/memory_probe.py).
Distributions: ``choice: [..]``, ``uniform: [lo, hi]``, ``loguniform: [lo, hi]``,
``int: [lo, hi]`` (inclusive).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import TrainConfig

KINDS = ("choice", "uniform", "loguniform", "int")
SEARCHES = ("grid", "random", "optuna")
TOP_KEYS = {"name", "model", "data", "fixed", "grid", "space", "search", "num_samples",
            "metric", "mode", "max_concurrent", "time_limit_s", "seed", "pruning",
            "memory_budget_gb", "retries", "retry_delay_s", "kind", "probe_batches"}
PRUNING_DEFAULTS = {"startup_trials": 2, "warmup_steps": 0}
CONFIG_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}
NOT_SWEPT = {"model", "data", "out", "resume"}  # set by the sweep itself


class SpecError(ValueError):
    """A sweep spec problem, naming the key."""


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


@dataclass(frozen=True)
class Trial:
    """One trial: its stable id and the TrainConfig overrides it runs with."""

    id: str
    params: dict[str, Any]


@dataclass(frozen=True)
class SweepSpec:
    """A validated sweep."""

    name: str
    model: str
    data: str
    fixed: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list] = field(default_factory=dict)
    space: dict[str, Dist] = field(default_factory=dict)
    search: str = "grid"
    num_samples: int = 1
    metric: str = "val/loss"
    mode: str = "min"
    max_concurrent: int = 1
    time_limit_s: float = 0.0
    seed: int = 0
    pruning: dict[str, int] = field(default_factory=dict)  # empty: no pruning
    memory_budget_gb: float = 0.0
    retries: int = 2
    retry_delay_s: float = 5.0
    kind: str = "train"  # train | memory
    probe_batches: int = 8

    def trials(self) -> list[Trial]:
        """Grid points × ``num_samples`` draws from ``space`` (random search), in order.

        Optuna search asks its sampler trial by trial instead; this lists its grid only.
        """
        keys = sorted(self.grid)
        points = [dict(zip(keys, combo, strict=True))
                  for combo in itertools.product(*(self.grid[k] for k in keys))] or [{}]
        rng = np.random.default_rng(self.seed)
        draws = self.num_samples if self.space and self.search == "random" else 1
        out = []
        for point in points:
            for _ in range(draws):
                sampled = {k: d.sample(rng) for k, d in sorted(self.space.items())}
                params = {**self.fixed, **point, **sampled}
                out.append(Trial(trial_id(params), params))
        return out


def trial_id(params: dict[str, Any]) -> str:
    """Stable short id of a parameter set (the same params are the same trial)."""
    body = json.dumps(params, sort_keys=True, default=str)
    return "t-" + hashlib.sha256(body.encode()).hexdigest()[:10]


def _check_param(name: str, where: str) -> None:
    if name in NOT_SWEPT:
        raise SpecError(f"{where}.{name}: set by the sweep itself; remove it")
    if name not in CONFIG_FIELDS:
        raise SpecError(f"{where}.{name}: not a training parameter (see `pomona train "
                        "--help` for the names)")


def _check_value(name: str, value: Any, where: str) -> None:
    if name == "segment_size" and value == "auto":
        return
    try:
        TrainConfig(model="m", data="d").replace(**{name: value}).validate()
    except (ValueError, TypeError) as err:
        raise SpecError(f"{where}.{name}={value!r}: {err}") from err


def _dist(name: str, raw: Any) -> Dist:
    where = f"space.{name}"
    if not isinstance(raw, dict) or len(raw) != 1 or next(iter(raw)) not in KINDS:
        raise SpecError(f"{where}: expected one of {{{', '.join(KINDS)}: ...}}, got {raw!r}")
    kind, args = next(iter(raw.items()))
    if not isinstance(args, list) or not args:
        raise SpecError(f"{where}.{kind}: expected a non-empty list")
    if kind != "choice":
        if len(args) != 2 or not all(isinstance(a, (int, float)) for a in args):
            raise SpecError(f"{where}.{kind}: expected [low, high] numbers, got {args!r}")
        lo, hi = args
        if not lo < hi or (kind == "loguniform" and lo <= 0):
            raise SpecError(f"{where}.{kind}: need 0 < low < high (log) or low < high")
        if kind == "int" and not all(isinstance(a, int) for a in args):
            raise SpecError(f"{where}.int: bounds must be integers, got {args!r}")
    return Dist(kind, tuple(args))


def parse_spec(data: dict[str, Any], source: str = "spec") -> SweepSpec:
    """Validate a spec mapping; raise SpecError naming ``source`` and the bad key."""
    try:
        return _parse(data)
    except SpecError as err:
        raise SpecError(f"{source}: {err}") from None


def _parse(data: Any) -> SweepSpec:
    if not isinstance(data, dict):
        raise SpecError(f"expected a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - TOP_KEYS)
    if unknown:
        raise SpecError(f"unknown key(s) {', '.join(unknown)}; expected {sorted(TOP_KEYS)}")
    for key in ("name", "model", "data"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise SpecError(f"{key}: required (a non-empty string)")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", data["name"]):
        raise SpecError(f"name={data['name']!r}: letters, digits, '.', '_' and '-' only (it "
                        "names the run directory, which must stay inside runs/)")
    fixed, grid, space = data.get("fixed") or {}, data.get("grid") or {}, data.get("space") or {}
    for where, section in (("fixed", fixed), ("grid", grid), ("space", space)):
        if not isinstance(section, dict):
            raise SpecError(f"{where}: expected a mapping of parameter names")
        for name in section:
            _check_param(name, where)
    for name, value in fixed.items():
        _check_value(name, value, "fixed")
    for name, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SpecError(f"grid.{name}: expected a non-empty list of values")
        for v in values:
            _check_value(name, v, "grid")
    f, g, s = set(fixed), set(grid), set(space)
    overlap = sorted((f & g) | (f & s) | (g & s))
    if overlap:
        raise SpecError(f"{', '.join(overlap)}: given in more than one of fixed/grid/space")
    search = data.get("search", "grid" if not space else "random")
    if search not in SEARCHES:
        raise SpecError(f"search={search!r}: expected one of {', '.join(SEARCHES)}")
    if search == "grid" and space:
        raise SpecError("space: a grid search has no space; use search: random or optuna")
    mode = data.get("mode", "min")
    if mode not in ("min", "max"):
        raise SpecError(f"mode={mode!r}: expected min or max")
    for key in ("num_samples", "max_concurrent"):
        if not isinstance(data.get(key, 1), int) or data.get(key, 1) < 1:
            raise SpecError(f"{key}={data.get(key)!r}: expected an integer >= 1")
    if search == "optuna" and (grid or not space):
        raise SpecError("search: optuna samples a space (put grid values in space as "
                        "{choice: [...]}) and needs a non-empty one")
    metric = data.get("metric", "val/loss")
    if not isinstance(metric, str) or not metric.startswith("val/"):
        raise SpecError(f"metric={metric!r}: expected a validation metric such as val/loss "
                        "or val/rewards/accuracies")
    pruning = _pruning(data.get("pruning", False), search)
    budget = float(data.get("memory_budget_gb", 0))
    autos = [w for w, sec in (("fixed", fixed), ("grid", grid))
             for k, v in sec.items() if k == "segment_size" and "auto" in _listed(v)]
    if autos and budget <= 0:
        raise SpecError(f"{autos[0]}.segment_size: auto needs memory_budget_gb > 0 (what the "
                        "segment size must fit in)")
    if not isinstance(data.get("retries", 2), int) or data.get("retries", 2) < 0:
        raise SpecError(f"retries={data.get('retries')!r}: expected an integer >= 0")
    kind = data.get("kind", "train")
    if kind not in ("train", "memory"):
        raise SpecError(f"kind={kind!r}: expected train or memory")
    if kind == "memory" and (search != "grid" or autos):
        raise SpecError("kind: memory measures grid points (search: grid, explicit segment "
                        "sizes)")
    if not isinstance(data.get("probe_batches", 8), int) or data.get("probe_batches", 8) < 1:
        raise SpecError(f"probe_batches={data.get('probe_batches')!r}: expected an integer >= 1")
    return SweepSpec(
        name=data["name"], model=data["model"], data=data["data"], fixed=fixed, grid=grid,
        space={k: _dist(k, v) for k, v in space.items()}, search=search,
        num_samples=data.get("num_samples", 1), metric=metric,
        mode=mode, max_concurrent=data.get("max_concurrent", 1),
        time_limit_s=float(data.get("time_limit_s", 0)), seed=int(data.get("seed", 0)),
        pruning=pruning, memory_budget_gb=budget, retries=data.get("retries", 2),
        retry_delay_s=float(data.get("retry_delay_s", 5)), kind=kind,
        probe_batches=data.get("probe_batches", 8))


def _listed(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _pruning(raw: Any, search: str) -> dict[str, int]:
    if raw is False or raw is None:
        return {}
    if search != "optuna":
        raise SpecError("pruning: needs search: optuna (the pruner is Optuna's)")
    if raw is True:
        return dict(PRUNING_DEFAULTS)
    if not isinstance(raw, dict) or set(raw) - set(PRUNING_DEFAULTS):
        raise SpecError(f"pruning: expected true or a mapping with keys "
                        f"{sorted(PRUNING_DEFAULTS)}, got {raw!r}")
    if not all(isinstance(v, int) and v >= 0 for v in raw.values()):
        raise SpecError(f"pruning: values must be integers >= 0, got {raw!r}")
    return {**PRUNING_DEFAULTS, **raw}


def load_spec(path: str | Path) -> SweepSpec:
    """Read and validate a YAML spec file."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not valid YAML: {err}") from err
    return parse_spec(data, str(path))
