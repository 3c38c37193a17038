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
import json
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from engine.data.unpaired import refuse_unpaired
from engine.host.outputs import claim, mark_kind, reading
from engine.model.source import source_kind
from tasks.board.ranked_metric import metric_value
from tasks.board.results_table import RESULTS, write_results
from tasks.nodes.placement import Placement
from tasks.nodes.preflight import preflight
from tasks.sweep.attempts import EventHook
from tasks.sweep.optuna_search import OptunaSource, Study
from tasks.sweep.scheduler import ListSource, TrialsInterrupted, Wrap, run_trials
from tasks.sweep.sweep_plan import (
    CODE_VERSION,
    Keyed,
    PlannedSource,
    SweepInputs,
    SweepPlan,
    data_fingerprint,
    plan_sweep,
)
from tasks.sweep.sweep_spec import SpecError, SweepSpec
from tasks.sweep.trial import Summary
from tasks.sweep.trial_plan import TrialPlan
from tasks.sweep.trial_row import keep_row
from tasks.track.sinks import tracker_problem
from tasks.track.tracker import Tracker


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


def run_sweep(spec: SweepSpec, out: Path, placement: Placement | None = None,
              progress: EventHook | None = None, wrap: Wrap | None = None,
              before_trials: Callable[[SweepPlan], Any] | None = None) -> list[Summary]:
    """Run ``spec``'s trials on the connected Ray cluster into ``out``.

    ``progress(kind, summary)`` hears "plan" (counts), "started", "running", "retry",
    "lost" and "finished" events; ``wrap`` runs each trial (tasks/sweep/scheduler.py:
    run_trials); ``before_trials(plan)`` runs once the sweep is planned, before any trial
    (the reference pass: tasks/sweep/references.py). Ctrl-C: results so far are written
    (running trials ``cancelled``), KeyboardInterrupt raised.
    """
    refuse_unpaired(data := Path(spec.data), "a sweep's leaderboard scores preference pairs")
    # The dataset held shared for the whole sweep: a writer is refused until it ends.
    with claim_sweep(spec, Path(out)), reading(data) if data.is_dir() else nullcontext():
        return _run_sweep(spec, Path(out), placement or Placement(), progress, wrap,
                          before_trials)


def _run_sweep(spec: SweepSpec, out: Path, placement: Placement, progress: EventHook | None,
               wrap: Wrap | None, before_trials: Callable[[SweepPlan], Any] | None
               ) -> list[Summary]:
    import ray

    if progress:
        progress("preflight", {"nodes": preflight(placement)})
    slots = check_cluster(placement, ray.cluster_resources(), spec.max_concurrent,
                          spec.ranks_per_trial)
    concurrent = min(slots, spec.max_concurrent)
    plan = plan_sweep(spec, out, placement)
    source, study = (optuna_source(plan.inputs) if spec.search == "optuna"
                     else (ListSource(list(plan.todo)), None))
    sweep = SweepRun(plan, source, progress)
    sweep.emit("plan", {**plan.counts, "slots": concurrent})
    if before_trials:
        before_trials(plan)
    tracker = Tracker.start(out, spec.report_to, sweep.info())
    with tracker.live(sweep.asked_params, sweep.rows_now) if tracker else nullcontext():
        try:
            rows = run_trials(sweep, placement, plan.rules(concurrent), study=study,
                              on_event=sweep.on_event, wrap=wrap)
        except TrialsInterrupted as stop:
            sweep.write(stop.rows)
            raise
        return sweep.write(rows)  # written before the trackers' last sync reads it


def optuna_source(inputs: SweepInputs) -> tuple[OptunaSource, Any]:
    """Optuna's study (a Ray actor) and the source that plans each trial it asks: resolved by
    the memory probe, answered from the cache where an earlier run finished it."""
    import ray

    spec = inputs.spec
    study = ray.remote(num_cpus=0)(Study).remote(spec.space, spec.mode, spec.seed,
                                                 spec.pruning)

    def build(params: dict[str, Any], number: int) -> TrialPlan:
        [plan] = inputs.resolve([spec.plan(params, inputs.out, number)])
        return plan

    return OptunaSource(spec, study, build, lambda plan: inputs.cached(inputs.keyed(plan)),
                        lambda s: metric_value(s, spec.metric)), study


class SweepRun:
    """A planned sweep running: the trials its source asked (keyed, for the trackers and the
    table), the rows finished so far, each written to results.parquet as it finishes. It
    is the scheduler's source: each trial asked is recorded before it runs."""

    def __init__(self, plan: SweepPlan, source: PlannedSource, progress: EventHook | None):
        self.plan, self.source, self.progress = plan, source, progress
        self.asked: dict[str, Keyed] = {}  # trials the source asked this run, by id
        self.finished: list[Summary] = []  # this run's trials, as they finish
        self.lock = threading.Lock()

    def ask(self) -> TrialPlan | None:
        trial = self.source.ask()
        if trial is not None:
            keyed = self.plan.keyed.get(trial.id) or self.plan.inputs.keyed(trial)
            with self.lock:
                self.asked[trial.id] = keyed
        return trial

    def tell(self, trial: TrialPlan, summary: Summary) -> None:
        self.source.tell(trial, summary)

    def asked_params(self) -> dict[str, dict[str, Any]]:
        """The settings of the trials asked so far: the runs the trackers open before a
        trial has its row (a row's own param/ columns stand for the rest)."""
        with self.lock:
            return {tid: k.plan.params() for tid, k in self.asked.items()}

    def info(self) -> dict[str, Any]:
        """The sweep as its trackers tag it: its spec, data, model and code."""
        from importlib.metadata import PackageNotFoundError, version

        inputs = self.plan.inputs
        spec = json.loads(json.dumps(dataclasses.asdict(inputs.spec), default=str))
        try:
            pomona = version("pomona")
        except PackageNotFoundError:  # run from a checkout that was never installed
            pomona = "unknown"
        return {"name": inputs.spec.name, "spec": spec, "data_fingerprint": inputs.fingerprint,
                "model_key": inputs.model_key, "version": pomona,
                "code_version": CODE_VERSION, "sweep_dir": str(inputs.out.resolve())}

    def rows_now(self) -> dict[str, Summary]:
        """This run's rows so far (cached, refused, finished), by trial id: what its
        trackers send while results.parquet still holds an earlier run's."""
        with self.lock:  # copies: table() adds columns to these rows as it writes
            rows = [dict(r) for r in (*self.plan.done, *self.source.reused, *self.finished)]
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
                key = self.plan.key_of(summary.get("trial_id", ""), self.asked)
            with contextlib.suppress(Exception):  # a re-run recognises the trial by it
                keep_row(self.plan.inputs.out, summary, key)
            with contextlib.suppress(Exception):  # the final write reports it; trials go on
                self.write(rows)
        self.emit(kind, summary)

    def write(self, rows: list[Summary]) -> list[Summary]:
        """Every trial's row (cached, reused, run now) to results.parquet, atomically."""
        with self.lock:
            ordered = self.plan.table(rows, self.asked, self.source.reused)
            write_results(ordered, self.plan.inputs.out / RESULTS, sweep=True)
        return ordered
