"""One trial in its own process: train one adapter, answer a small summary, never raise.

A trial is a ``TrialPlan`` (tasks/sweep/trial_plan.py) that crosses Ray as its ``to_dict()``
(never arrays or models) and is rebuilt once here. Its process is a fresh Ray actor
(``TrialActor``) that the scheduler (tasks/sweep/scheduler.py) kills when the trial ends, so
MLX's memory never leaks into the next. A trial that raises, goes
non-finite or is pruned by the study comes back as a status with a reason.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
import traceback
from typing import Any

from engine.host.blas import openblas_loaded
from engine.host.command_queue import QUEUE_MB
from engine.settings.config import TrainConfig
from tasks.eval.degenerate import degenerate_reason
from tasks.nodes.node_files import Bundle, local_reader
from tasks.nodes.trial_inputs import (
    SendMetrics,
    localised,
    outputs_bundle,
    remove_scratch,
    remove_stale_scratch,
)
from tasks.sweep.trial_plan import TrialPlan

Summary = dict[str, Any]


def outcome(trial: TrialPlan, status: str, reason: str, started: float,
            attempts: int) -> Summary:
    """The summary of a trial its own process never answered for (cancelled, lost, over
    its time limit)."""
    return {"trial_id": trial.id, "status": status, "reason": reason, "started": started,
            "ended": time.time(), "attempts": attempts}


STATUSES = ("completed", "degenerate", "failed", "pruned", "cancelled")


def checked(trial: TrialPlan, raw: Any, started: float, attempts: int) -> Summary:
    """``raw``, a summary a trial's process answered, if it is one this driver can rank;
    else a failed row saying what was wrong (a node on an older Pomona, say), so that one
    bad answer costs its trial and never the sweep's results.parquet."""
    node = raw.get("node") if isinstance(raw, dict) else None
    why = None
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        why = f"not a mapping of names ({type(raw).__name__})"
    elif raw.get("trial_id") != trial.id:
        why = f"trial_id {str(raw.get('trial_id'))[:80]!r}, not {trial.id!r}"
    elif raw.get("status") not in STATUSES:
        why = f"status {str(raw.get('status'))[:80]!r}, not one of {', '.join(STATUSES)}"
    elif not isinstance(raw.get("outputs", {}), dict):
        why = "outputs not a mapping"
    if why is None:
        return raw
    where = f" from {node}" if isinstance(node, str) else ""
    return outcome(trial, "failed", f"malformed_summary{where}: {why} (is every node on "
                   "this Pomona?)", started, attempts)


class TrialPruned(Exception):
    """Raised inside a trial when the study says its validation metric is not promising."""


class PruneCallback:
    """Engine callback: report each validation ``metric`` to the study; stop if pruned."""

    def __init__(self, study: Any, number: int, metric: str):
        self.study, self.number, self.metric = study, number, metric

    def on_metrics(self, record: dict[str, Any]) -> None:
        import ray

        if record.get("split") != "valid" or self.metric not in record:
            return
        step, value = int(record["step"]), float(record[self.metric])
        if ray.get(self.study.report.remote(self.number, step, value)):
            raise TrialPruned(f"pruned at step {step}: {self.metric}={value:.4g}")


class GradNorms:
    """Engine callback: the ``grad_norm`` of every training report, in order, and the
    steps where every GRPO group's rewards tied (``frac_reward_zero_std`` 1: no signal)."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, float]] = []
        self.tied: set[int] = set()

    def on_metrics(self, record: dict[str, Any]) -> None:
        if record.get("split") == "train" and "grad_norm" in record:
            self.reports.append((int(record["step"]), float(record["grad_norm"])))
            if record.get("frac_reward_zero_std") == 1.0:
                self.tied.add(int(record["step"]))


def run_trial(trial_id: str, config: TrainConfig, study: Any = None,
              number: int | None = None, metric: str = "val/loss",
              extra: list[Any] | None = None) -> Summary:
    """Train one adapter (in the trial's process); return a small summary, never raise.

    A run that finishes but has collapsed (``degenerate_reason``) is ``degenerate``, with
    its reason: it keeps its adapter and metrics but is never ranked.
    """
    importing = time.time()  # a fresh process's first trial: MLX and the engine load here
    from engine.train.dispatch import train_any
    from engine.train.steps import NonFiniteLoss

    started = time.time()
    base = {"trial_id": trial_id, **where(), "started": started,
            **phase_columns({"imports": started - importing})}
    norms = GradNorms()
    callbacks = [norms, *([PruneCallback(study, number, metric)] if study is not None else []),
                 *(extra or [])]
    try:
        result = train_any(config, callbacks)
    except TrialPruned as err:
        return {**base, "status": "pruned", "reason": str(err), "ended": time.time()}
    except NonFiniteLoss as err:
        return {**base, "status": "failed", "reason": f"non_finite: {err}",
                "ended": time.time()}
    except Exception as err:  # a trial's crash is its result, not the sweep's
        reason = f"{type(err).__name__}: {err}"
        return {**base, "status": "failed", "reason": reason, "ended": time.time(),
                "traceback": traceback.format_exc(limit=5)}
    return summary_of(base, result, norms)


def summary_of(base: Summary, result: Any, norms: GradNorms) -> Summary:
    """A trained run's summary (engine/train/run_parts.py's TrainResult): ``completed``, or
    ``degenerate`` with its reason where it has collapsed (``degenerate_reason``: it keeps
    its adapter and metrics but is never ranked)."""
    best = result.best_val or {}
    reason = degenerate_reason(norms.reports, best, frozenset(norms.tied))
    return {**base, "status": "degenerate" if reason else "completed", "reason": reason,
            "ended": time.time(),
            "adapter": result.out, "steps": result.steps,
            "final_loss": result.final.get("loss"), "best_val_loss": best.get("val/loss"),
            "best_val_accuracy": best.get("val/logps/accuracies"),
            **{f"best/{k}": v for k, v in best.items() if k.startswith("val/")},
            "peak_memory_gb": result.peak_memory_gb, "tokens_per_sec": result.tokens_per_sec,
            "train_s": result.seconds, **phase_columns(result.phases)}


def phase_columns(phases: dict[str, float]) -> dict[str, float]:
    """A trial's ``phase/`` columns: where its seconds went (engine/train/run_parts.py's
    PHASES; the trial's process adds ``imports`` and ``inputs``, the driver
    ``actor_start`` and ``pull``)."""
    return {f"phase/{k}": v for k, v in phases.items()}


def pack_name(ids: list[str]) -> str:
    """A pack's name, from its trials' ids (``p-`` and 10 hex digits)."""
    return "p-" + hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()[:10]


def run_pack_trials(ids: list[str], configs: list[TrainConfig],
                    extras: list[list[Any]] | None = None) -> list[Summary]:
    """Train trials as one pack (engine/train/pack_trainer.py) in this process: each one's
    summary, never raise. A trial whose loss turned non-finite failed alone; a pack that
    could not train (a refusal, memory) fails every trial, naming the pack. Each row says
    its pack (``pack``: a name from its trials' ids) and the pack's size."""
    from engine.train.pack_trainer import train_pack
    from engine.train.steps import NonFiniteLoss

    started, here = time.time(), where()
    bases = [{"trial_id": i, **here, "started": started, "pack": pack_name(ids),
              "pack_size": len(ids)}
             for i in ids]
    norms = [GradNorms() for _ in ids]
    heard = [[n, *(extras[i] if extras else [])] for i, n in enumerate(norms)]
    try:
        results = train_pack(configs, heard)
    except Exception as err:  # the pack's crash is each trial's result, not the sweep's
        reason = f"pack of {len(ids)}: {type(err).__name__}: {err}"
        return [{**b, "status": "failed", "reason": reason, "ended": time.time(),
                 "traceback": traceback.format_exc(limit=5)} for b in bases]
    return [{**b, "status": "failed", "reason": f"non_finite: {r}", "ended": time.time()}
            if isinstance(r, NonFiniteLoss) else summary_of(b, r, n)
            for b, r, n in zip(bases, results, norms, strict=True)]


def where() -> dict[str, Any]:
    """Where this process runs: host, Ray node id, pid, the GPU it was given, and MLX's
    command-buffer cap (set under a memory limit: engine/host/command_queue.py)."""
    try:
        import ray

        # Asked outside Ray (a plain call of run_trial), the runtime context starts one.
        node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        node_id = None
    return {"node": socket.gethostname(), "node_id": node_id, "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "openblas": openblas_loaded(),
            "mlx_queue_mb": os.environ.get(QUEUE_MB)}


class TrialActor:
    """The process one trial runs in (made a Ray actor by tasks/sweep/attempts.py): it fetches
    the trial's inputs by content, trains in a scratch folder of its node, and serves its
    outputs to the driver (tasks/nodes/trial_inputs.py)."""

    outputs: Bundle | None = None
    bundles: dict[str, Bundle] | None = None  # a pack's outputs, by trial id

    def run(self, plan: dict[str, Any], study: Any = None, metric: str = "val/loss",
            inputs: dict[str, Any] | None = None, box: Any = None) -> Summary:
        """The trial ``TrialPlan.to_dict`` sent, rebuilt here once, trained on this node's
        copies of ``inputs``; its outputs listed in ``outputs`` for the driver to pull."""
        trial = TrialPlan.from_dict(plan)
        started = time.time()
        remove_stale_scratch()  # what attempts lost with their process left on this node
        try:
            config, back = localised(trial.config, inputs, trial.id)
        except (OSError, RuntimeError) as err:  # an input this node cannot have: say which
            return {"trial_id": trial.id, **where(), "started": started, "ended": time.time(),
                    "status": "failed", "reason": f"inputs on {socket.gethostname()}: {err}"}
        fetched_s = time.time() - started  # this node's copies of the inputs, by content
        extra = [SendMetrics(box, trial.id)] if box is not None else []
        summary = {**run_trial(trial.id, config, study, trial.number, metric, extra),
                   **phase_columns({"inputs": fetched_s})}
        if not summary.get("adapter"):  # nothing to pull: the scratch folder goes now
            remove_scratch(config.out)
            return summary
        self.outputs = outputs_bundle(config.out, back)
        return {**summary, "outputs": self.outputs.to_dict()}

    def run_pack(self, plans: list[dict[str, Any]], inputs: list[dict[str, Any] | None],
                 box: Any = None) -> list[Summary]:
        """The trials ``TrialPlan.to_dict`` sent, trained as one pack on this node's copies
        of each one's ``inputs`` (a trial whose inputs this node cannot have fails alone;
        the others pack without it); each one's outputs listed apart, by trial id."""
        trials = [TrialPlan.from_dict(p) for p in plans]
        started = time.time()
        remove_stale_scratch()
        rows: dict[str, Summary] = {}
        packed: list[tuple[TrialPlan, TrainConfig, dict[str, str]]] = []
        for trial, given in zip(trials, inputs, strict=True):
            try:
                packed.append((trial, *localised(trial.config, given, trial.id)))
            except (OSError, RuntimeError) as err:  # say which input, on which node
                rows[trial.id] = {"trial_id": trial.id, **where(), "started": started,
                                  "ended": time.time(), "status": "failed",
                                  "reason": f"inputs on {socket.gethostname()}: {err}"}
        extras = [[SendMetrics(box, t.id)] if box is not None else [] for t, _, _ in packed]
        done = (run_pack_trials([t.id for t, _, _ in packed], [c for _, c, _ in packed],
                                extras) if packed else [])
        self.bundles = {}
        for (trial, config, back), row in zip(packed, done, strict=True):
            if not row.get("adapter"):  # nothing to pull: its scratch folder goes now
                remove_scratch(config.out)
                rows[trial.id] = row
                continue
            self.bundles[trial.id] = outputs_bundle(config.out, back)
            rows[trial.id] = {**row, "outputs": self.bundles[trial.id].to_dict()}
        return [rows[t.id] for t in trials]

    def read(self, rel: str, offset: int, length: int, trial_id: str | None = None) -> bytes:
        """A chunk of one of this attempt's output files (tasks/nodes/node_files.pull): a
        pack's, of trial ``trial_id``'s."""
        bundle = self.outputs if trial_id is None else (self.bundles or {}).get(trial_id)
        assert bundle is not None, "no outputs to read"
        return local_reader(bundle)(rel, offset, length)

    def cleanup(self, trial_id: str | None = None) -> None:
        """The scratch folder of this attempt's outputs once the driver has them: a pack's
        trial's alone, or (no id) every one this actor holds."""
        if trial_id is not None:
            bundle = (self.bundles or {}).pop(trial_id, None)
            if bundle is not None:
                remove_scratch(bundle.path)
            return
        for bundle in [self.outputs, *(self.bundles or {}).values()]:
            if bundle is not None:
                remove_scratch(bundle.path)

    def resident_gb(self) -> tuple[float, float]:
        """This process's memory and the node's (tasks/sweep/warm_actor.py)."""
        from tasks.sweep.warm_actor import resident_gb

        return resident_gb()

    def where(self) -> dict[str, Any]:
        return where()
