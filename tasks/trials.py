"""Running trials on Ray: one fresh worker process per trial, pinned to one GPU or slot.

Each trial is a TrainConfig (a small dict crosses Ray, never arrays or models). The task
asks Ray for exactly one GPU (``num_gpus=1``: Ray >= 2.60 reports an Apple-Silicon GPU as
GPU 1, and sets CUDA_VISIBLE_DEVICES on CUDA hosts), or one unit of a custom resource a
cluster declares (``ray start --resources '{"mlx_gpu": 1}'``), or one CPU slot when there
is no GPU. ``max_calls=1`` gives every trial a fresh process, so MLX's memory and the
engine's state never leak from one trial into the next. Failures come back as a status
with a reason; the sweep goes on.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


@dataclass(frozen=True)
class Placement:
    """What one trial holds: a GPU, a custom resource, or CPU slots."""

    gpus: int = 0  # 1 = one GPU per trial
    resource: str | None = None  # e.g. "mlx_gpu", declared by `ray start --resources`
    cpus: float = 1.0  # slot size when there is no GPU

    def options(self) -> dict[str, Any]:
        # A trial that asks for a GPU or custom resource but not num_cpus would also hold
        # a CPU for life (DESIGN.md, Ray facts): ask for none.
        if self.resource:
            return {"num_cpus": 0, "resources": {self.resource: 1}}
        if self.gpus:
            return {"num_cpus": 0, "num_gpus": 1}
        return {"num_cpus": self.cpus}


def run_trial(trial_id: str, config: dict[str, Any]) -> dict[str, Any]:
    """Train one adapter (in the worker); return a small summary, never raise."""
    from engine.config import TrainConfig
    from engine.trainer import NonFiniteLoss, train

    started = time.time()
    base = {"trial_id": trial_id, "node": socket.gethostname(), "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "started": started}
    try:
        result = train(TrainConfig().replace(**config))
    except NonFiniteLoss as err:
        return {**base, "status": "failed", "reason": f"non_finite: {err}",
                "ended": time.time()}
    except Exception as err:  # a trial's crash is its result, not the sweep's
        reason = f"{type(err).__name__}: {err}"
        return {**base, "status": "failed", "reason": reason, "ended": time.time(),
                "traceback": traceback.format_exc(limit=5)}
    best = result.best_val or {}
    return {**base, "status": "completed", "reason": "", "ended": time.time(),
            "adapter": result.out, "steps": result.steps,
            "final_loss": result.final.get("loss"), "best_val_loss": best.get("val/loss"),
            "best_val_accuracy": best.get("val/rewards/accuracies"),
            "peak_memory_gb": result.peak_memory_gb, "tokens_per_sec": result.tokens_per_sec}


def run_trials(trials: list[tuple[str, dict[str, Any]]], placement: Placement,
               max_concurrent: int, results: Path | None = None,
               time_limit_s: float = 0.0) -> list[dict[str, Any]]:
    """Run ``trials`` on the connected Ray cluster, at most ``max_concurrent`` at a time;
    return the summaries in submission order (and write them to ``results`` if given).
    A trial past ``time_limit_s`` (0 = none) is killed and reported as ``time_limit``."""
    import ray

    remote = ray.remote(max_calls=1)(run_trial).options(**placement.options())
    queue = list(trials)
    running: dict[Any, tuple[str, float]] = {}
    done: dict[str, dict[str, Any]] = {}
    while queue or running:
        while queue and len(running) < max_concurrent:
            trial_id, config = queue.pop(0)
            running[remote.remote(trial_id, config)] = (trial_id, time.time())
        ready, _ = ray.wait(list(running), num_returns=1, timeout=1.0 if time_limit_s else None)
        for ref in ready:
            trial_id, _ = running.pop(ref)
            done[trial_id] = ray.get(ref)
        for ref, (trial_id, started) in list(running.items()):
            if time_limit_s and time.time() - started > time_limit_s:
                ray.cancel(ref, force=True)  # kills the worker process: memory comes back
                running.pop(ref)
                done[trial_id] = {"trial_id": trial_id, "status": "failed",
                                  "reason": f"time_limit: over {time_limit_s:g} s",
                                  "started": started, "ended": time.time()}
    summaries = [done[t] for t, _ in trials]
    if results is not None:
        write_results(summaries, results)
    return summaries


def write_results(rows: list[dict[str, Any]], path: Path) -> Path:
    """One row per trial, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in keys}), tmp)
    os.replace(tmp, path)
    return path
