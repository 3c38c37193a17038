"""A sweep trial as a Prefect task run: named after the trial, its worker's training log
followed into the run's log while it trains (``MetricsTail``), and its outcome, where it
ran and any traceback logged on it. flows/sweep_flow.py wraps every trial in one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engine.train.progress import progress_line
from tasks.sweep.trial import Summary
from tasks.sweep.trial_plan import TrialPlan


class MetricsTail:
    """Follows a trial's ``metrics.jsonl`` (written by its Ray worker) into this task run's
    log while the trial trains, so the worker's progress is on its task run in the UI: each
    whole line handed to ``log``."""

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
def trial_task(trial: TrialPlan, run: Callable[[], Summary]) -> Summary:
    """One trial, run in its Ray actor by ``run``; its training log and outcome logged on
    this task run."""
    logger = get_run_logger()
    logger.info("trial %s: %s", trial.id, ", ".join(
        f"{k}={v}" for k, v in trial.changed().items()))
    metrics = Path(trial.config.out) / "metrics.jsonl"
    steps = trial.config.steps

    def said(line: str) -> None:  # a record as its one line (the whole: metrics.jsonl)
        try:
            logger.info("%s", progress_line(json.loads(line), steps, trial.id))
        except (ValueError, AttributeError):  # not a record: a line written by hand
            logger.info("%s: %s", trial.id, line)

    with MetricsTail(metrics, said):
        summary = run()
    log = logger.info if summary["status"] in ("completed", "pruned") else logger.warning
    where = (f"{summary['world_size']} ranks: " + ", ".join(summary["hosts"])
             if summary.get("hosts") else f"{summary.get('node')} (pid {summary.get('pid')})")
    log("trial %s %s%s on %s", trial.id, summary["status"],
        f": {summary['reason']}" if summary.get("reason") else "", where)
    if summary.get("traceback"):
        logger.warning("%s", summary["traceback"])
    return summary
