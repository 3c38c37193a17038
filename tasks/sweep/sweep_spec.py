"""A validated sweep spec (``SweepSpec``): its points, its draws, each trial's plan; read from
YAML by tasks/sweep/spec_file.py, which documents the format.

    spec = load_spec("sweep.yaml")          # tasks/sweep/spec_file.py
    spec.points()                           # grid × draws, each trial once
    spec.plan(params, out)                  # one TrialPlan: its TrainConfig built once
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.model.export import ExportSettings
from tasks.board.board_settings import Ranking
from tasks.board.ranked_metric import rank_mode
from tasks.eval.generation_eval import GenerationSettings
from tasks.sweep.spec_rules import SpecError
from tasks.sweep.spec_values import Dist
from tasks.sweep.trial_plan import AUTO, Auto, TrialPlan, own_loss_fields
from tasks.sweep.trial_rules import TrialRules
from tasks.track.report_to import ReportTo

LISTABLE = 100_000  # grid points × draws: ``size`` lists (µs each) up to this many to count


class PlanError(SpecError):
    """A trial whose whole TrainConfig is invalid (a rule across fields), naming it;
    ``cause`` is the rule alone, without the trial."""

    def __init__(self, message: str, cause: str = "") -> None:
        super().__init__(message)
        self.cause = cause or message


@dataclass(frozen=True)
class SweepSpec:
    """A validated sweep."""

    name: str
    model: str
    data: str
    fixed: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list] = field(default_factory=dict)
    space: dict[str, Dist] = field(default_factory=dict)
    search: str = "grid"
    num_samples: int = 1
    metric: str = "val/loss"
    mode: str = "min"
    max_concurrent: int = 1
    time_limit_s: float = 0.0
    seed: int = 0
    pruning: dict[str, int] = field(default_factory=dict)  # empty: no pruning
    memory_budget_gb: float = 0.0
    retries: int = 2
    retry_delay_s: float = 5.0
    kind: str = "train"  # train | memory
    probe_batches: int = 8
    ranks_per_trial: int = 1  # > 1: a trial is a gang of ranks (tasks/sweep/gang.py)
    pack: int | Auto = 1  # > 1 (or AUTO, sized by a probe): trials trained together
    reuse_actors: bool = False  # a slot's process trains trial after trial (attempts.py)
    evaluation: GenerationSettings = field(default_factory=GenerationSettings)
    rank_by: str = ""  # the leaderboard's metric ("": metric)
    export: ExportSettings = field(default_factory=ExportSettings)  # the pipeline's GGUF
    report_to: ReportTo = field(default_factory=ReportTo)  # trackers (tasks/track/)

    @property
    def rules(self) -> TrialRules:
        """How its trials run: at once, time limit, retries, ranks, the metric reported."""
        pack = 1 if self.pack is AUTO else self.pack  # auto: sized once probed (SweepPlan)
        return TrialRules(self.max_concurrent, self.time_limit_s, self.retries,
                          self.retry_delay_s, self.ranks_per_trial, self.metric, pack,
                          reuse_actors=self.reuse_actors)

    @property
    def ranking(self) -> Ranking:
        """Its leaderboard: titled by the sweep, ranked on ``rank_by`` (a generation score
        is better higher; a validation metric goes the spec's ``mode``), ties broken by the
        metric it trained on."""
        rank_by = self.rank_by or self.metric
        return Ranking(self.name, rank_by, rank_mode(rank_by, self.mode), self.metric,
                       self.mode)

    def points(self) -> list[dict[str, Any]]:
        """Grid points × ``num_samples`` draws from ``space`` (random search), in order: each
        trial's params, each trial once, as its first point lists it. Points that differ only
        in another loss's settings are one trial (CPO's of a grid over kto_beta: each trial
        takes its own loss's, ``own_loss_fields``); so are two draws of one choice. Optuna
        search asks its sampler trial by trial; this lists its grid."""
        once: dict[str, dict[str, Any]] = {}
        for params in self.listing():
            once.setdefault(trial_id(own_loss_fields(params)), params)
        return list(once.values())

    def listing(self) -> Iterator[dict[str, Any]]:
        """``points`` one at a time, repeats included: a typo'd grid of a billion points is
        looked into without being held."""
        keys = sorted(self.grid)
        rng = np.random.default_rng(self.seed)
        draws = self.num_samples if self.space and self.search == "random" else 1
        for combo in itertools.product(*(self.grid[k] for k in keys)):
            for _ in range(draws):
                yield {**self.fixed, **dict(zip(keys, combo, strict=True)), **self.draw(rng)}

    def draw(self, rng: np.random.Generator) -> dict[str, Any]:
        """One value of each ``space`` dimension."""
        return {k: d.sample(rng) for k, d in sorted(self.space.items())}

    def size(self) -> int:
        """How many trials the spec plans (optuna: its ``num_samples``): as many as ``points``
        lists; past LISTABLE grid points × draws, that product (warned of as huge anyway)."""
        if self.search == "optuna":
            return self.num_samples
        draws = self.num_samples if self.space and self.search == "random" else 1
        bound = math.prod(len(v) for v in self.grid.values()) * draws
        return len(self.points()) if bound <= LISTABLE else bound

    def trials(self, out: Path | None = None) -> list[TrialPlan]:
        """Every listed trial (``points``) planned into ``out`` (default: runs/<name>)."""
        out = Path("runs") / self.name if out is None else out
        return [self.plan(params, out) for params in self.points()]

    def plan(self, params: dict[str, Any], out: Path, number: int | None = None) -> TrialPlan:
        """The trial of ``params`` (its id their hash), completed by the sweep: its model,
        data and directory ``out/<id>``, its best evaluation picked by the metric the sweep
        ranks on, the memory budget as its limit. Its TrainConfig is built and validated
        whole here, once (PlanError naming the trial and the field)."""
        tid = trial_id(params)
        fields = {**params, "best_metric": self.metric, "best_mode": self.mode,
                  "model": self.model, "data": self.data, "out": str(out / tid)}
        if self.memory_budget_gb > 0 and "memory_limit_gb" not in params:
            fields["memory_limit_gb"] = self.memory_budget_gb
        try:
            return TrialPlan.make(tid, fields, number)
        except (ValueError, TypeError) as err:
            raise PlanError(f"trial {tid} {json.dumps(params, default=str)}: {err}",
                            str(err)) from None


def trial_id(params: dict[str, Any]) -> str:
    """Stable short id of a parameter set (the same params are the same trial)."""
    body = json.dumps(params, sort_keys=True, default=str)
    return "t-" + hashlib.sha256(body.encode()).hexdigest()[:10]
