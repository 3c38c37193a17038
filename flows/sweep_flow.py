"""The sweep as a Prefect flow: every trial a task run, progress and results as artifacts.

Trials still run in Ray actors (tasks/trials.py); the flow wraps each one in a task run
named after the trial, so the Prefect UI shows each trial's state, duration and log
lines (where it ran, retries after a lost node, its result). A progress artifact moves
as trials finish; a table artifact lists every trial at the end. Artifact keys are
lowercase letters, digits and dashes (Prefect's rule).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE

from flows.ray_session import ray_session
from tasks.sweep import metric_value, run_sweep
from tasks.sweep_spec import SweepSpec, load_spec
from tasks.trials import Placement, Summary, TrialRun

TABLE_COLUMNS = ("trial_id", "status", "reason", "node", "attempts", "duration_s",
                 "peak_memory_gb", "tokens_per_sec")


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key: lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")


class MetricsTail:
    """Follows a trial's ``metrics.jsonl`` (written by its Ray worker) into this task run's
    log while the trial trains, so the worker's progress is on its task run in the UI."""

    def __init__(self, path: Path, log: Callable[[str], None], every_s: float = 2.0):
        self.path, self.log, self.every_s = path, log, every_s
        self.offset, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            self.flush()

    def flush(self) -> None:
        if not self.path.exists():
            return
        if self.path.stat().st_size < self.offset:  # the trainer started the log afresh
            self.offset = 0
        with self.path.open() as f:
            f.seek(self.offset)
            for line in f:
                if line.endswith("\n"):
                    self.offset += len(line.encode())
                    self.log(line.strip())

    def __enter__(self) -> MetricsTail:
        if self.path.exists():  # a re-run appends: show only this run's lines
            self.offset = self.path.stat().st_size
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.flush()


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="{trial.id}")
def trial_task(trial: TrialRun, run: Callable[[], Summary]) -> Summary:
    """One trial, run in its Ray actor by ``run``; its training log and outcome logged on
    this task run."""
    logger = get_run_logger()
    logger.info("trial %s: %s", trial.id, {k: v for k, v in trial.config.items()
                                            if k not in ("model", "data", "out")})
    metrics = Path(trial.config["out"]) / "metrics.jsonl"
    with MetricsTail(metrics, lambda line: logger.info("%s: %s", trial.id, line)):
        summary = run()
    log = logger.info if summary["status"] in ("completed", "pruned") else logger.warning
    where = (f"{summary['world_size']} ranks: " + ", ".join(summary["hosts"])
             if summary.get("hosts") else f"{summary.get('node')} (pid {summary.get('pid')})")
    log("trial %s %s%s on %s", trial.id, summary["status"],
        f": {summary['reason']}" if summary.get("reason") else "", where)
    if summary.get("traceback"):
        logger.warning("%s", summary["traceback"])
    return summary


def table_rows(rows: list[Summary], metric: str) -> list[dict[str, Any]]:
    """The trials table artifact: a few columns, the metric, every param."""
    return [{**{k: r.get(k) for k in TABLE_COLUMNS}, metric: metric_value(r, metric),
             **{k: r[k] for k in r if k.startswith("param/")}} for r in rows]


def sweep_stage(spec: SweepSpec, out_dir: Path, address: str | None = None,
                gpus: bool = False, resource: str | None = None) -> list[Summary]:
    """Run ``spec`` inside the current flow run: each trial a task run, with a progress
    artifact that moves as trials finish and a table artifact of every trial at the end."""
    logger = get_run_logger()
    progress_id = create_progress_artifact(0.0, key=artifact_key(spec.name, "progress"),
                                           description=f"sweep {spec.name}: trials finished")
    lock, counts = threading.Lock(), {"total": 0, "done": 0}

    def on_event(kind: str, summary: Summary) -> None:
        with lock:
            if kind == "plan":
                counts["total"] = summary["trials"]
                counts["done"] = summary.get("cached", 0)
                logger.info("sweep %s: %s", spec.name, summary)
            elif kind == "finished":
                counts["done"] += 1
            elif kind == "lost":
                logger.warning("trial %s lost its process (%s); retrying",
                               summary["trial_id"], summary.get("reason"))
            else:
                return
            pct = 100.0 * counts["done"] / max(counts["total"], 1)
        update_progress_artifact(progress_id, min(pct, 100.0))

    def wrap(trial: TrialRun, run: Callable[[], Summary]) -> Summary:
        return trial_task(trial, run)

    with ray_session(address):
        rows = run_sweep(spec, out_dir, Placement(gpus=int(gpus), resource=resource),
                         progress=on_event, wrap=wrap)
    update_progress_artifact(progress_id, 100.0)
    create_table_artifact(table_rows(rows, spec.metric), key=artifact_key(spec.name, "trials"),
                          description=f"sweep {spec.name}: {out_dir / 'results.parquet'}")
    return rows


@flow(name="pomona-sweep", result_serializer="json")
def sweep_flow(spec_path: str, out: str | None = None, address: str | None = None,
               gpus: bool = False, resource: str | None = None) -> list[dict[str, Any]]:
    """Run a sweep spec on Ray; each trial a task run of this flow run."""
    spec = load_spec(spec_path)
    out_dir = Path(out) if out else Path("runs") / spec.name
    rows = sweep_stage(spec, out_dir, address, gpus, resource)
    return [{k: r.get(k) for k in TABLE_COLUMNS} for r in rows]
