"""Running trials on Ray: one fresh actor per trial, pinned to one GPU or slot.

Each trial is a TrainConfig as a small dict (never arrays or models cross Ray). Its actor
asks Ray for exactly one GPU (``num_gpus=1``: Ray >= 2.60 reports an Apple-Silicon GPU as
GPU 1, and sets CUDA_VISIBLE_DEVICES on CUDA hosts), or one unit of a custom resource a
cluster declares (``ray start --resources '{"mlx_gpu": 1}'``), or one CPU slot when there
is no GPU. The actor is killed when its trial ends, so every trial gets a fresh process
and MLX's memory never leaks into the next.

``max_concurrent`` driver threads each take a trial from a source (a list, or an Optuna
study asked trial by trial), start its actor and wait. A trial that raises, goes
non-finite, is pruned or exceeds its time limit comes back as a status with a reason; the
sweep goes on. A trial whose actor dies (its node left, the process was killed) is
retried on a fresh actor after ``retry_delay_s``, up to ``retries`` times: Ray takes ~20 s
to declare a node dead, so the budget must outlast that. Ctrl-C kills the running actors
and marks their trials ``cancelled``.
"""

from __future__ import annotations

import contextvars
import json
import math
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

Summary = dict[str, Any]
EventHook = Callable[[str, Summary], None]  # ("started" | "retry" | "finished", summary)
# Runs one trial's work (the callable) as the caller likes, e.g. as a Prefect task run.
Wrap = Callable[["TrialRun", Callable[[], Summary]], Summary]


@dataclass(frozen=True)
class Placement:
    """What one trial holds: a GPU, a custom resource, or CPU slots."""

    gpus: int = 0  # 1 = one GPU per trial
    resource: str | None = None  # e.g. "mlx_gpu", declared by `ray start --resources`
    cpus: float = 1.0  # slot size when there is no GPU

    def options(self) -> dict[str, Any]:
        # An actor that asks for a GPU or custom resource but not num_cpus would also hold
        # a CPU for life (DESIGN.md, Ray facts): ask for none.
        if self.resource:
            return {"num_cpus": 0, "resources": {self.resource: 1}}
        if self.gpus:
            return {"num_cpus": 0, "num_gpus": 1}
        return {"num_cpus": self.cpus}

    def fresh_task(self, fn: Callable[..., Any]) -> Any:
        """``fn`` as a Ray task on this placement, in a fresh worker process each call
        (MLX's peak and memory are per process: probes and evaluations measure alone)."""
        import ray

        return ray.remote(max_calls=1)(fn).options(**self.options())


@dataclass(frozen=True)
class TrialRun:
    """One trial to run: id, TrainConfig fields, and its Optuna number when it has one."""

    id: str
    config: dict[str, Any]
    number: int | None = None


class TrialSource(Protocol):
    """Where trials come from; ``ask`` and ``tell`` are called from several threads."""

    def ask(self) -> TrialRun | None: ...

    def tell(self, trial: TrialRun, summary: Summary) -> None: ...


@dataclass
class ListSource:
    """A fixed list of trials (grid and random search)."""

    trials: list[TrialRun]
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def ask(self) -> TrialRun | None:
        with self._lock:
            if self._next >= len(self.trials):
                return None
            self._next += 1
            return self.trials[self._next - 1]

    def tell(self, trial: TrialRun, summary: Summary) -> None:
        return None


class TrialsInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``run_trials``; ``rows`` holds every summary so far (cancelled too)."""

    def __init__(self, rows: list[Summary]):
        super().__init__("sweep interrupted")
        self.rows = rows


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
    """Engine callback: the ``grad_norm`` of every training report, in order."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, float]] = []

    def on_metrics(self, record: dict[str, Any]) -> None:
        if record.get("split") == "train" and "grad_norm" in record:
            self.reports.append((int(record["step"]), float(record["grad_norm"])))


ZERO_GRAD_REPORTS = 2  # trailing training reports at exactly 0.0 that mean "stopped learning"
BELOW_CHANCE = 0.15  # validation accuracy this far under 0.5 ...
BELOW_CHANCE_P = 1e-3  # ... and this unlikely for a coin (one-sided binomial tail)


def degenerate_reason(reports: list[tuple[int, float]], best_val: dict[str, Any]) -> str:
    """Why a run that finished has collapsed ("" if it has not).

    A learning rate far too high can saturate the model: every gradient is then exactly 0
    (a float32 gradient norm is never 0.0 while anything is learned) and the pairs' logps
    tie, so held-out preference accuracy falls to 0 while the loss looks low (issue 14:
    lr 1e8 ranked first).
    """
    zeros = 0
    for _, norm in reversed(reports):
        if norm != 0.0:
            break
        zeros += 1
    if zeros and zeros >= min(ZERO_GRAD_REPORTS, len(reports)):
        first = reports[len(reports) - zeros][0]
        return (f"degenerate: zero gradients for {zeros} reports (grad_norm 0.0 from step "
                f"{first}): the model stopped learning")
    return below_chance(best_val.get("val/logps/accuracies"), best_val.get("val/rows"),
                        f"val accuracy at step {best_val.get('step')}")


def below_chance(accuracy: float | None, rows: int | None, what: str) -> str:
    """A reason when preference ``accuracy`` on ``rows`` pairs is below chance (0.5) by
    more than BELOW_CHANCE, on enough pairs that a coin would rarely score so low."""
    if accuracy is None or not rows or not accuracy < 0.5 - BELOW_CHANCE:
        return ""
    rows, hits = int(rows), round(float(accuracy) * int(rows))
    tail = sum(math.comb(rows, k) for k in range(hits + 1)) / 2**rows
    if tail >= BELOW_CHANCE_P:
        return ""
    return (f"degenerate: {what} {accuracy:.3f} on {rows} pairs, below chance (0.5) by more "
            f"than {BELOW_CHANCE}")


def run_trial(trial_id: str, config: dict[str, Any], study: Any = None,
              number: int | None = None, metric: str = "val/loss") -> Summary:
    """Train one adapter (in the trial's process); return a small summary, never raise.

    A run that finishes but has collapsed (``degenerate_reason``) is ``degenerate``, with
    its reason: it keeps its adapter and metrics but is never ranked.
    """
    from engine.config import TrainConfig
    from engine.trainer import NonFiniteLoss, train

    started = time.time()
    base = {"trial_id": trial_id, **where(), "started": started}
    norms = GradNorms()
    callbacks = [norms, *([PruneCallback(study, number, metric)] if study is not None else [])]
    try:
        result = train(TrainConfig().replace(**config), callbacks)
    except TrialPruned as err:
        return {**base, "status": "pruned", "reason": str(err), "ended": time.time()}
    except NonFiniteLoss as err:
        return {**base, "status": "failed", "reason": f"non_finite: {err}",
                "ended": time.time()}
    except Exception as err:  # a trial's crash is its result, not the sweep's
        reason = f"{type(err).__name__}: {err}"
        return {**base, "status": "failed", "reason": reason, "ended": time.time(),
                "traceback": traceback.format_exc(limit=5)}
    best = result.best_val or {}
    reason = degenerate_reason(norms.reports, best)
    return {**base, "status": "degenerate" if reason else "completed", "reason": reason,
            "ended": time.time(),
            "adapter": result.out, "steps": result.steps,
            "final_loss": result.final.get("loss"), "best_val_loss": best.get("val/loss"),
            "best_val_accuracy": best.get("val/logps/accuracies"),
            **{f"best/{k}": v for k, v in best.items() if k.startswith("val/")},
            "peak_memory_gb": result.peak_memory_gb, "tokens_per_sec": result.tokens_per_sec}


def where() -> dict[str, Any]:
    """Where this process runs: host, Ray node id, pid, the GPU it was given."""
    try:
        import ray

        # Asked outside Ray (a plain call of run_trial), the runtime context starts one.
        node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        node_id = None
    return {"node": socket.gethostname(), "node_id": node_id, "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


class TrialActor:
    """The process one trial runs in (made a Ray actor by ``run_trials``)."""

    def run(self, trial_id: str, config: dict[str, Any], study: Any = None,
            number: int | None = None, metric: str = "val/loss") -> Summary:
        return run_trial(trial_id, config, study, number, metric)

    def where(self) -> dict[str, Any]:
        return where()


@dataclass
class _Runner:
    """Runs one trial at a time per thread; shared state for cancellation."""

    placement: Placement
    time_limit_s: float
    retries: int
    retry_delay_s: float
    study: Any
    metric: str
    on_event: EventHook | None
    stopping: threading.Event = field(default_factory=threading.Event)
    live: dict[str, Any] = field(default_factory=dict)  # trial id -> actor
    lock: threading.Lock = field(default_factory=threading.Lock)
    actor_cls: Any = None  # TrialActor as a Ray actor class, made once per run
    ranks: int = 1  # > 1: each trial a gang of ranks (tasks/gang.py)
    gang_wait_s: float = 120.0  # how long a gang may wait for its placement group

    def __post_init__(self) -> None:
        import ray

        self.actor_cls = ray.remote(max_restarts=0, max_task_retries=0)(TrialActor).options(
            **self.placement.options())

    def event(self, kind: str, summary: Summary) -> None:
        if self.on_event:
            self.on_event(kind, summary)

    def run(self, trial: TrialRun) -> Summary:
        """The trial's summary after at most ``retries`` retries of a lost actor."""
        first = time.time()
        for attempt in range(self.retries + 1):
            if self.stopping.is_set():
                return _summary(trial, "cancelled", "sweep interrupted", first, attempt)
            self.event("started", {"trial_id": trial.id, "attempt": attempt})
            summary = self._attempt(trial, attempt, first)
            if summary is not None:
                return {**summary, "attempts": attempt + 1}
            if attempt < self.retries:
                self.event("retry", {"trial_id": trial.id, "attempt": attempt})
                self.stopping.wait(self.retry_delay_s)
        return _summary(trial, "failed", f"lost: its process died {self.retries + 1} times "
                        "(node gone or killed)", first, self.retries + 1)

    def _attempt(self, trial: TrialRun, attempt: int, first: float) -> Summary | None:
        """One actor's run; None when the actor died and the trial may be retried."""
        import ray

        if self.ranks > 1:
            from tasks.gang import run_gang

            return run_gang(self, trial, attempt, first)

        actor = self.actor_cls.remote()
        try:
            if not self.register(trial.id, actor):
                return _summary(trial, "cancelled", "sweep interrupted", first, attempt + 1)
            placed = actor.where.remote()
            ref = actor.run.remote(trial.id, trial.config, self.study, trial.number,
                                   self.metric)
            # Once the actor is up (the time limit counts from here): where it runs.
            self.event("running", {"trial_id": trial.id, "attempt": attempt,
                                   **ray.get(placed)})
            ready, _ = ray.wait([ref], timeout=self.time_limit_s or None)
            if not ready:
                return _summary(trial, "failed", f"time_limit: over {self.time_limit_s:g} s",
                                first, attempt + 1)
            return ray.get(ref)
        except ray.exceptions.RayActorError as err:
            if self.stopping.is_set():
                return _summary(trial, "cancelled", "sweep interrupted", first, attempt + 1)
            self.event("lost", {"trial_id": trial.id, "attempt": attempt,
                                "reason": str(err).splitlines()[0][:200]})
            return None
        except ray.exceptions.RayError as err:  # e.g. an argument that would not unpickle
            return _summary(trial, "failed", f"{type(err).__name__}: {err}"[:500], first,
                            attempt + 1)
        finally:
            with self.lock:
                self.live.pop(trial.id, None)
            ray.kill(actor)  # the process and its memory go; the next trial starts fresh

    def register(self, trial_id: str, actors: Any) -> bool:
        """Hold ``actors`` as the trial's live ones, unless the sweep is stopping (False).
        Checked under the lock ``cancel_all`` takes: an actor made while Ctrl-C was being
        handled would otherwise never be killed, and run its trial to the end."""
        with self.lock:
            if self.stopping.is_set():
                return False
            self.live[trial_id] = actors
            return True

    def cancel_all(self) -> None:
        import ray

        with self.lock:
            self.stopping.set()
            held = list(self.live.values())
        for actors in held:  # one actor per trial, or a gang's list
            for actor in actors if isinstance(actors, list) else [actors]:
                ray.kill(actor)


def _summary(trial: TrialRun, status: str, reason: str, started: float,
             attempts: int) -> Summary:
    return {"trial_id": trial.id, "status": status, "reason": reason, "started": started,
            "ended": time.time(), "attempts": attempts}


def run_trials(source: TrialSource | list[TrialRun] | list[tuple[str, dict[str, Any]]],
               placement: Placement, max_concurrent: int, results: Path | None = None,
               time_limit_s: float = 0.0, retries: int = 2, retry_delay_s: float = 5.0,
               study: Any = None, metric: str = "val/loss",
               on_event: EventHook | None = None, wrap: Wrap | None = None,
               ranks_per_trial: int = 1) -> list[Summary]:
    """Run the source's trials on the connected Ray cluster, ``max_concurrent`` at a time.

    Returns the summaries in the order trials were asked (written to ``results`` if
    given). Ctrl-C: running trials are killed and reported ``cancelled``, the rest of the
    source is not started, ``results`` is written, and TrialsInterrupted (a
    KeyboardInterrupt carrying the summaries so far) is raised. ``wrap(trial, run)``
    runs each trial's ``run()`` (the flow makes it a Prefect task run); worker threads
    run in a copy of the caller's context, so such task runs nest in the caller's flow run.
    ``ranks_per_trial`` > 1 runs each trial as a gang of that many ranks (tasks/gang.py).
    """
    if isinstance(source, list):
        source = ListSource([t if isinstance(t, TrialRun) else TrialRun(*t) for t in source])
    runner = _Runner(placement, time_limit_s, retries, retry_delay_s, study, metric, on_event,
                     ranks=ranks_per_trial)
    summaries: dict[str, Summary] = {}
    order: list[str] = []
    order_lock = threading.Lock()

    def worker() -> None:
        while not runner.stopping.is_set():
            trial = source.ask()
            if trial is None:
                return
            with order_lock:
                order.append(trial.id)
            summary = wrap(trial, lambda t=trial: runner.run(t)) if wrap else runner.run(trial)
            summary["duration_s"] = summary["ended"] - summary["started"]
            summaries[trial.id] = summary
            source.tell(trial, summary)
            runner.event("finished", summary)

    interrupted = False
    pool = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="trial")
    context = contextvars.copy_context()
    futures = [pool.submit(context.copy().run, worker) for _ in range(max_concurrent)]
    try:
        while not all(f.done() for f in futures):
            time.sleep(0.2)  # the main thread stays free to take Ctrl-C
        for f in futures:
            f.result()  # a bug in the scheduler itself surfaces here
    except KeyboardInterrupt:
        interrupted = True
        while not all(f.done() for f in futures):  # kills what started meanwhile, too
            runner.cancel_all()
            time.sleep(0.5)
    finally:
        pool.shutdown(wait=True)
    rows = [summaries[t] for t in order if t in summaries]
    if results is not None:
        write_results(rows, results)
    if interrupted:
        raise TrialsInterrupted(rows)
    return rows


def write_results(rows: list[dict[str, Any]], path: Path) -> Path:
    """One row per trial, atomically; every column is written whatever its values mix
    (``column``), so no parameter a user swept can cost the table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    pq.write_table(pa.table({k: column([r.get(k) for r in rows]) for k in keys}), tmp)
    os.replace(tmp, path)
    return path


def column(values: list[Any]) -> pa.Array:
    """``values`` as one Arrow column: as they are when Arrow takes them; numbers of mixed
    kinds as float64 (NaN stays NaN); anything else mixed as text (JSON for non-strings),
    e.g. a grid of ``[3.0e-4, "1e-4"]``."""
    try:
        return pa.array(values)
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        pass
    present = [v for v in values if v is not None]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return pa.array([None if v is None else float(v) for v in values], pa.float64())
    return pa.array([v if v is None or isinstance(v, str) else json.dumps(v, default=str)
                     for v in values], pa.string())
