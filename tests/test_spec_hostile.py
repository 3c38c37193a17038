"""Hostile sweep specs (issue 52, low items): a trial planned twice, and a rule across fields
that every trial breaks, found when the spec is read rather than trial by trial."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks.sweep.spec_file import load_spec, parse_spec
from tasks.sweep.sweep_spec import SpecError, trial_id

pytestmark = pytest.mark.unit
BASE = {"name": "s", "model": "m", "data": "d"}


def test_a_loss_only_setting_does_not_plan_another_loss_twice() -> None:
    """grid {loss: [kto, cpo], kto_beta: [0.1, 0.2]}: kto_beta is not CPO's, so both CPO
    points are one trial, and it was planned twice under two ids (run twice, ranked twice).
    The trial kept is its first point, id unchanged (its cache still found). Would catch:
    the repeat, a kept trial's id moved, or ``size()`` (the count the sweep warns of and
    prints) disagreeing with the trials listed."""
    spec = parse_spec({**BASE, "metric": "val/nll_loss",
                       "grid": {"loss": ["kto", "cpo"], "kto_beta": [0.1, 0.2]}})
    trials = spec.trials()
    points = [{"kto_beta": 0.1, "loss": "kto"}, {"kto_beta": 0.1, "loss": "cpo"},
              {"kto_beta": 0.2, "loss": "kto"}]  # the spec's order; CPO's at 0.2 dropped
    assert [t.id for t in trials] == [trial_id(p) for p in points]
    assert [t.config.loss.kind for t in trials] == ["kto", "cpo", "kto"]
    assert len(trials) == spec.size() == len(spec.points()) == 3


def test_random_draws_of_one_trial_are_one_trial() -> None:
    """12 random draws from a two-value choice listed 12 trials under 2 ids (the same
    trial run six times at once into one folder). Would catch: the repeats, or a count
    of 12 printed for a sweep of two."""
    spec = parse_spec({**BASE, "search": "random", "num_samples": 12,
                       "space": {"lora_rank": {"choice": [4, 8]}}})
    assert sorted(t.params()["lora_rank"] for t in spec.trials()) == [4, 8]
    assert spec.size() == 2


BROKEN_IN_FIXED = [
    ({"loss": "cpo", "cpo_loss_type": "hinge", "cpo_label_smoothing": 0.1},
     "cpo_label_smoothing=0.1 with loss type hinge: it has no label smoothing"),
    ({"mlp_chunk": 64, "lora_dropout": 0.1}, "mlp_chunk with lora_dropout > 0"),
]
SEARCHES = [
    {"grid": {"lora_rank": [4, 8]}},
    {"search": "random", "num_samples": 3, "space": {"learning_rate": {"loguniform":
                                                                      [1e-5, 1e-3]}}},
    {"search": "optuna", "num_samples": 3, "space": {"lora_rank": {"choice": [4, 8]}}},
]


@pytest.mark.parametrize("search", SEARCHES, ids=["grid", "random", "optuna"])
@pytest.mark.parametrize(("fixed", "rule"), BROKEN_IN_FIXED, ids=["smoothing", "mlp_chunk"])
def test_a_rule_broken_in_fixed_is_refused_when_the_spec_is_read(
        tmp_path: Path, fixed: dict, rule: str, search: dict) -> None:
    """``fixed: {loss: cpo, cpo_loss_type: hinge, cpo_label_smoothing: 0.1}`` was read
    without a word, and then every trial failed, one by one, once the cluster was up.
    Would catch: the spec accepted, or an error that is not one line naming the file, the
    section and the field."""
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**BASE, **search, "fixed": fixed}))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    message = str(err.value)
    assert message.startswith(f"{path}: fixed: {rule}") and "\n" not in message, message


def test_a_rule_every_grid_point_breaks_is_refused_and_one_point_is_not() -> None:
    """A grid whose every point breaks a rule (hinge fixed, label smoothing swept) runs
    nothing: refused, naming a trial and the rule. One bad point of four still plans the
    three others (its row says why: tests/test_trial_plan.py). Would catch: a sweep of N
    failed trials, or the whole sweep refused for one point."""
    with pytest.raises(SpecError, match=r"^s\.yaml: no trial of this sweep can run: trial "
                                        r"t-\w+ .*cpo_label_smoothing=0\.1 with loss type "
                                        "hinge"):
        parse_spec({**BASE, "fixed": {"loss": "cpo", "cpo_loss_type": "hinge"},
                    "grid": {"cpo_label_smoothing": [0.1, 0.2]}}, "s.yaml")
    spec = parse_spec({**BASE, "grid": {"mlp_chunk": [0, 64], "lora_dropout": [0.0, 0.1]}})
    assert spec.size() == 4
