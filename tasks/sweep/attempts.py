"""One attempt at a trial, and the live actors the scheduler shares with it.

The scheduler (tasks/sweep/scheduler.py) retries a trial whose process died; each try is an
attempt, run by a ``Strategy``: ``OneActor`` here (one fresh Ray actor), or ``Gang``
(tasks/sweep/gang.py: one actor per rank). A strategy answers the trial's summary, or None when
its process was lost and the trial may be retried. Every actor it starts is registered in
``LiveTrials`` first, so that Ctrl-C (``cancel_all``) can kill it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from engine.host.command_queue import queue_env
from tasks.eval.rewards import reward_sources
from tasks.nodes.node_files import Bundle, pull
from tasks.nodes.placement import Placement
from tasks.nodes.trial_inputs import InputServer
from tasks.sweep.trial import Summary, TrialActor, checked, outcome, phase_columns
from tasks.sweep.trial_plan import TrialPlan
from tasks.sweep.warm_actor import WarmSlot, env_key

EventHook = Callable[[str, Summary], None]  # ("started" | "retry" | "finished", summary)


@dataclass
class LiveTrials:
    """The actors running now, by trial id, and whether the sweep is stopping."""

    on_event: EventHook | None = None
    stopping: threading.Event = field(default_factory=threading.Event)
    actors: dict[str, Any] = field(default_factory=dict)  # trial id -> actor, or a gang's list
    lock: threading.Lock = field(default_factory=threading.Lock)

    def event(self, kind: str, summary: Summary) -> None:
        if self.on_event:
            self.on_event(kind, summary)

    def register(self, trial_id: str, actors: Any) -> bool:
        """Hold ``actors`` as the trial's live ones, unless the sweep is stopping (False).
        Checked under the lock ``cancel_all`` takes: an actor made while Ctrl-C was being
        handled would otherwise never be killed, and run its trial to the end."""
        with self.lock:
            if self.stopping.is_set():
                return False
            self.actors[trial_id] = actors
            return True

    def release(self, trial_id: str) -> None:
        with self.lock:
            self.actors.pop(trial_id, None)

    def cancel_all(self) -> None:
        import ray

        with self.lock:
            self.stopping.set()
            held = list(self.actors.values())
        for actors in held:  # one actor per trial, or a gang's list
            for actor in actors if isinstance(actors, list) else [actors]:
                ray.kill(actor)

    def lost(self, trial: TrialPlan, attempt: int, first: float, reason: str) -> Summary | None:
        """A process of the trial died: cancelled if the sweep is stopping (Ctrl-C killed
        it), else None (retry) after saying so."""
        if self.stopping.is_set():
            return outcome(trial, "cancelled", "sweep interrupted", first, attempt + 1)
        self.event("lost", {"trial_id": trial.id, "attempt": attempt, "reason": reason[:200]})
        return None


@dataclass(frozen=True)
class Attempts:
    """What every attempt of a sweep shares: where it runs, the live actors, its time
    limit, and the study (Optuna's actor) and metric it reports to."""

    placement: Placement
    live: LiveTrials
    time_limit_s: float = 0.0
    study: Any = None
    metric: str = "val/loss"
    files: InputServer = field(default_factory=InputServer)  # inputs by content
    box: Any = None  # the MetricsBox trials send their metric lines to


def relay(box: Any, trial_id: str, out: Path, first: bool) -> None:
    """The trial's metric lines so far into the driver's ``out/metrics.jsonl`` (an attempt
    starts the file afresh), where its Prefect task run follows them."""
    import ray

    lines = ray.get(box.take.remote(trial_id)) if box is not None else []
    if first or lines:
        out.mkdir(parents=True, exist_ok=True)
        with (out / "metrics.jsonl").open("w" if first else "a") as f:
            f.writelines(line + "\n" for line in lines)


def collect(trial: TrialPlan, actor: Any, summary: Summary) -> Summary:
    """The attempt's outputs pulled from its node into the trial's folder on the driver
    (tasks/nodes/node_files.py); its scratch folder removed there. From a pack's actor
    (``pack`` in the summary): this trial's, by its id."""
    import ray

    listed = summary.pop("outputs", None)
    if listed is None:
        return summary
    out = Path(trial.config.out)
    key = (trial.id,) if "pack" in summary else ()  # a lone trial's actor takes no id
    pull(Bundle.from_dict(listed), lambda rel, offset, n: ray.get(
        actor.read.remote(rel, offset, n, *key)), out)
    ray.get(actor.cleanup.remote(*key))
    return {**summary, "adapter": str(out)}


def wait_relaying(shared: Attempts, trial: TrialPlan | list[TrialPlan], ref: Any,
                  limit_s: float | None = None) -> bool:
    """Wait for ``ref`` within the time limit (``limit_s``, else the sweep's), relaying
    the metric lines of each trial it runs every 2 s; whether it finished."""
    import ray

    trials = trial if isinstance(trial, list) else [trial]
    limit = shared.time_limit_s if limit_s is None else limit_s
    deadline = time.time() + (limit or 1e12)
    for t in trials:
        relay(shared.box, t.id, Path(t.config.out), first=True)
    while True:
        ready, _ = ray.wait([ref], timeout=max(min(2.0, deadline - time.time()), 0.0))
        for t in trials:
            relay(shared.box, t.id, Path(t.config.out), first=False)
        if ready or time.time() >= deadline:
            return bool(ready)


class Strategy(Protocol):
    """How one attempt runs: the trial's summary, or None when its process was lost."""

    def attempt(self, trial: TrialPlan, attempt: int, first: float) -> Summary | None: ...


class OneActor:
    """Each attempt in one fresh actor on the placement, killed when it ends; with
    ``reuse`` (``reuse_actors``), a completed trial's actor kept for this worker's next
    trial (tasks/sweep/warm_actor.py). ``close``: the kept one killed."""

    def __init__(self, shared: Attempts, reuse: bool = False):
        import ray

        self.shared, self.reuse, self.threads = shared, reuse, threading.local()
        self.actor_cls = ray.remote(max_restarts=0, max_task_retries=0)(TrialActor)

    @property
    def slot(self) -> WarmSlot | None:
        """This thread's kept actor: the sweep's worker threads share this strategy, and
        each keeps its own (never one actor for two trials at once)."""
        if not self.reuse:
            return None
        if not hasattr(self.threads, "slot"):
            self.threads.slot = WarmSlot()
        return self.threads.slot

    def close(self) -> None:
        """This thread's kept actor killed (its worker's trials are done)."""
        if self.slot is not None:
            self.slot.close()

    def actor_for(self, env: dict[str, str]) -> tuple[Any, bool]:
        """The slot's kept actor for ``env``, else a fresh one; whether it was kept."""
        slot = self.slot
        kept = slot.take(env_key(env)) if slot is not None else None
        if kept is not None:
            return kept, True
        return self.actor_cls.options(**self.shared.placement.options(env)).remote(), False

    def attempt(self, trial: TrialPlan, attempt: int, first: float) -> Summary | None:
        import ray

        shared, live = self.shared, self.shared.live
        asked, env, kept = time.time(), queue_env(trial.config.memory_limit_gb), False
        actor, reused = self.actor_for(env)
        try:
            if not live.register(trial.id, actor):
                return outcome(trial, "cancelled", "sweep interrupted", first, attempt + 1)
            inputs = shared.files.for_config(trial.config,
                                             reward_sources(trial.config.loss))
            placed = actor.where.remote()
            ref = actor.run.remote(trial.to_dict(), shared.study, shared.metric, inputs,
                                   shared.box)
            # Once the actor is up (the time limit counts from here): where it runs.
            live.event("running", {"trial_id": trial.id, "attempt": attempt,
                                   **ray.get(placed)})
            up = time.time()  # a fresh process's start (the driver listing inputs beside it)
            if not wait_relaying(shared, trial, ref):
                return outcome(trial, "failed", f"time_limit: over {shared.time_limit_s:g} s",
                               first, attempt + 1)
            summary = checked(trial, ray.get(ref), first, attempt + 1)
            pulling = time.time()
            summary = collect(trial, actor, summary)
            slot = self.slot
            kept = (slot is not None and summary["status"] == "completed"
                    and not live.stopping.is_set()
                    and slot.keep(env_key(env), actor, trial.config.memory_limit_gb))
            return {**summary, "reused_actor": reused,
                    **phase_columns({"actor_start": up - asked,
                                     "pull": time.time() - pulling})}
        except OSError as err:  # an input the driver cannot list, or a result it cannot write
            return outcome(trial, "failed", f"{type(err).__name__}: {err}"[:500], first,
                           attempt + 1)
        except ray.exceptions.RayActorError as err:
            return live.lost(trial, attempt, first, str(err).splitlines()[0])
        except ray.exceptions.RayError as err:  # e.g. an argument that would not unpickle
            return outcome(trial, "failed", f"{type(err).__name__}: {err}"[:500], first,
                           attempt + 1)
        finally:
            live.release(trial.id)
            if not kept:  # the process and its memory go; the next trial starts fresh
                ray.kill(actor)
