"""``search: optuna``: TPE through ask/tell, with pruning fed by each trial's validations.

The study lives in a small Ray actor so that the driver (ask, tell) and every running
trial (report a validation value, learn whether to stop) talk to the same one, wherever
the trial runs. Trials are identified like any other (a hash of their parameters), so a
re-run finds the ones it already completed in the cache and tells the study their value
without training them again.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from tasks.sweep.spec_values import Dist
from tasks.sweep.sweep_spec import PlanError, SweepSpec, trial_id
from tasks.sweep.trial import Summary
from tasks.sweep.trial_plan import AUTO, TrialPlan, param_columns, parse_auto


def distribution(dist: Dist):
    """The Optuna distribution of one search-space dimension."""
    import optuna.distributions as od

    if dist.kind == "choice":  # the spec's values as they are; AUTO as its word
        return od.CategoricalDistribution(["auto" if a is AUTO else a for a in dist.args])
    lo, hi = dist.args
    if dist.kind == "int":
        return od.IntDistribution(int(lo), int(hi))
    return od.FloatDistribution(float(lo), float(hi), log=dist.kind == "loguniform")


class Study:
    """An in-memory Optuna study (one per sweep run); wrapped as a Ray actor."""

    def __init__(self, space: dict[str, Dist], mode: str, seed: int, pruning: dict[str, int]):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        pruner = (optuna.pruners.MedianPruner(n_startup_trials=pruning["startup_trials"],
                                              n_warmup_steps=pruning["warmup_steps"])
                  if pruning else optuna.pruners.NopPruner())
        self.study = optuna.create_study(
            direction="minimize" if mode == "min" else "maximize",
            sampler=optuna.samplers.TPESampler(seed=seed), pruner=pruner)
        self.space = {k: distribution(d) for k, d in sorted(space.items())}
        self.trials: dict[int, Any] = {}

    def ask(self) -> tuple[int, dict[str, Any]]:
        trial = self.study.ask(self.space)
        self.trials[trial.number] = trial
        return trial.number, dict(trial.params)

    def report(self, number: int, step: int, value: float) -> bool:
        """Record one validation value; True when the pruner says stop."""
        trial = self.trials[number]
        trial.report(value, step)
        return bool(trial.should_prune())

    def tell(self, number: int, value: float | None, state: str) -> None:
        import optuna

        states = {"complete": optuna.trial.TrialState.COMPLETE,
                  "pruned": optuna.trial.TrialState.PRUNED,
                  "fail": optuna.trial.TrialState.FAIL}
        self.study.tell(number, value if state == "complete" else None, states[state])

    def summary(self) -> dict[str, Any]:
        done = [t for t in self.study.trials if t.state.name == "COMPLETE"]
        return {"trials": len(self.study.trials), "completed": len(done),
                "pruned": sum(t.state.name == "PRUNED" for t in self.study.trials),
                "best_params": self.study.best_params if done else None}


class OptunaSource:
    """Asks the study for ``spec.num_samples`` trials; tells it each result.

    ``build(params, number)`` makes the trial's plan (PlanError when its whole config is
    invalid: a failed trial, never trained); ``cached(plan)`` returns a completed summary
    from an earlier run, or None.
    """

    def __init__(self, spec: SweepSpec, study: Any,
                 build: Callable[[dict[str, Any], int], TrialPlan],
                 cached: Callable[[TrialPlan], Summary | None],
                 metric_of: Callable[[Summary], Any]):
        self.spec, self.study, self.build = spec, study, build
        self.cached, self.metric_of = cached, metric_of
        self.asked = 0
        self.reused: list[Summary] = []
        self.finished: dict[str, Summary] = {}  # this run's results, by trial id
        self.running: set[str] = set()
        self.lock = threading.Lock()

    def ask(self) -> TrialPlan | None:
        import ray

        with self.lock:
            while self.asked < self.spec.num_samples:
                self.asked += 1
                number, sampled = ray.get(self.study.ask.remote())
                params = {**self.spec.fixed, **{k: parse_auto(k, v) for k, v in sampled.items()}}
                tid = trial_id(params)
                if tid in self.running:  # the sampler repeated a running point: skip it
                    self._tell(number, {"status": "failed"})
                    continue
                plan = None
                if tid not in self.finished:  # a point seen before is answered below
                    try:
                        plan = self.build(params, number)
                    except PlanError as err:  # a sampled combination no TrainConfig takes
                        now = time.time()
                        self.finished[tid] = {"trial_id": tid, "status": "failed", "reason":
                                              str(err), "started": now, "ended": now,
                                              **param_columns(params)}
                        self.reused.append(self.finished[tid])  # reported once
                old = self.finished.get(tid) or self.cached(plan)
                if old is None:
                    self.running.add(tid)
                    return plan
                if tid not in self.finished:
                    self.reused.append(old)  # done in an earlier run: reported once
                    self.finished[tid] = old
                self._tell(number, old)  # the same point again: its value, no training
            return None

    def tell(self, trial: TrialPlan, summary: Summary) -> None:
        with self.lock:
            self.running.discard(trial.id)
            self.finished[trial.id] = summary
        self._tell(trial.number, summary)

    def _tell(self, number: int | None, summary: Summary) -> None:
        import ray

        value = self.metric_of(summary)
        if summary.get("status") == "completed" and value is not None and math.isfinite(value):
            state = "complete"
        else:
            state = "pruned" if summary.get("status") == "pruned" else "fail"
            value = None
        ray.get(self.study.tell.remote(number, value, state))
