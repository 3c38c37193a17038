"""A sweep: spec → trials on Ray → ``runs/<sweep>/results.parquet``; re-runs skip done work.

Trials are cached on (trial parameters, the model's and the data's content, code version):
a re-run skips every trial whose completed result is on disk with the same key and re-runs
exactly the ones whose model, data or parameters changed. Every finished trial is written
to results.parquet as it finishes. Before anything starts, the cluster is checked for
the GPUs or slots the placement needs (``address="auto"`` silently starts a private
cluster when the real one is unreachable: a sweep that expects GPUs refuses to run on
none). Grid and random searches list their trials up front; Optuna asks for them one by
one (tasks/sweep/optuna_search.py). ``segment_size: auto`` is resolved by a cached memory probe
(tasks/sweep/memory_probe.py), ``pack: auto`` by a cached pack probe (tasks/sweep/pack_sizes.py);
``memory_budget_gb`` also becomes each trial's MLX memory limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from engine.data.shards import check_dataset
from engine.data.unpaired import refuse_unpaired
from engine.host.digests import file_digest
from engine.host.outputs import claim, mark_kind, reading
from engine.model.content_key import adapter_fingerprint, model_fingerprint, reference_key
from engine.model.source import source_kind
from engine.settings.config import TrainConfig
from engine.settings.reference_kind import BASE
from tasks.board.ranked_metric import metric_value
from tasks.board.results_table import FINISHED, RESULTS, read_results, write_results
from tasks.eval.rewards import reward_code
from tasks.nodes.placement import Placement
from tasks.nodes.preflight import preflight
from tasks.sweep.attempts import EventHook
from tasks.sweep.memory_probe import resolve_auto
from tasks.sweep.pack_sizes import size_packs
from tasks.sweep.scheduler import ListSource, TrialsInterrupted, Wrap, run_trials
from tasks.sweep.sweep_spec import PlanError, SpecError, SweepSpec, trial_id
from tasks.sweep.trial import Summary
from tasks.sweep.trial_plan import AUTO, TrialPlan, param_columns, settings_of
from tasks.sweep.trial_row import keep_row, recovered
from tasks.sweep.trial_rules import TrialRules
from tasks.track.sinks import tracker_problem
from tasks.track.tracker import Tracker

# Bump when training semantics change: invalidates cached trials. 0.3.0: the test split
# comes out of train, so a .jsonl without a split column trains on fewer rows. 0.4.0:
# every validation reports logps/accuracies and logps/margin (what boards rank on). 0.5.0:
# keyed on every effective setting (TrialPlan.params), defaults included, not the spec's.
CODE_VERSION = "0.5.0"


def plan_line(counts: dict[str, Any]) -> str:
    """A sweep's plan (``emit("plan", …)``'s counts) as the line the terminal and the flow's
    log show: ``4 trials: 1 cached, 3 to run on 2 slot(s)``."""
    trials = counts["trials"]
    if counts.get("search") == "optuna":
        return f"{trials} trials asked of Optuna, on {counts.get('slots', 1)} slot(s)"
    packs = {None: "", 1: ", each alone (pack: auto: no pack of two fits memory_budget_gb)"
             }.get(counts.get("pack_auto"), f", in packs of up to {counts.get('pack_auto')} "
                                            "(pack: auto)")
    return (f"{trials} trials: {counts.get('cached', 0)} cached, "
            f"{counts.get('to_run', trials)} to run on {counts.get('slots', 1)} slot(s)"
            f"{packs}")


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


def check_inputs(spec: SweepSpec) -> None:
    """The spec's model and data exist (FileNotFoundError naming the one that does not),
    and the data was tokenized with the model's tokenizer unless the spec allows another
    (SpecError: every trial would refuse it, engine/data/data_fit.py)."""
    from engine.data.data_fit import tokenizer_problem

    source_kind(spec.model)  # a local path that is not there; a repo id is mlx-lm's
    data_fingerprint(spec.data)
    if problem := tracker_problem(spec.report_to):  # said before a cluster starts
        raise SpecError(problem)
    allowed = spec.fixed.get("allow_tokenizer_mismatch") or any(
        spec.grid.get("allow_tokenizer_mismatch", []))
    if not allowed and (problem := tokenizer_problem(spec.data, spec.model)):
        raise SpecError(problem)


def is_sweep_dir(path: Path) -> bool:
    """Whether ``path`` holds a sweep an earlier Pomona wrote, before sweeps carried the
    mark of engine/host/outputs.py: its results table, a memory sweep's, or a trial's run
    folder (a sweep killed before its first trial finished)."""
    from engine.model.adapters import is_run_dir

    for name, column in (("results.parquet", "trial_id"), ("memory.parquet", "setting")):
        with contextlib.suppress(OSError, ValueError, pa.ArrowException):
            if column in pq.read_schema(path / name).names:
                return True
    return any(c.is_dir() and (mark_kind(c) == "run" or is_run_dir(c)) for c in path.iterdir())


def claim_sweep(spec: SweepSpec, out: Path) -> AbstractContextManager[Path]:
    """``out`` held as this process's sweep (engine/host/outputs.py) while trials run: refused
    when it holds files Pomona did not write, another sweep is writing it, it is not
    writable, or it lies inside the model or data."""
    return claim(out, ("sweep",), legacy=is_sweep_dir, inputs=[spec.model, spec.data])


def check_sweep_out(spec: SweepSpec, out: Path) -> None:
    """``claim_sweep``'s refusals now, before a cluster starts (the sweep claims again)."""
    with claim_sweep(spec, out):
        pass


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


def check_cluster(placement: Placement, resources: dict[str, float], expected: int = 1,
                  ranks: int = 1) -> int:
    """Concurrent trials the cluster offers for ``placement`` (each ``ranks`` slots); raise
    when it cannot hold one, or, for GPUs and custom resources (a lab's Macs), fewer than
    the ``expected`` concurrent trials."""
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
    if have < ranks:
        raise RuntimeError(f"one trial needs {ranks} {what} (ranks_per_trial) but the Ray "
                           f"cluster offers {int(have)} (it has {resources}); {hint}, or "
                           "lower ranks_per_trial")
    if (placement.gpus or placement.resource) and have < expected * ranks:
        raise RuntimeError(f"the sweep expects {expected * ranks} {what} (max_concurrent "
                           f"{expected} × ranks_per_trial {ranks}) but the Ray cluster offers "
                           f"{int(have)} (it has {resources}); {hint}, or lower max_concurrent")
    return int(have // ranks)


def previous_results(out: Path) -> dict[str, dict[str, Any]]:
    rows = read_results(out, usable=False) if (out / RESULTS).exists() else []
    return {r["trial_id"]: r for r in rows}  # usable=False: weights are the board's to check


def run_sweep(spec: SweepSpec, out: Path, placement: Placement | None = None,
              progress: EventHook | None = None, wrap: Wrap | None = None) -> list[Summary]:
    """Run ``spec``'s trials on the connected Ray cluster into ``out``.

    ``progress(kind, summary)`` hears "plan" (counts), "started", "running", "retry",
    "lost" and "finished" events; ``wrap`` runs each trial (tasks/sweep/scheduler.py: run_trials).
    Ctrl-C: results so far are written (running trials ``cancelled``), KeyboardInterrupt raised.
    """
    refuse_unpaired(data := Path(spec.data), "a sweep's leaderboard scores preference pairs")
    # The dataset held shared for the whole sweep: a writer is refused until it ends.
    with claim_sweep(spec, Path(out)), reading(data) if data.is_dir() else nullcontext():
        return _run_sweep(spec, Path(out), placement or Placement(), progress, wrap)


def _run_sweep(spec: SweepSpec, out: Path, placement: Placement, progress: EventHook | None,
               wrap: Wrap | None) -> list[Summary]:
    import ray

    sweep = SweepRun(spec, Path(out), placement or Placement(), progress)
    sweep.emit("preflight", {"nodes": preflight(sweep.placement)})
    slots = check_cluster(sweep.placement, ray.cluster_resources(), spec.max_concurrent,
                          spec.ranks_per_trial)
    concurrent = min(slots, spec.max_concurrent)
    source, study = sweep.optuna_source() if spec.search == "optuna" else sweep.list_source()
    sweep.emit("plan", {**sweep.plan_counts, "slots": concurrent})
    sweep.source = source
    tracker = Tracker.start(out, spec.report_to, sweep.info())
    with tracker.live(sweep.configs, sweep.rows_now) if tracker else nullcontext():
        try:
            rows = run_trials(_Recording(source, sweep.configs), sweep.placement,
                              sweep.rules(concurrent), study=study, on_event=sweep.on_event,
                              wrap=wrap)
        except TrialsInterrupted as stop:
            sweep.write(stop.rows)
            raise
        return sweep.write(rows)  # written before the trackers' last sync reads it


class SweepRun:
    """One run of a spec: the cache it reads, the trials it resolves, the rows it writes."""

    def __init__(self, spec: SweepSpec, out: Path, placement: Placement,
                 progress: EventHook | None):
        self.spec, self.out, self.placement, self.progress = spec, out, placement, progress
        self.fingerprint = data_fingerprint(spec.data)
        self.model_key = model_fingerprint(spec.model)
        self.before = previous_results(out)
        self.keys: dict[str, str] = {}  # trial id -> cache key of its resolved config
        self.notes: dict[str, str] = {}  # trial id -> probed peaks behind segment_size: auto
        self.pack_limits: dict[str, int] = {}  # pack: auto: trial id -> its largest pack
        self.pack_notes: dict[str, str] = {}  # trial id -> the pack probe's peaks behind it
        self.configs: dict[str, dict[str, Any]] = {}  # trial id -> its plan's params()
        self.done: list[Summary] = []  # completed in an earlier run: not run again
        self.rank: dict[str, int] = {}  # grid/random: the spec's order
        self.plan_counts: dict[str, Any] = {}
        self.source: Any = None
        self.finished: list[Summary] = []  # this run's trials, as they finish
        self.lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        """The sweep as its trackers tag it: its spec, data, model and code."""
        from importlib.metadata import PackageNotFoundError, version

        spec = json.loads(json.dumps(dataclasses.asdict(self.spec), default=str))
        try:
            pomona = version("pomona")
        except PackageNotFoundError:  # run from a checkout that was never installed
            pomona = "unknown"
        return {"name": self.spec.name, "spec": spec, "data_fingerprint": self.fingerprint,
                "model_key": self.model_key, "version": pomona,
                "code_version": CODE_VERSION, "sweep_dir": str(self.out.resolve())}

    def rows_now(self) -> dict[str, Summary]:
        """This run's rows so far (cached, refused, finished), by trial id: what its
        trackers send while results.parquet still holds an earlier run's."""
        with self.lock:  # copies: finish() adds columns to these rows as it writes
            rows = [dict(r) for r in (*self.done, *getattr(self.source, "reused", []),
                                      *self.finished)]
        return {r["trial_id"]: r for r in rows}

    def emit(self, kind: str, summary: Summary) -> None:
        if self.progress:
            self.progress(kind, summary)

    def on_event(self, kind: str, summary: Summary) -> None:
        """Pass ``kind`` on; a finished trial is written to results.parquet at once, so
        no later failure (another trial's, the scheduler's, a kill) can lose it."""
        if kind == "finished":
            with self.lock:
                self.finished.append(summary)
                rows = list(self.finished)
            with contextlib.suppress(Exception):  # a re-run recognises the trial by it
                keep_row(self.out, summary, self.keys.get(summary.get("trial_id")))
            with contextlib.suppress(Exception):  # the final write reports it; trials go on
                self.write(rows)
        self.emit(kind, summary)


    def write(self, rows: list[Summary]) -> list[Summary]:
        """Every trial's row (cached, reused, run now) to results.parquet, atomically."""
        with self.lock:
            ordered = self.finish(rows, self.source)
            write_results(ordered, self.out / RESULTS, sweep=True)
        return ordered

    def cached(self, plan: TrialPlan) -> Summary | None:
        """The earlier finished result of exactly this trial (completed, or degenerate: the
        same inputs collapse again), if its adapter is on disk."""
        key = self.keys[plan.id] = cache_key(plan.config, self.fingerprint, self.model_key)
        old = self.before.get(plan.id)
        if not (old and old.get("status") in FINISHED and old.get("cache_key") == key):
            old = recovered(self.out, plan.id, key)  # finished, its row lost with the table
        ok = old and (self.out / plan.id / "adapters.safetensors").exists()
        return {**old, "skipped": True} if ok else None

    def rules(self, concurrent: int) -> TrialRules:
        """The spec's rules at ``concurrent`` trials at a time; under ``pack: auto``, each
        trial's pack as the probe sized it (up to the largest of them)."""
        rules = dataclasses.replace(self.spec.rules, max_concurrent=concurrent)
        if not self.pack_limits:
            return rules
        return dataclasses.replace(rules, pack=max(self.pack_limits.values()),
                                   pack_limits=tuple(sorted(self.pack_limits.items())))

    def resolve(self, plans: list[TrialPlan]) -> list[TrialPlan]:
        """Every key still auto replaced by the probed size that fits the budget."""
        if not any(p.auto for p in plans):
            return plans
        resolved, notes = resolve_auto(plans, self.spec.memory_budget_gb, self.placement,
                                       self.fingerprint, self.out / "probes.json",
                                       self.spec.ranks_per_trial)
        self.notes.update(notes)
        return resolved

    def list_source(self) -> tuple[ListSource, None]:
        planned, refused = self.plan_points()
        planned = self.resolve(planned)
        self.rank = {trial_id(p): i for i, p in enumerate(self.spec.points())}
        self.done = [c for p in planned if (c := self.cached(p)) is not None]
        for row in self.done:
            self.configs[row["trial_id"]] = {k[len("param/"):]: v for k, v in row.items()
                                             if k.startswith("param/")}
        skip = {d["trial_id"] for d in self.done}
        todo = [p for p in planned if p.id not in skip]
        if self.spec.pack is AUTO:  # only the trials to run are packed, so sized
            self.pack_limits, self.pack_notes = size_packs(
                todo, self.spec.memory_budget_gb, self.placement, self.fingerprint,
                self.out / "probes.json")
        self.plan_counts = {"trials": len(planned) + len(refused), "cached": len(self.done),
                            "to_run": len(todo)}
        if self.pack_limits:
            self.plan_counts["pack_auto"] = max(self.pack_limits.values())
        self.done += refused
        return ListSource(todo), None

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

    def optuna_source(self) -> tuple[Any, Any]:
        import ray

        from tasks.sweep.optuna_search import OptunaSource, Study

        spec = self.spec
        study = ray.remote(num_cpus=0)(Study).remote(spec.space, spec.mode, spec.seed,
                                                     spec.pruning)

        def build(params: dict[str, Any], number: int) -> TrialPlan:
            [plan] = self.resolve([spec.plan(params, self.out, number)])
            return plan

        self.plan_counts = {"trials": spec.num_samples, "search": "optuna"}
        return OptunaSource(spec, study, build, self.cached,
                            lambda s: metric_value(s, spec.metric)), study

    def finish(self, rows: list[Summary], source: Any) -> list[Summary]:
        """Every trial's row: cached, reused by Optuna, or run now; params and keys added."""
        ordered = [*self.done, *getattr(source, "reused", []), *rows]
        if self.rank:  # grid/random: the spec's order, whatever ran first
            ordered.sort(key=lambda r: self.rank.get(r["trial_id"], len(self.rank)))
        for r in ordered:
            config = self.configs.get(r["trial_id"]) or {}
            r.setdefault("cache_key", self.keys.get(r["trial_id"]))
            r.setdefault("skipped", False)
            r.update({f"param/{k}": v for k, v in config.items()})
            if r["trial_id"] in self.notes:
                r["segment_size_probe_gb"] = self.notes[r["trial_id"]]
            if r["trial_id"] in self.pack_notes:
                r["pack_probe_gb"] = self.pack_notes[r["trial_id"]]
        return ordered


class _Recording:
    """A trial source that remembers each asked trial's config for the results table."""

    def __init__(self, source: Any, configs: dict[str, dict[str, Any]]):
        self.source, self.configs = source, configs

    def ask(self) -> TrialPlan | None:
        trial = self.source.ask()
        if trial is not None:
            self.configs[trial.id] = trial.params()
        return trial

    def tell(self, trial: TrialPlan, summary: Summary) -> None:
        self.source.tell(trial, summary)
