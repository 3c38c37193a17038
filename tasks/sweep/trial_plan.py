"""One trial's plan, typed from the sweep spec to the trial's process.

    plan = spec.plan(params, out)          # tasks/sweep/sweep_spec.py: its one TrainConfig
    plan = plan.resolve({"segment_size": 4})   # tasks/sweep/memory_probe.py: auto -> int
    actor.run.remote(plan.to_dict())       # tasks/sweep/attempts.py, tasks/sweep/gang.py
    TrialPlan.from_dict(data).config       # tasks/sweep/trial.py: rebuilt once, in the actor

A value the sweep picks per trial is ``AUTO`` (``segment_size: auto`` in a spec), a type
and not a string: the spec's parser is the one place that reads the word.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.losses import OWNERS
from engine.settings.config import DEFAULT_LOSS, TrainConfig, coerce

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
    """One trial: its id, the fields the spec and the sweep set, the whole TrainConfig
    (validated once, when the plan is made), the keys still ``auto`` and its Optuna number.

    ``fields`` is what identifies the trial (its cache key, its results' ``param/``
    columns), values as the spec wrote them. In ``config`` a key the spec left auto holds
    its default (what the memory probe measures from); ``resolve`` puts the probe's pick in
    ``fields`` and ``to_dict`` sends it, so the trial's process trains with it.
    """

    id: str
    fields: dict[str, Any]
    config: TrainConfig
    auto: frozenset[str] = frozenset()
    number: int | None = None

    @classmethod
    def make(cls, trial_id: str, fields: dict[str, Any], number: int | None = None
             ) -> TrialPlan:
        """The plan of ``fields`` (TrainConfig field names; ``AUTO`` where the probe picks);
        ValueError naming the first bad field, cross-field rules included."""
        auto = frozenset(k for k, v in fields.items() if v is AUTO)
        config = TrainConfig.from_dict(
            {k: v for k, v in own_loss_fields(fields).items() if k not in auto})
        config.validate()
        return cls(trial_id, dict(fields), config, auto, number)

    def resolve(self, picks: dict[str, int]) -> TrialPlan:
        """The plan with ``picks`` for keys that were auto (no other key may change)."""
        wrong = sorted(set(picks) - self.auto)
        if wrong:
            raise ValueError(f"trial {self.id}: {', '.join(wrong)} was not auto")
        return dataclasses.replace(self, fields={**self.fields, **picks},
                                   auto=self.auto - set(picks))

    def to_dict(self) -> dict[str, Any]:
        """Plain values for Ray (``from_dict`` rebuilds the plan); refused while a key is
        still auto."""
        if self.auto:
            raise ValueError(f"trial {self.id}: {', '.join(sorted(self.auto))} still auto; "
                             "resolve it first (tasks/sweep/memory_probe.py)")
        picked = {k: coerce(k, self.fields[k]) for k in AUTO_KEYS if k in self.fields}
        return {"id": self.id, "fields": dict(self.fields), "number": self.number,
                "config": {**self.config.to_dict(), **picked}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialPlan:
        """The plan ``to_dict`` sent, in the trial's process: its one TrainConfig there."""
        config = TrainConfig.from_dict(data["config"])
        config.validate()
        return cls(data["id"], dict(data["fields"]), config, frozenset(), data["number"])


def own_loss_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` less the settings of losses other than the trial's own: a spec over
    several losses gives each trial its own loss's (tasks/sweep/spec_rules.py refuses a setting
    that no loss of the spec owns)."""
    kind = fields.get("loss", DEFAULT_LOSS.kind)
    return {k: v for k, v in fields.items() if k not in OWNERS or OWNERS[k].kind == kind}


def param_columns(params: dict[str, Any]) -> dict[str, Any]:
    """The results table's ``param/`` columns of a point refused before it was planned (a
    key left auto has no size: left out)."""
    return {f"param/{k}": v for k, v in params.items() if v is not AUTO}
