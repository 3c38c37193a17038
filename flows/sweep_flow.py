"""The sweep as a Prefect flow: every trial a task run, progress and results as artifacts.

Once the sweep is planned, its trials' reference log-probs (DPO, KTO) are made first, once
per reference, as a task run of their own (tasks/prefect/reference_task.py). Trials still
run in Ray actors (tasks/sweep/scheduler.py); the flow wraps each one in a task run named
after the trial, so the Prefect UI shows each trial's state, duration and log
lines (where it ran, retries after a lost node, its result). A progress artifact moves
as trials finish; a table artifact lists every trial at the end. Artifact keys are
lowercase letters, digits and dashes (Prefect's rule).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import (
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from tasks.board.leaderboard import swept_params
from tasks.board.ranked_metric import metric_value
from tasks.nodes.cluster import Cluster
from tasks.nodes.placement import Placement
from tasks.prefect.pipeline_tasks import artifact_key
from tasks.prefect.reference_task import reference_tasks
from tasks.prefect.run_log import in_run_log
from tasks.prefect.trial_task import trial_task
from tasks.sweep.run import plan_line, run_sweep
from tasks.sweep.spec_file import load_spec
from tasks.sweep.sweep_spec import SweepSpec
from tasks.sweep.trial import Summary
from tasks.sweep.trial_plan import TrialPlan
from tasks.track.report_to import with_report_to

TABLE_COLUMNS = ("trial_id", "status", "reason", "node", "attempts", "duration_s",
                 "peak_memory_gb", "tokens_per_sec", "pack")


def table_rows(rows: list[Summary], metric: str) -> list[dict[str, Any]]:
    """The trials table artifact: a few columns, the metric, the params that differ
    between trials (results.parquet holds every setting: the leaderboard's choice)."""
    params = swept_params(rows)
    return [{**{k: r.get(k) for k in TABLE_COLUMNS}, metric: metric_value(r, metric),
             **{k: r.get(k) for k in params}} for r in rows]


def sweep_stage(spec: SweepSpec, out_dir: Path, placement: Placement) -> list[Summary]:
    """Run ``spec`` inside the current flow run, on the Ray session its caller opened, each
    trial on ``placement``: each trial a task run, with a progress artifact that moves as
    trials finish and a table artifact of every trial at the end."""
    logger = get_run_logger()
    progress_id = create_progress_artifact(0.0, key=artifact_key(spec.name, "progress"),
                                           description=f"sweep {spec.name}: trials finished")
    lock, counts = threading.Lock(), {"total": 0, "done": 0}

    def on_event(kind: str, summary: Summary) -> None:
        with lock:
            if kind == "plan":
                counts["total"] = summary["trials"]
                counts["done"] = summary.get("cached", 0)
                logger.info("sweep %s: %s", spec.name, plan_line(summary))
            elif kind == "finished":
                counts["done"] += 1
            elif kind == "lost":
                logger.warning("trial %s lost its process (%s); retrying",
                               summary["trial_id"], summary.get("reason"))
            else:
                return
            pct = 100.0 * counts["done"] / max(counts["total"], 1)
        update_progress_artifact(progress_id, min(pct, 100.0))

    def wrap(trial: TrialPlan, run: Callable[[], Summary]) -> Summary:
        return trial_task(trial, run)

    with in_run_log():  # a tracker that is down: one line on this flow run
        rows = run_sweep(spec, out_dir, placement, progress=on_event, wrap=wrap,
                         before_trials=lambda plan: reference_tasks(plan, placement))
    update_progress_artifact(progress_id, 100.0)
    create_table_artifact(table_rows(rows, spec.metric), key=artifact_key(spec.name, "trials"),
                          description=f"sweep {spec.name}: {out_dir / 'results.parquet'}")
    return rows


@flow(name="pomona-sweep", result_serializer="json")
def sweep_flow(spec_path: str, out: str | None = None, cluster: Cluster | None = None,
               report_to: list[str] | None = None) -> list[dict[str, Any]]:
    """Run a sweep spec on Ray (``cluster``; None: a private local one); each trial a task
    run of this flow run; ``report_to``: its trackers in place of the spec's."""
    spec = with_report_to(load_spec(spec_path), report_to)
    out_dir = Path(out) if out else Path("runs") / spec.name
    cluster = cluster or Cluster()
    with cluster.session():
        rows = sweep_stage(spec, out_dir, cluster.placement)
    return [{k: r.get(k) for k in TABLE_COLUMNS} for r in rows]
