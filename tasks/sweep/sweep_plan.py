"""A sweep planned into one value before any trial runs: what its cache keys read, every
listed trial resolved and keyed, the cached and refused rows, the probes' notes and the
pack limits. ``SweepRun`` (tasks/sweep/run.py) keeps only the running state.

    plan = plan_sweep(spec, out, placement)   # grid/random: every trial; Optuna: its inputs
    plan.todo, plan.done, plan.counts         # to run; cached + refused rows; the plan line's
    plan.table(rows, asked, reused)           # results.parquet's rows, in the spec's order

Trials are cached on (trial parameters, the model's and the data's content, code version):
a re-run skips every trial whose completed result is on disk with the same key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

from engine.data.shards import check_dataset
from engine.host.digests import file_digest
from engine.model.content_key import adapter_fingerprint, model_fingerprint, reference_key
from engine.settings.config import TrainConfig
from engine.settings.reference_kind import BASE
from tasks.board.results_table import FINISHED, RESULTS, read_results
from tasks.eval.rewards import reward_code
from tasks.nodes.placement import Placement
from tasks.sweep.memory_probe import resolve_auto
from tasks.sweep.pack_sizes import size_packs
from tasks.sweep.sweep_spec import PlanError, SweepSpec, trial_id
from tasks.sweep.trial import Summary
from tasks.sweep.trial_plan import AUTO, TrialPlan, param_columns, settings_of
from tasks.sweep.trial_row import recovered
from tasks.sweep.trial_rules import TrialRules

# Bump when training semantics change: invalidates cached trials. 0.3.0: the test split
# comes out of train, so a .jsonl without a split column trains on fewer rows. 0.4.0:
# every validation reports logps/accuracies and logps/margin (what boards rank on). 0.5.0:
# keyed on every effective setting (TrialPlan.params), defaults included, not the spec's.
CODE_VERSION = "0.5.0"


def _none() -> Any:
    """An empty read-only mapping as a frozen dataclass's default."""
    return field(default_factory=lambda: MappingProxyType({}))


def data_fingerprint(data: str) -> str:
    """The dataset manifest's fingerprint with its split, or a hash of the data file.
    Preprocess re-splits in place keeping the fingerprint (an old dataset gains a test split
    out of train): a trial cached before then trained on rows that are test now."""
    path = Path(data)
    if (manifest := path / "manifest.json").exists():
        m = json.loads(manifest.read_text())
        check_dataset(path, m)  # an edited shard, an old split: refused, never cached
        options = m.get("options", {})
        split = [m.get("preprocessed"), options.get("valid_fraction"),
                 options.get("test_fraction")]
        return hashlib.sha256(json.dumps([m["fingerprint"], *split]).encode()).hexdigest()
    if path.is_file():
        return file_digest(path)
    raise FileNotFoundError(f"sweep data not found: {data}")


def cache_key(config: TrainConfig, fingerprint: str, model_key: str) -> str:
    """What a trial's result depends on: every effective setting of its config
    (``TrialPlan.params``: a changed default re-trains), the model's bytes (``model_key``:
    engine/model/content_key.py), a warm start's, a DPO reference adapter's, a reference
    file's and a ``python:`` reward's bytes (never paths: each re-made in place is another
    start), the data, the code."""
    body = json.dumps(settings_of(config), sort_keys=True, default=str)
    text = f"{body}|{model_key}|{fingerprint}|{CODE_VERSION}"
    if config.warm_start:
        text += f"|{adapter_fingerprint(config.warm_start)}"
    if config.reference != BASE:
        text += f"|reference:{reference_key(config.reference)}"
    if config.reference_logps:
        text += f"|reference_logps:{file_digest(config.reference_logps)}"
    if code := reward_code(config.loss):
        text += f"|reward:{','.join(code)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def previous_results(out: Path) -> dict[str, dict[str, Any]]:
    rows = read_results(out, usable=False) if (out / RESULTS).exists() else []
    return {r["trial_id"]: r for r in rows}  # usable=False: weights are the board's to check


@dataclass(frozen=True)
class Keyed:
    """A trial as the results table records it beside its own row: its plan and cache key."""

    plan: TrialPlan
    key: str

    def columns(self, own_params: bool) -> dict[str, Any]:
        """Its ``param/`` columns (``own_params``: a trial this run trains; a cached row
        keeps those it was written with) and the memory probe's peaks behind its size."""
        cols = {f"param/{k}": v for k, v in self.plan.params().items()} if own_params else {}
        if self.plan.probed is not None:
            cols["segment_size_probe_gb"] = self.plan.probed
        return cols


@dataclass(frozen=True)
class SweepInputs:
    """What every trial's cache key and cache lookup read beside its config, read once: the
    data's and the model's fingerprints and the rows an earlier run wrote."""

    spec: SweepSpec
    out: Path
    placement: Placement
    fingerprint: str
    model_key: str
    before: Mapping[str, Summary] = _none()

    @classmethod
    def read(cls, spec: SweepSpec, out: Path, placement: Placement) -> SweepInputs:
        return cls(spec, out, placement, data_fingerprint(spec.data),
                   model_fingerprint(spec.model), MappingProxyType(previous_results(out)))

    def keyed(self, plan: TrialPlan) -> Keyed:
        return Keyed(plan, cache_key(plan.config, self.fingerprint, self.model_key))

    def cached(self, keyed: Keyed) -> Summary | None:
        """The earlier finished result of exactly this trial (completed, or degenerate: the
        same inputs collapse again), if its adapter is on disk."""
        tid, key = keyed.plan.id, keyed.key
        old = self.before.get(tid)
        if not (old and old.get("status") in FINISHED and old.get("cache_key") == key):
            old = recovered(self.out, tid, key)  # finished, its row lost with the table
        ok = old and (self.out / tid / "adapters.safetensors").exists()
        return {**old, "skipped": True} if ok else None

    def resolve(self, plans: list[TrialPlan]) -> list[TrialPlan]:
        """Every key still auto replaced by the probed size that fits the budget."""
        if not any(p.auto for p in plans):
            return plans
        return resolve_auto(plans, self.spec.memory_budget_gb, self.placement,
                            self.fingerprint, self.out / "probes.json",
                            self.spec.ranks_per_trial)

    def plan_points(self) -> tuple[list[TrialPlan], list[Summary]]:
        """Every listed point planned; a point no TrainConfig takes (a rule across fields,
        e.g. mlp_chunk with lora_dropout) is a failed row naming why, and the others run."""
        planned, refused = [], []
        for params in self.spec.points():
            try:
                planned.append(self.spec.plan(params, self.out))
            except PlanError as err:
                tid, now = trial_id(params), time.time()
                refused.append({"trial_id": tid, "status": "failed", "reason": str(err),
                                "started": now, "ended": now, **param_columns(params)})
        return planned, refused


class PlannedSource(Protocol):
    """A sweep's trial source (tasks/sweep/scheduler.py's): ``reused`` holds the rows it
    answered without training (Optuna's repeats and cached points)."""

    reused: list[Summary]

    def ask(self) -> TrialPlan | None: ...

    def tell(self, trial: TrialPlan, summary: Summary) -> None: ...


@dataclass(frozen=True)
class SweepPlan:
    """A sweep before it runs (module docstring). An Optuna sweep lists no trials: its
    source plans each as the study asks (tasks/sweep/optuna_search.py)."""

    inputs: SweepInputs
    todo: tuple[TrialPlan, ...] = ()
    keyed: Mapping[str, Keyed] = _none()  # every listed trial planned
    done: tuple[Summary, ...] = ()  # cached in an earlier run, then refused points
    rank: Mapping[str, int] = _none()  # grid/random: the spec's order
    pack_limits: tuple[tuple[str, int], ...] = ()  # pack: auto: trial id -> its largest
    pack_notes: Mapping[str, str] = _none()  # the pack probe's peaks behind it
    counts: Mapping[str, Any] = _none()  # the plan line's (run.plan_line)
    drawn: tuple[TrialPlan, ...] = ()  # Optuna: its fixed point with each loss and reference

    def reference_trials(self) -> tuple[TrialPlan, ...]:
        """The trials whose references are made before any runs (tasks/sweep/references.py):
        those to run, or the points an Optuna study may draw as far as a reference goes."""
        return (*self.todo, *self.drawn)

    def rules(self, concurrent: int) -> TrialRules:
        """The spec's rules at ``concurrent`` trials at a time; under ``pack: auto``, each
        trial's pack as the probe sized it (up to the largest of them)."""
        rules = dataclasses.replace(self.inputs.spec.rules, max_concurrent=concurrent)
        if not self.pack_limits:
            return rules
        return dataclasses.replace(rules, pack=max(k for _, k in self.pack_limits),
                                   pack_limits=self.pack_limits)

    def key_of(self, tid: str, asked: Mapping[str, Keyed]) -> str | None:
        known = self.keyed.get(tid) or asked.get(tid)
        return known.key if known else None

    def table(self, rows: list[Summary], asked: Mapping[str, Keyed],
              reused: list[Summary]) -> list[Summary]:
        """Every trial's row (cached, reused by its source, run now) with its params, key
        and probe notes, in the spec's order for grid/random, whatever ran first."""
        ordered = [*self.done, *reused, *rows]
        if self.rank:
            ordered.sort(key=lambda r: self.rank.get(r["trial_id"], len(self.rank)))
        for r in ordered:
            tid = r["trial_id"]
            r.setdefault("cache_key", self.key_of(tid, asked))
            r.setdefault("skipped", False)
            if known := self.keyed.get(tid) or asked.get(tid):
                r.update(known.columns(own_params=not r["skipped"]))
            if tid in self.pack_notes:
                r["pack_probe_gb"] = self.pack_notes[tid]
        return ordered


def plan_sweep(spec: SweepSpec, out: Path, placement: Placement) -> SweepPlan:
    """The sweep of ``spec`` into ``out`` planned: for grid/random, every point planned,
    resolved by the memory probe, keyed, sorted into cached, refused and to run, and the
    trials to run sized by the pack probe under ``pack: auto``."""
    inputs = SweepInputs.read(spec, out, placement)
    if spec.search == "optuna":
        return SweepPlan(inputs, counts=MappingProxyType(
            {"trials": spec.num_samples, "search": "optuna"}), drawn=drawn_plans(inputs))
    planned, refused = inputs.plan_points()
    keyed = {p.id: inputs.keyed(p) for p in inputs.resolve(planned)}
    cached = [c for k in keyed.values() if (c := inputs.cached(k)) is not None]
    skip = {c["trial_id"] for c in cached}
    todo = [k.plan for k in keyed.values() if k.plan.id not in skip]
    limits, pack_notes = {}, {}
    if spec.pack is AUTO:  # only the trials to run are packed, so sized
        limits, pack_notes = size_packs(todo, spec.memory_budget_gb, placement,
                                        inputs.fingerprint, out / "probes.json")
    counts = {"trials": len(planned) + len(refused), "cached": len(cached),
              "to_run": len(todo), **({"pack_auto": max(limits.values())} if limits else {})}
    return SweepPlan(inputs, tuple(todo), MappingProxyType(keyed), (*cached, *refused),
                     MappingProxyType({trial_id(p): i for i, p in enumerate(spec.points())}),
                     tuple(sorted(limits.items())), MappingProxyType(pack_notes),
                     MappingProxyType(counts))


def drawn_plans(inputs: SweepInputs) -> tuple[TrialPlan, ...]:
    """An Optuna sweep's fixed point with each loss and reference its space may draw (each
    combination a TrainConfig takes): what its trials' references are made from."""
    spec = inputs.spec
    choices = {name: dist.args for name in ("loss", "reference")
               if (dist := spec.space.get(name)) is not None and dist.kind == "choice"}
    plans = []
    for values in itertools.product(*choices.values()):
        with contextlib.suppress(PlanError):  # a combination no trial can draw
            plans.append(spec.plan({**spec.fixed, **dict(zip(choices, values, strict=True))},
                                   inputs.out))
    return tuple(plans)
