"""One trial's plan, typed from the sweep spec to the trial's process.

    plan = spec.plan(params, out)          # tasks/sweep/sweep_spec.py: its one TrainConfig
    plan = plan.resolve({"segment_size": 4})   # tasks/sweep/memory_probe.py: auto -> int
    plan.params()                          # tasks/sweep/sweep_plan.py: key, param/ columns
    actor.run.remote(plan.to_dict())       # tasks/sweep/attempts.py, tasks/sweep/gang.py
    TrialPlan.from_dict(data).config       # tasks/sweep/trial.py: rebuilt once, in the actor

A value the sweep picks per trial is ``AUTO`` (``segment_size: auto`` in a spec), a type
and not a string: the spec's parser is the one place that reads the word.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.losses import LOSSES, READERS
from engine.losses.sampled import SAMPLED_FIELDS
from engine.settings.config import DEFAULT_LOSS, TrainConfig

AUTO_KEYS = ("segment_size",)  # TrainConfig fields a spec may leave to the memory probe


class Auto:
    """A value resolved per trial before it runs (the memory probe picks ``segment_size``).
    Written ``auto`` in specs, trial ids and messages; one instance, ``AUTO``."""

    _one: Auto | None = None

    def __new__(cls) -> Auto:
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def __repr__(self) -> str:
        return "auto"

    def __reduce__(self) -> tuple:
        return (Auto, ())  # unpickled, still the one instance


AUTO = Auto()


def parse_auto(name: str, value: Any) -> Any:
    """``AUTO`` for a spec's ``auto`` where field ``name`` may take it, else ``value``."""
    return AUTO if name in AUTO_KEYS and value == "auto" else value


@dataclass(frozen=True)
class TrialPlan:
    """One trial: its id, its whole TrainConfig (built and validated once, when the plan
    is made; the one truth of what it trains), the keys still ``auto`` and its Optuna
    number.

    Everything a trial's settings decide is read from ``config``: its cache key and probe
    key, its results' ``param/`` columns (every effective value, defaults the spec left
    out included), what evaluation runs at. A key left auto holds its default in
    ``config`` (what the memory probe measures from) until ``resolve`` puts the probe's
    pick there.
    """

    id: str
    config: TrainConfig
    auto: frozenset[str] = frozenset()
    number: int | None = None
    probed: str | None = None  # the memory probe's peaks (GB by size, JSON) a pick came from

    @classmethod
    def make(cls, trial_id: str, fields: dict[str, Any], number: int | None = None
             ) -> TrialPlan:
        """The plan of ``fields`` (TrainConfig field names; ``AUTO`` where the probe picks);
        ValueError naming the first bad field, cross-field rules included."""
        auto = frozenset(k for k, v in fields.items() if v is AUTO)
        config = TrainConfig.from_dict(
            {k: v for k, v in own_loss_fields(fields).items() if k not in auto})
        config.validate()
        return cls(trial_id, config, auto, number)

    def resolve(self, picks: dict[str, int], probed: str | None = None) -> TrialPlan:
        """The plan with ``picks`` for keys that were auto (no other key may change): its
        config rebuilt with them, the one other build a plan has on the driver; ``probed``:
        the probe's peaks they were picked from (the results' segment_size_probe_gb)."""
        wrong = sorted(set(picks) - self.auto)
        if wrong:
            raise ValueError(f"trial {self.id}: {', '.join(wrong)} was not auto")
        return dataclasses.replace(self, config=self.config.replace(**picks),
                                   auto=self.auto - set(picks), probed=probed)

    def params(self) -> dict[str, Any]:
        """Every effective setting by name (its results' ``param/`` columns, its cache key's
        body: ``settings_of``)."""
        return settings_of(self.config)

    def changed(self) -> dict[str, Any]:
        """The settings that differ from TrainConfig's defaults (a trial's log line)."""
        return {k: v for k, v in self.params().items()
                if k not in DEFAULTS or DEFAULTS[k] != v}

    def to_dict(self) -> dict[str, Any]:
        """Plain values for Ray (``from_dict`` rebuilds the plan); refused while a key is
        still auto."""
        if self.auto:
            raise ValueError(f"trial {self.id}: {', '.join(sorted(self.auto))} still auto; "
                             "resolve it first (tasks/sweep/memory_probe.py)")
        return {"id": self.id, "number": self.number, "config": self.config.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialPlan:
        """The plan ``to_dict`` sent, in the trial's process: its one TrainConfig there."""
        config = TrainConfig.from_dict(data["config"])
        config.validate()
        return cls(data["id"], config, frozenset(), data["number"])


# A config's paths: never a setting's column or key (the model, data, warm start and
# reference file are keyed by their bytes: tasks/sweep/sweep_plan.py cache_key).
PATHS = ("model", "data", "out", "warm_start", "reference_logps")
DEFAULTS = TrainConfig.defaults()


def settings_of(config: TrainConfig) -> dict[str, Any]:
    """``config``'s plain values less its paths, which are keyed by content."""
    return {k: v for k, v in config.to_dict().items() if k not in PATHS}


def own_loss_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` less the settings of losses other than the trial's own: a spec over
    several losses gives each trial its own loss's (tasks/sweep/spec_rules.py refuses a setting
    that no loss of the spec owns); and a pair loss's trial on fixed pairs, beside trials on
    online ones (``grid: {pairs: [fixed, online]}``), less the sampling settings it would
    not read."""
    kind = fields.get("loss", DEFAULT_LOSS.kind)
    fixed = kind in LOSSES and not LOSSES[kind].on_groups and fields.get("pairs") != "online"
    return {k: v for k, v in fields.items()
            if (k not in READERS or kind in [r.kind for r in READERS[k]])
            and not (fixed and k in SAMPLED_FIELDS)}


def param_columns(params: dict[str, Any]) -> dict[str, Any]:
    """The results table's ``param/`` columns of a point refused before it was planned (a
    key left auto has no size: left out)."""
    return {f"param/{k}": v for k, v in params.items() if v is not AUTO}
