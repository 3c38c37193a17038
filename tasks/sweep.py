"""A sweep: spec → trials on Ray → ``runs/<sweep>/results.parquet``; re-runs skip done work.

Trials are cached on (trial parameters, data fingerprint, code version): a re-run skips
every trial whose completed result is on disk with the same key and re-runs exactly the
ones whose data or parameters changed. Before anything starts, the cluster is checked for
the GPUs or slots the placement needs (``address="auto"`` silently starts a private
cluster when the real one is unreachable: a sweep that expects GPUs refuses to run on
none). Grid and random searches list their trials up front; Optuna asks for them one by
one (tasks/optuna_search.py). ``segment_size: auto`` is resolved by a cached memory probe
(tasks/memory_probe.py); ``memory_budget_gb`` also becomes each trial's MLX memory limit.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from tasks.memory_probe import resolve_auto
from tasks.sweep_spec import SweepSpec
from tasks.trials import (
    EventHook,
    ListSource,
    Placement,
    Summary,
    TrialRun,
    TrialsInterrupted,
    Wrap,
    run_trials,
    write_results,
)

CODE_VERSION = "0.2.0"  # bump when training semantics change: invalidates cached trials
NOT_PARAMS = ("model", "data", "out")


def data_fingerprint(data: str) -> str:
    """The dataset manifest's fingerprint, or a hash of the data file."""
    path = Path(data)
    manifest = path / "manifest.json"
    if manifest.exists():
        return json.loads(manifest.read_text())["fingerprint"]
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    raise FileNotFoundError(f"sweep data not found: {data}")


def cache_key(config: dict[str, Any], fingerprint: str) -> str:
    """What a trial's result depends on: its resolved config, the data, the code."""
    body = json.dumps({k: v for k, v in config.items() if k != "out"}, sort_keys=True,
                      default=str)
    return hashlib.sha256(f"{body}|{fingerprint}|{CODE_VERSION}".encode()).hexdigest()[:16]


def trial_config(spec: SweepSpec, out: Path, trial_id: str, params: dict[str, Any]
                 ) -> dict[str, Any]:
    """TrainConfig fields of one trial: its params, the sweep's model/data, its directory."""
    config = {**params, "model": spec.model, "data": spec.data, "out": str(out / trial_id)}
    if spec.memory_budget_gb > 0 and "memory_limit_gb" not in params:
        config["memory_limit_gb"] = spec.memory_budget_gb
    return config


def plan(spec: SweepSpec, out: Path) -> list[tuple[str, dict[str, Any]]]:
    """(trial id, TrainConfig fields) for every listed trial of ``spec``."""
    return [(t.id, trial_config(spec, out, t.id, t.params)) for t in spec.trials()]


def check_cluster(placement: Placement, resources: dict[str, float], expected: int = 1) -> int:
    """Slots the cluster offers for ``placement``; raise when it offers none, or, for GPUs
    and custom resources (a lab's Macs), fewer than the ``expected`` concurrent trials."""
    if placement.resource:
        have, what = resources.get(placement.resource, 0), f"'{placement.resource}' resources"
    elif placement.gpus:
        have, what = resources.get("GPU", 0), "GPUs"
    else:
        have, what = resources.get("CPU", 0) // max(placement.cpus, 1e-9), "CPU slots"
    hint = ("is this the cluster you meant? address='auto' starts a private one when the "
            "real head is unreachable")
    if have < 1:
        raise RuntimeError(f"the Ray cluster offers no {what} (it has {resources}); {hint}")
    if (placement.gpus or placement.resource) and have < expected:
        raise RuntimeError(f"the sweep expects {expected} {what} (max_concurrent) but the Ray "
                           f"cluster offers {int(have)} (it has {resources}); {hint}, or lower "
                           "max_concurrent")
    return int(have)


def previous_results(out: Path) -> dict[str, dict[str, Any]]:
    path = out / "results.parquet"
    if not path.exists():
        return {}
    return {r["trial_id"]: r for r in pq.read_table(path).to_pylist()}


def metric_value(summary: Summary, metric: str) -> float | None:
    """The trial's best value of the spec's validation ``metric``."""
    value = summary.get(f"best/{metric}")
    return None if value is None else float(value)


def run_sweep(spec: SweepSpec, out: Path, placement: Placement | None = None,
              progress: EventHook | None = None, wrap: Wrap | None = None) -> list[Summary]:
    """Run ``spec``'s trials on the connected Ray cluster into ``out``.

    ``progress(kind, summary)`` hears "plan" (counts), "started", "retry", "lost" and
    "finished" events; ``wrap`` runs each trial (tasks/trials.py: run_trials). Ctrl-C:
    results so far are written (running trials ``cancelled``) and KeyboardInterrupt
    propagates.
    """
    import ray

    placement = placement or Placement()
    out = Path(out)
    fingerprint = data_fingerprint(spec.data)
    slots = check_cluster(placement, ray.cluster_resources(), spec.max_concurrent)
    before = previous_results(out)

    def cached(trial_id: str, config: dict[str, Any]) -> Summary | None:
        keys[trial_id] = cache_key(config, fingerprint)
        old = before.get(trial_id)
        ok = (old and old.get("status") == "completed" and old.get("cache_key") == keys[trial_id]
              and (out / trial_id / "adapters.safetensors").exists())
        return {**old, "skipped": True} if ok else None

    def resolve(trials: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
        if not any(c.get("segment_size") == "auto" for _, c in trials):
            return trials
        resolved, note = resolve_auto(trials, spec.memory_budget_gb, placement, fingerprint,
                                      out / "probes.json")
        notes.update(note)
        return resolved

    concurrent = min(slots, spec.max_concurrent)
    keys: dict[str, str] = {}
    notes: dict[str, str] = {}
    study = None
    if spec.search == "optuna":
        from tasks.optuna_search import OptunaSource, Study

        study = ray.remote(num_cpus=0)(Study).remote(spec.space, spec.mode, spec.seed,
                                                     spec.pruning)

        def build(trial_id: str, params: dict[str, Any]) -> dict[str, Any]:
            [(_, config)] = resolve([(trial_id, trial_config(spec, out, trial_id, params))])
            return config

        source = OptunaSource(spec, study, build, cached, lambda s: metric_value(s, spec.metric))
        done: list[Summary] = []
        rank: dict[str, int] = {}
        _emit(progress, "plan", {"trials": spec.num_samples, "search": "optuna",
                                 "slots": concurrent})
    else:
        planned = resolve(plan(spec, out))
        rank = {t: i for i, (t, _) in enumerate(planned)}
        done = [c for t, config in planned if (c := cached(t, config)) is not None]
        skip = {d["trial_id"] for d in done}
        todo = [(t, c) for t, c in planned if t not in skip]
        source = ListSource([TrialRun(t, c) for t, c in todo])
        _emit(progress, "plan", {"trials": len(planned), "cached": len(done),
                                 "to_run": len(todo), "slots": concurrent})
    configs: dict[str, dict[str, Any]] = {}

    def finish(rows: list[Summary]) -> list[Summary]:
        reused = source.reused if spec.search == "optuna" else []
        ordered = [*done, *reused, *rows]
        if rank:  # grid/random: the spec's order, whatever ran first
            ordered.sort(key=lambda r: rank.get(r["trial_id"], len(rank)))
        for r in ordered:
            config = configs.get(r["trial_id"]) or {}
            r.setdefault("cache_key", keys.get(r["trial_id"]))
            r.setdefault("skipped", False)
            r.update({f"param/{k}": v for k, v in config.items() if k not in NOT_PARAMS})
            if r["trial_id"] in notes:
                r["segment_size_probe_gb"] = notes[r["trial_id"]]
        return ordered

    def on_event(kind: str, summary: Summary) -> None:
        _emit(progress, kind, summary)

    class Recording:  # remembers each asked trial's config for the results table
        def ask(self) -> TrialRun | None:
            trial = source.ask()
            if trial is not None:
                configs[trial.id] = trial.config
            return trial

        def tell(self, trial: TrialRun, summary: Summary) -> None:
            source.tell(trial, summary)

    for row in done:
        configs[row["trial_id"]] = {k[len("param/"):]: v for k, v in row.items()
                                    if k.startswith("param/")}
    try:
        rows = run_trials(Recording(), placement, concurrent, time_limit_s=spec.time_limit_s,
                          retries=spec.retries, retry_delay_s=spec.retry_delay_s,
                          study=study, metric=spec.metric, on_event=on_event, wrap=wrap)
    except TrialsInterrupted as stop:
        write_results(finish(stop.rows), out / "results.parquet")
        raise
    ordered = finish(rows)
    write_results(ordered, out / "results.parquet")
    return ordered


def _emit(hook: EventHook | None, kind: str, summary: Summary) -> None:
    if hook:
        hook(kind, summary)
