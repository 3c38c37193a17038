"""How a sweep runs its trials: how many at once, each within what time, retried how often
when its process is lost, as one actor or a gang of ranks. The spec sets them
(``SweepSpec.rules``); the scheduler (tasks/sweep/scheduler.py) takes them whole."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrialRules:
    """``max_concurrent`` trials at a time; each stopped after ``time_limit_s`` (0: never);
    a lost process retried ``retries`` times, ``retry_delay_s`` apart; ``ranks_per_trial``
    > 1: each trial a gang of that many ranks (tasks/sweep/gang.py); ``metric``: what each
    trial reports to an Optuna study; ``pack`` > 1: trials that share their steps trained
    up to that many at a time in one process (tasks/sweep/packs.py); ``pack_limits``: a
    trial's own largest pack, by trial id, where ``pack: auto`` measured it
    (tasks/sweep/pack_sizes.py); ``reuse_actors``: a slot's actor trains trial after
    trial while each completes (tasks/sweep/attempts.py, ``OneActor``)."""

    max_concurrent: int = 1
    time_limit_s: float = 0.0
    retries: int = 2
    retry_delay_s: float = 5.0
    ranks_per_trial: int = 1
    metric: str = "val/loss"
    pack: int = 1
    pack_limits: tuple[tuple[str, int], ...] = ()
    reuse_actors: bool = False
