"""Sweep spec files: a YAML file read and validated into a ``SweepSpec`` (tasks/sweep/
sweep_spec.py), whose trials are typed plans (tasks/sweep/trial_plan.py).

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
    mode: min               # loss grpo: val/reward and max unless given
    pruning: true           # optuna only: true, or {startup_trials: 2, warmup_steps: 0}
    max_concurrent: 2
    time_limit_s: 600       # per trial; 0 = none
    retries: 2              # re-runs of a trial whose process or node died
    retry_delay_s: 5
    memory_budget_gb: 0     # per process: MLX's memory limit, what segment_size/pack: auto fit
    ranks_per_trial: 1      # > 1: each trial data parallel over that many GPUs (Macs)
    pack: 1                 # > 1: trials sharing their steps trained that many to a process;
                            # auto: as many as fit memory_budget_gb (tasks/sweep/pack_sizes.py)
    reuse_actors: false     # true: a slot's process trains trial after trial (Ray Tune's name)
    seed: 0
    evaluation: {scorers: [exact], prompts: 64, max_tokens: 32}   # tasks/eval/generation_eval.py
    rank_by: gen/valid/exact    # what the leaderboard ranks on (default: metric)
    report_to: [mlflow, tensorboard]   # experiment trackers (tasks/track/); default none

Every error names the key and file that is wrong. Parameter names are TrainConfig fields
(``loss`` too: a search over it ranks on a metric every loss shares, ACROSS_LOSSES);
``segment_size: auto`` is allowed with a ``memory_budget_gb`` (``AUTO`` in the plans, resolved
per trial from a memory probe: tasks/sweep/memory_probe.py). Each trial takes its own loss's
settings and is listed once. A rule across fields that every trial breaks is refused when the
spec is read; a grid point that alone breaks one is a failed row. Distributions:
``choice: [..]``, ``uniform: [lo, hi]``, ``loguniform: [lo, hi]``, ``int: [lo, hi]`` (inclusive).
"""

from __future__ import annotations

import itertools
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from engine.model.export import ExportSettings
from engine.settings.metric_order import MODES
from tasks.eval.generation_eval import check_rank_by, parse_generation
from tasks.sweep.spec_rules import (
    SpecError,
    check_kind,
    check_loss_settings,
    check_metric_of_losses,
    check_online,
    check_pack,
    check_ranks,
    default_metric,
    online_losses,
    pruning_of,
)
from tasks.sweep.spec_values import (
    check_param,
    check_value,
    distinct,
    number_of,
    pack_of,
    space_dist,
)
from tasks.sweep.sweep_spec import PlanError, SweepSpec
from tasks.sweep.trial_plan import AUTO, AUTO_KEYS
from tasks.track.report_to import ReportTo

SEARCHES = ("grid", "random", "optuna")
HUGE_SWEEP = 1000  # trials: more is warned of at planning time
TRIES = 10_000  # trials planned when the spec is read, for one that builds (tens of µs each)
OPTUNA_TRIES = 32  # draws from an optuna space planned then
TOP_KEYS = {"name", "model", "data", "fixed", "grid", "space", "search", "num_samples",
            "metric", "mode", "max_concurrent", "time_limit_s", "seed", "pruning",
            "memory_budget_gb", "retries", "retry_delay_s", "kind", "probe_batches",
            "ranks_per_trial", "evaluation", "rank_by", "export", "pack", "report_to",
            "reuse_actors"}


def _setting(data: dict[str, Any], key: str, default: float, integer: bool = False,
             minimum: float = 0) -> Any:
    """A top-level numeric setting: finite, at least ``minimum``, an integer if asked."""
    raw = data.get(key, default)
    number = number_of(raw)
    if number is None or number < minimum or (integer and not number.is_integer()):
        kind = "an integer" if integer else "a finite number"
        raise SpecError(f"{key}={raw!r}: expected {kind} >= {minimum:g}")
    return int(number) if integer else number


def _flag(data: dict[str, Any], key: str) -> bool:
    """A top-level true/false setting (false when absent)."""
    raw = data.get(key, False)
    if not isinstance(raw, bool):
        raise SpecError(f"{key}={raw!r}: expected true or false")
    return raw


def parse_spec(data: dict[str, Any], source: str = "spec") -> SweepSpec:
    """Validate a spec mapping; raise SpecError naming ``source`` and the bad key."""
    try:
        return _parse(data)
    except SpecError as err:
        raise SpecError(f"{source}: {err}") from None


def _check_top(data: Any) -> None:
    """A mapping of known keys that names its run, model and data."""
    if data is None:
        raise SpecError("the spec is empty; expected a mapping with name, model and data")
    if not isinstance(data, dict):
        raise SpecError(f"expected a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - TOP_KEYS)
    if unknown:
        raise SpecError(f"unknown key(s) {', '.join(unknown)}; expected {sorted(TOP_KEYS)}")
    for key in ("name", "model", "data"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise SpecError(f"{key}: required (a non-empty string)")
    if not re.fullmatch(r"\w[\w.-]*", data["name"]):  # \w: letters of any script too
        raise SpecError(f"name={data['name']!r}: letters, digits, '.', '_' and '-' only (it "
                        "names the run directory, which must stay inside runs/)")


def _parameters(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list], dict]:
    """``fixed``, ``grid`` and ``space``, each name a TrainConfig field, each value checked
    (``space`` still raw: ``space_dist`` reads it), no name in two of them."""
    fixed, grid, space = data.get("fixed") or {}, data.get("grid") or {}, data.get("space") or {}
    for where, section in (("fixed", fixed), ("grid", grid), ("space", space)):
        if not isinstance(section, dict):
            raise SpecError(f"{where}: expected a mapping of parameter names")
        for name in section:
            check_param(name, where)
    fixed = {name: check_value(name, value, "fixed") for name, value in fixed.items()}
    for name, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SpecError(f"grid.{name}: expected a non-empty list of values")
    grid = {name: distinct(name, values, [check_value(name, v, "grid") for v in values])
            for name, values in grid.items()}
    f, g, s = set(fixed), set(grid), set(space)
    overlap = sorted((f & g) | (f & s) | (g & s))
    if overlap:
        raise SpecError(f"{', '.join(overlap)}: given in more than one of fixed/grid/space")
    return fixed, grid, space


def _parse(data: Any) -> SweepSpec:
    _check_top(data)
    fixed, grid, space = _parameters(data)
    search = data.get("search", "grid" if not space else "random")
    if search not in SEARCHES:
        raise SpecError(f"search={search!r}: expected one of {', '.join(SEARCHES)}")
    if search == "grid" and space:
        raise SpecError("space: a grid search has no space; use search: random or optuna")
    counts = {key: _setting(data, key, default, integer=True, minimum=minimum)
              for key, default, minimum in (("num_samples", 1, 1), ("max_concurrent", 1, 1),
                                            ("retries", 2, 0), ("probe_batches", 8, 1),
                                            ("seed", 0, 0), ("ranks_per_trial", 1, 1))}
    pack = pack_of(data.get("pack", 1), fixed, grid, space)
    seconds = {key: _setting(data, key, default)
               for key, default in (("time_limit_s", 0), ("retry_delay_s", 5),
                                    ("memory_budget_gb", 0))}
    if search == "optuna" and (grid or not space):
        raise SpecError("search: optuna samples a space (put grid values in space as "
                        "{choice: [...]}) and needs a non-empty one")
    metric = data.get("metric", default_metric(fixed, grid, space))
    if not isinstance(metric, str) or not metric.startswith("val/"):
        raise SpecError(f"metric={metric!r}: expected a validation metric such as val/loss "
                        "or val/rewards/accuracies")
    mode = data.get("mode", "max" if metric.startswith("val/reward") and online_losses(
        fixed, grid, space) else "min")  # a reward, higher better (a pair loss's: as given)
    if mode not in MODES:
        raise SpecError(f"mode={mode!r}: expected min or max")
    check_loss_settings(fixed, grid, space)
    check_metric_of_losses(metric, fixed, grid, space)
    try:
        evaluation = parse_generation(data.get("evaluation"))
        rank_by = check_rank_by(data.get("rank_by", ""), evaluation)
        export = ExportSettings.parse(data.get("export"))
        report_to = ReportTo.parse(data.get("report_to"))
    except ValueError as err:
        raise SpecError(str(err)) from None
    if rank_by.startswith("val/") and rank_by != metric:
        check_metric_of_losses(rank_by, fixed, grid, space)
    pruning = pruning_of(data.get("pruning", False), search)
    budget = seconds["memory_budget_gb"]
    autos = _autos(fixed, grid, space)
    if autos and budget <= 0:
        raise SpecError(f"{autos[0]}: auto needs memory_budget_gb > 0 (what the segment "
                        "size must fit in)")
    kind = data.get("kind", "train")
    check_kind(kind, search, autos, report_to)
    check_online(fixed, grid, space, pack, counts["ranks_per_trial"], autos)
    if counts["ranks_per_trial"] > 1:
        check_ranks(counts["ranks_per_trial"], kind, fixed, grid, space)
    check_pack(pack, search, kind, counts["ranks_per_trial"], autos, budget)
    spec = SweepSpec(
        name=data["name"], model=data["model"], data=data["data"], fixed=fixed, grid=grid,
        space={k: space_dist(k, v) for k, v in space.items()}, search=search, metric=metric,
        mode=mode, pruning=pruning, kind=kind, evaluation=evaluation, rank_by=rank_by,
        export=export, report_to=report_to, pack=pack,
        reuse_actors=_flag(data, "reuse_actors"), **counts, **seconds)
    _check_runnable(spec)
    return spec


def _autos(fixed: dict, grid: dict, space: dict) -> list[str]:
    """Where a spec leaves a setting to the memory probe (``fixed.segment_size``, ...)."""
    return [f"{w}.{k}" for w, sec in (("fixed", fixed), ("grid", grid), ("space", space))
            for k, v in sec.items() if k in AUTO_KEYS
            and any(x is AUTO or x == "auto" for x in _values(v))]


def _values(value: Any) -> list:
    """The values a fixed, grid or space entry may give (a space's choices; a range gives
    numbers only)."""
    if isinstance(value, dict):
        return list(value.get("choice") or [])
    return value if isinstance(value, list) else [value]


def _check_runnable(spec: SweepSpec) -> None:
    """SpecError unless some trial's whole TrainConfig builds: a rule that every trial
    breaks (``fixed: {cpo_loss_type: hinge, cpo_label_smoothing: 0.1}``) is refused now,
    not found trial by trial once the cluster is up. Stops at the first trial that builds.
    Optuna's sampler draws later: draws from its space stand in, refused only when
    ``fixed`` alone breaks the rule they all break (a sampler may find what they missed)."""
    out = Path("runs") / spec.name  # any folder: the rules are the config's
    if spec.search == "optuna":
        rng = np.random.default_rng(spec.seed)
        tries = ({**spec.fixed, **spec.draw(rng)} for _ in range(OPTUNA_TRIES))
    else:
        tries = itertools.islice(spec.listing(), TRIES)
    first, tried = None, 0
    for params in tries:
        tried += 1
        try:
            spec.plan(params, out)
            return
        except PlanError as err:
            first = first or err
    try:
        spec.plan(spec.fixed, out)
    except PlanError as err:
        if first is not None and err.cause == first.cause:  # fixed and defaults break it too
            raise SpecError(f"fixed: {err.cause}") from None
    if spec.search != "optuna" and tried < TRIES:  # every trial tried: none can run
        raise SpecError(f"no trial of this sweep can run: {first}")


def load_spec(path: str | Path, given: dict[str, str] | None = None) -> SweepSpec:
    """Read and validate a YAML spec file; ``given``: top keys the caller sets in place of
    the file's (a pipeline's ``model`` and ``data``, which its spec may then leave out)."""
    from engine.settings.yaml_file import read_yaml

    try:
        data = read_yaml(path, "sweep spec")  # a key given twice refused there
    except FileNotFoundError:
        raise
    except ValueError as err:
        raise SpecError(str(err)) from None
    if given and isinstance(data, dict):
        data = {**data, **given}
    spec = parse_spec(data, str(path))
    if (size := spec.size()) > HUGE_SWEEP:  # a typo'd grid: hours of trials, a slow interrupt
        logging.getLogger("pomona.sweep").warning(
            f"warning: {path}: {size:,} trials planned (over {HUGE_SWEEP:,}); narrow "
            "the grid, or use search: random or optuna with num_samples")
    return spec
