"""A sweep's trials in packs (``TrialRules.pack`` > 1): trials that share their steps
(engine/train/pack_steps.py ``check_pack``) trained up to ``pack`` at a time in one fresh
actor (tasks/sweep/trial.py ``TrialActor.run_pack``), each trial keeping its own summary,
outputs, metrics and (through ``wrap``) its own Prefect task run.

A pack's process that dies is retried as a pack of the trials it had not answered for;
one that runs past ``time_limit_s`` × its size fails each of its trials. Grouping keeps the
trials' order: a trial joins the first open pack it fits, else starts one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.host.command_queue import queue_env
from tasks.sweep.attempts import Attempts, LiveTrials, collect, wait_relaying
from tasks.sweep.trial import Summary, TrialActor, checked, outcome, pack_name
from tasks.sweep.trial_plan import TrialPlan


def fits(pack: list[TrialPlan]) -> bool:
    """Whether ``pack``'s trials train as one pack (engine/train/pack_trainer.py's rules)."""
    from engine.train.pack_trainer import refuse_unpacked

    try:
        refuse_unpacked([t.config for t in pack])
    except ValueError:
        return False
    return True


def group_packs(trials: list[TrialPlan], size: int,
                limits: Mapping[str, int] | None = None) -> list[list[TrialPlan]]:
    """``trials`` in packs of up to ``size``, in order: each joins the first open pack it
    fits, else starts one (a trial that fits none trains as a pack of one). ``limits``
    (``pack: auto``, by trial id: its class's size, tasks/sweep/pack_sizes.py): the
    classes grouped so without a size, each cut in order at its own limit, so that no pack
    holds trials of two classes (which one probe never measured together)."""
    packs: list[list[TrialPlan]] = []
    if limits:
        for cls in group_packs(trials, len(trials)):
            cut = min(size, limits.get(cls[0].id, size))
            packs += [cls[i:i + cut] for i in range(0, len(cls), cut)]
        return packs
    for trial in trials:
        home = next((p for p in packs if len(p) < size and fits([*p, trial])), None)
        if home is None:
            packs.append([trial])
        else:
            home.append(trial)
    return packs


class PackActor:
    """Each attempt at a pack in one fresh actor on the placement, killed when it ends:
    each trial's summary, or None for each one whose process was lost."""

    def __init__(self, shared: Attempts):
        import ray

        self.shared = shared
        self.actor_cls = ray.remote(max_restarts=0, max_task_retries=0)(TrialActor)

    def attempt(self, trials: list[TrialPlan], attempt: int, first: float
                ) -> dict[str, Summary | None]:
        """Each trial's summary (a trial whose inputs the driver cannot list fails alone;
        the others pack without it), or None for each one whose process was lost."""
        inputs, failed = {}, {}
        for t in trials:
            try:
                inputs[t.id] = self.shared.files.for_config(t.config)
            except OSError as err:
                failed[t.id] = outcome(t, "failed", f"{type(err).__name__}: {err}"[:500],
                                       first, attempt + 1)
        packed = [t for t in trials if t.id in inputs]
        return {**failed, **(self.run(packed, inputs, attempt, first) if packed else {})}

    def run(self, trials: list[TrialPlan], inputs: dict[str, Any], attempt: int,
            first: float) -> dict[str, Summary | None]:
        import ray

        shared, live, name = self.shared, self.shared.live, pack_name([t.id for t in trials])
        actor = self.actor_cls.options(**shared.placement.options(
            queue_env(trials[0].config.memory_limit_gb))).remote()  # shared by the pack
        every = lambda status, reason: {t.id: outcome(t, status, reason, first, attempt + 1)  # noqa: E731
                                        for t in trials}
        try:
            if not live.register(name, actor):
                return every("cancelled", "sweep interrupted")
            placed = actor.where.remote()
            ref = actor.run_pack.remote([t.to_dict() for t in trials],
                                        [inputs[t.id] for t in trials], shared.box)
            here = ray.get(placed)
            for t in trials:
                live.event("running", {"trial_id": t.id, "attempt": attempt, **here})
            limit = shared.time_limit_s * len(trials)  # k trials' arithmetic in one process
            if not wait_relaying(shared, trials, ref, limit):
                return every("failed", f"time_limit: pack of {len(trials)} over {limit:g} s")
            rows = ray.get(ref)
            return {t.id: pulled(t, actor, checked(t, row, first, attempt + 1), first, attempt)
                    for t, row in zip(trials, rows, strict=True)}
        except OSError as err:  # a metrics file the driver cannot write
            return every("failed", f"{type(err).__name__}: {err}"[:500])
        except ray.exceptions.RayActorError as err:
            return {t.id: live.lost(t, attempt, first, str(err).splitlines()[0])
                    for t in trials}
        except ray.exceptions.RayError as err:
            return every("failed", f"{type(err).__name__}: {err}"[:500])
        finally:
            live.release(name)
            ray.kill(actor)


def pulled(trial: TrialPlan, actor: Any, summary: Summary, first: float,
           attempt: int) -> Summary:
    """``summary`` with the trial's outputs pulled (a file that cannot be written fails
    this trial alone)."""
    try:
        return collect(trial, actor, summary)
    except OSError as err:
        return outcome(trial, "failed", f"{type(err).__name__}: {err}"[:500], first,
                       attempt + 1)


@dataclass
class PackRetrying:
    """Runs one pack through ``strategy``, retrying the trials whose process was lost as a
    pack of their own."""

    strategy: PackActor
    live: LiveTrials
    retries: int
    retry_delay_s: float

    def run(self, pack: list[TrialPlan]) -> dict[str, Summary]:
        """Each trial's summary after at most ``retries`` retries of a lost process."""
        first, done, todo = time.time(), {}, list(pack)
        for attempt in range(self.retries + 1):
            if self.live.stopping.is_set():
                return {**done, **{t.id: outcome(t, "cancelled", "sweep interrupted", first,
                                                 attempt) for t in todo}}
            for t in todo:
                self.live.event("started", {"trial_id": t.id, "attempt": attempt})
            answered = self.strategy.attempt(todo, attempt, first)
            for t in todo:
                if (summary := answered.get(t.id)) is not None:
                    done[t.id] = {**summary, "attempts": attempt + 1,
                                  **({"started": first, "attempt_started": summary.get(
                                      "started")} if attempt else {})}
            todo = [t for t in todo if t.id not in done]
            if not todo:
                return done
            if attempt < self.retries:
                for t in todo:
                    self.live.event("retry", {"trial_id": t.id, "attempt": attempt})
                self.live.stopping.wait(self.retry_delay_s)
        return {**done, **{t.id: outcome(t, "failed", f"lost: its pack's process died "
                                         f"{self.retries + 1} times (node gone or killed)",
                                         first, self.retries + 1) for t in todo}}
