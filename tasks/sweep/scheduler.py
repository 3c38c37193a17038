"""The sweep's scheduler: ``max_concurrent`` trials at a time on Ray, each retried when its
process is lost, every summary kept in the order trials were asked.

``max_concurrent`` driver threads each take a trial from a source (a list, or an Optuna
study asked trial by trial) and run it through a strategy (tasks/sweep/attempts.py: one fresh
actor per trial; tasks/sweep/gang.py: a gang of ranks), so every trial gets a fresh process and
MLX's memory never leaks into the next. A trial that raises, goes non-finite, is pruned or
exceeds its time limit comes back as a status with a reason; the sweep goes on. A trial
whose process dies (its node left, the process was killed) is retried on a fresh one after
``retry_delay_s``, up to ``retries`` times: Ray takes ~20 s to declare a node dead, so the
budget must outlast that. Ctrl-C kills the running actors and marks their trials
``cancelled``.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tasks.board.results_table import write_results
from tasks.nodes.placement import Placement
from tasks.nodes.trial_inputs import metrics_box
from tasks.sweep.attempts import Attempts, EventHook, LiveTrials, OneActor, Strategy
from tasks.sweep.gang import Gang
from tasks.sweep.packs import PackActor, PackRetrying, group_packs
from tasks.sweep.trial import Summary, outcome
from tasks.sweep.trial_plan import TrialPlan
from tasks.sweep.trial_rules import TrialRules

log = logging.getLogger(__name__)

# Runs one trial's work (the callable) as the caller likes, e.g. as a Prefect task run.
Wrap = Callable[[TrialPlan, Callable[[], Summary]], Summary]


class TrialSource(Protocol):
    """Where trials come from; ``ask`` and ``tell`` are called from several threads."""

    def ask(self) -> TrialPlan | None: ...

    def tell(self, trial: TrialPlan, summary: Summary) -> None: ...


@dataclass
class ListSource:
    """A fixed list of trials (grid and random search); it answers none from an earlier
    run itself (``reused``: the sweep plan took the cached ones out first)."""

    trials: list[TrialPlan]
    reused: list[Summary] = field(default_factory=list)
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def ask(self) -> TrialPlan | None:
        with self._lock:
            if self._next >= len(self.trials):
                return None
            self._next += 1
            return self.trials[self._next - 1]

    def tell(self, trial: TrialPlan, summary: Summary) -> None:
        return None


class TrialsInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``run_trials``; ``rows`` holds every summary so far (cancelled too)."""

    def __init__(self, rows: list[Summary]):
        super().__init__("sweep interrupted")
        self.rows = rows


@dataclass
class Retrying:
    """Runs one trial through ``strategy``, retrying an attempt whose process was lost."""

    strategy: Strategy
    live: LiveTrials
    retries: int
    retry_delay_s: float

    def run(self, trial: TrialPlan) -> Summary:
        """The trial's summary after at most ``retries`` retries of a lost process."""
        first = time.time()
        for attempt in range(self.retries + 1):
            if self.live.stopping.is_set():
                return outcome(trial, "cancelled", "sweep interrupted", first, attempt)
            self.live.event("started", {"trial_id": trial.id, "attempt": attempt})
            summary = self.strategy.attempt(trial, attempt, first)
            if summary is not None:
                # After a retry its duration spans every attempt (the last one's start kept).
                return {**summary, "attempts": attempt + 1,
                        **({"started": first, "attempt_started": summary.get("started")}
                           if attempt else {})}
            if attempt < self.retries:
                self.live.event("retry", {"trial_id": trial.id, "attempt": attempt})
                self.live.stopping.wait(self.retry_delay_s)
        return outcome(trial, "failed", f"lost: its process died {self.retries + 1} times "
                       "(node gone or killed)", first, self.retries + 1)


def contained(trial: TrialPlan, run: Callable[[], Summary]) -> Summary:
    """``run()``, or a failed row naming the error it raised on the driver (logged whole):
    one trial's surprise costs that trial, never the others nor results.parquet."""
    started = time.time()
    try:
        return run()
    except Exception as err:  # reported as the trial's reason
        log.exception("trial %s: unexpected error on the driver", trial.id)
        return outcome(trial, "failed", f"driver_error: {type(err).__name__}: {err}"[:500],
                       started, 1)


def run_workers(worker: Callable[[], None], count: int, live: LiveTrials) -> bool:
    """``count`` threads running ``worker`` in copies of the caller's context (so task runs
    nest in its flow run) until it returns; whether Ctrl-C (or SIGTERM, as Ray's driver
    handler has it) stopped them, every running trial killed."""
    interrupted = False
    pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="trial")
    context = contextvars.copy_context()
    futures = [pool.submit(context.copy().run, worker) for _ in range(count)]
    try:
        while not all(f.done() for f in futures):
            time.sleep(0.2)  # the main thread stays free to take Ctrl-C
        for f in futures:
            f.result()  # a bug in the scheduler itself surfaces here
    except (KeyboardInterrupt, SystemExit):
        interrupted = True
        while not all(f.done() for f in futures):  # kills what started meanwhile, too
            live.cancel_all()
            time.sleep(0.5)
    finally:
        pool.shutdown(wait=True)
    return interrupted


def trial_worker(source: TrialSource, shared: Attempts, rules: TrialRules, wrap: Wrap | None,
                 asked: Callable[[list[TrialPlan]], None],
                 finish: Callable[[TrialPlan, Summary], None]) -> Callable[[], None]:
    """A worker thread's loop: a trial at a time from ``source``, each in its own actor
    (or gang of ranks), wrapped (a Prefect task run), its summary handed to ``finish``."""
    ranks = rules.ranks_per_trial
    lone = OneActor(shared, rules.reuse_actors)
    strategy: Strategy = Gang(shared, ranks) if ranks > 1 else lone
    runner = Retrying(strategy, shared.live, rules.retries, rules.retry_delay_s)

    def worker() -> None:
        try:
            while not shared.live.stopping.is_set():
                trial = source.ask()
                if trial is None:
                    return
                asked([trial])
                finish(trial, contained(trial, lambda t=trial: (
                    wrap(t, lambda: runner.run(t)) if wrap else runner.run(t))))
        finally:
            lone.close()  # this thread's warm actor, kept for a next trial that never came

    return worker


def pack_worker(source: TrialSource, shared: Attempts, rules: TrialRules, wrap: Wrap | None,
                asked: Callable[[list[TrialPlan]], None],
                finish: Callable[[TrialPlan, Summary], None]) -> Callable[[], None]:
    """A worker thread's loop: a pack at a time (tasks/sweep/packs.py: the source's trials,
    all asked first, grouped) in one actor (``serve_pack``); a trial that packs with none
    trains as a lone trial does."""
    listed = list(iter(source.ask, None))  # every trial first (a spec packs a listed sweep)
    asked(listed)  # rows in the order trials were asked, whatever packs they join
    grouped = group_packs(listed, rules.pack, dict(rules.pack_limits))
    packs = ListSource(grouped)  # type: ignore[arg-type]
    runner = PackRetrying(PackActor(shared), shared.live, rules.retries, rules.retry_delay_s)
    lone = Retrying(OneActor(shared), shared.live, rules.retries, rules.retry_delay_s)

    def worker() -> None:
        while not shared.live.stopping.is_set():
            pack = packs.ask()
            if pack is None:
                return
            if len(pack) > 1:
                serve_pack(pack, runner, wrap, finish)
                continue
            trial = pack[0]
            finish(trial, contained(trial, lambda t=trial: (
                wrap(t, lambda: lone.run(t)) if wrap else lone.run(t))))

    return worker


def serve_pack(pack: list[TrialPlan], runner: PackRetrying, wrap: Wrap | None,
               finish: Callable[[TrialPlan, Summary], None]) -> None:
    """``pack`` run by ``runner`` while each of its trials is wrapped on a thread of its
    own (its own Prefect task run, lasting as long as the pack), each answered when the
    pack ends, or with the error that ended it; an error of the wrapping surfaces here."""
    answers: dict[str, Future] = {t.id: Future() for t in pack}
    errors: list[BaseException] = []

    def one(trial: TrialPlan) -> None:
        answer = answers[trial.id]
        try:
            finish(trial, contained(trial, lambda: (wrap(trial, answer.result) if wrap
                                                    else answer.result())))
        except BaseException as err:  # surfaced below, as a lone worker's are
            errors.append(err)

    threads = [threading.Thread(target=contextvars.copy_context().run, args=(one, t))
               for t in pack]
    try:
        for thread in threads:
            thread.start()
        rows = runner.run(pack)
        for t in pack:
            answers[t.id].set_result(rows[t.id])
    except Exception as err:  # each trial's row says so (contained)
        for answer in answers.values():
            if not answer.done():
                answer.set_exception(err)
    finally:
        for answer in answers.values():  # none left waiting, whatever happened
            if not answer.done():
                answer.set_exception(RuntimeError("the pack ended without an answer"))
        for thread in threads:
            if thread.ident is not None:  # started
                thread.join()
    if errors:
        raise errors[0]


def run_trials(source: TrialSource | list[TrialPlan] | list[tuple[str, dict[str, Any]]],
               placement: Placement, rules: TrialRules | None = None,
               results: Path | None = None, study: Any = None,
               on_event: EventHook | None = None, wrap: Wrap | None = None) -> list[Summary]:
    """Run the source's trials on the connected Ray cluster as ``rules`` say (tasks/sweep/
    trial_rules.py): ``max_concurrent`` at a time, each retried when its process is lost.

    Returns the summaries in the order trials were asked (written to ``results`` if
    given). Ctrl-C: running trials are killed and reported ``cancelled``, the rest of the
    source is not started, ``results`` is written, and TrialsInterrupted (a
    KeyboardInterrupt carrying the summaries so far) is raised. ``wrap(trial, run)``
    runs each trial's ``run()`` (the flow makes it a Prefect task run); worker threads
    run in a copy of the caller's context, so such task runs nest in the caller's flow run.
    A list may hold (id, TrainConfig fields) pairs: each becomes its plan (``TrialPlan.make``).
    ``rules.pack`` > 1: a listed sweep's trials in packs (tasks/sweep/packs.py), each
    trial still its own summary and wrapped run.
    """
    if isinstance(source, list):
        source = ListSource([t if isinstance(t, TrialPlan) else TrialPlan.make(*t)
                             for t in source])
    rules = rules or TrialRules()
    live = LiveTrials(on_event)
    shared = Attempts(placement, live, rules.time_limit_s, study, rules.metric,
                      box=metrics_box())
    summaries: dict[str, Summary] = {}
    order: list[str] = []
    order_lock = threading.Lock()

    def finish(trial: TrialPlan, summary: Summary) -> None:
        summary["duration_s"] = summary["ended"] - summary["started"]
        summaries[trial.id] = summary
        source.tell(trial, summary)
        live.event("finished", summary)

    def asked(trials: list[TrialPlan]) -> None:
        with order_lock:
            order.extend(t.id for t in trials)

    if rules.pack > 1:
        worker = pack_worker(source, shared, rules, wrap, asked, finish)
    else:
        worker = trial_worker(source, shared, rules, wrap, asked, finish)
    interrupted = run_workers(worker, rules.max_concurrent, live)
    rows = [summaries[t] for t in order if t in summaries]
    if results is not None:
        write_results(rows, results, sweep=True)
    if interrupted:
        raise TrialsInterrupted(rows)
    return rows
