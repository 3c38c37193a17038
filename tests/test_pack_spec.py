"""A sweep spec's ``pack: N`` (tasks/sweep/sweep_spec.py): carried to the scheduler's rules,
refused in one line where packs cannot run (tasks/sweep/spec_rules.py ``check_pack``)."""

from __future__ import annotations

import pytest

from tasks.sweep.sweep_spec import SpecError, parse_spec

pytestmark = pytest.mark.unit

BASE = {"name": "s", "model": "m", "data": "d", "grid": {"learning_rate": [1e-4, 2e-4]}}


def test_pack_reaches_the_rules_and_defaults_to_one() -> None:
    assert parse_spec({**BASE, "pack": 3}).rules.pack == 3
    assert parse_spec(BASE).rules.pack == 1


@pytest.mark.parametrize("more, said", [
    ({"pack": 0}, "pack"),
    ({"search": "optuna", "grid": {}, "space": {"learning_rate": {"choice": [1e-4, 2e-4]}}},
     "search: optuna asks trials one at a time"),
    ({"ranks_per_trial": 2, "fixed": {"batch_size": 4}}, "a pack trains in one process"),
    ({"kind": "memory"}, "kind: memory"),
    ({"memory_budget_gb": 8, "fixed": {"segment_size": "auto"}}, "fixed.segment_size: auto"),
    ({"memory_budget_gb": 8, "search": "random", "grid": {},
      "space": {"segment_size": {"choice": ["auto", 2]}}}, "space.segment_size: auto"),
    ({"memory_budget_gb": 8}, "memory_budget_gb is a trial's"),
])
def test_pack_is_refused_where_packs_cannot_run(more: dict, said: str) -> None:
    """Would catch: a spec accepted whose packs the scheduler would refuse once Ray is up,
    or a pack of trials the memory probe sized for one adapter."""
    with pytest.raises(SpecError, match=said):
        parse_spec({**BASE, "pack": 2, **more})
