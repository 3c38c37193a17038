"""The loss protocol (engine/losses/): every registered loss declares what it reports, its
settings are options by their flat names, a config holds one loss's settings and refuses
another's, and a sweep over losses gives each trial its own."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from engine.config import TrainConfig
from engine.losses import LOSSES, OWNERS, REGISTRY, Norms, pair_loss, spec_of, validation_metrics
from tasks.spec_rules import SpecError
from tasks.sweep_spec import parse_spec

pytestmark = pytest.mark.unit


def test_each_setting_belongs_to_one_loss() -> None:
    names = [n for cls in REGISTRY for n in cls.names()]
    assert len(names) == len(set(names)) == len(OWNERS)
    assert set(LOSSES) == {cls.kind for cls in REGISTRY} and len(LOSSES) == len(REGISTRY)


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_declared_metrics_are_the_ones_a_batch_reports(kind: str) -> None:
    """validation_metrics reads a loss's declared extras: they must be what pair_loss
    reports (a loss adding an extra it does not declare would go unranked)."""
    rng = np.random.default_rng(0)
    lp = mx.array(-rng.uniform(0.1, 3.0, (4, 6)).astype(np.float32))
    nll = mx.array(np.r_[np.ones((2, 6)), np.zeros((2, 6))].astype(np.float32))
    _, metrics = pair_loss(lp, mx.ones((4, 6)), nll, spec_of(kind), Norms(12.0, 2.0),
                           mx.array([-5.0, -6.0, -7.0, -8.0]), mx.array(0.3))
    reported = {f"val/{k}" for k in metrics} - {"val/nll_sum"} | {
        "val/loss", "val/nll_loss", "val/rows"}
    assert sorted(reported) == validation_metrics(LOSSES[kind]())


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_a_config_crosses_as_a_flat_dict_and_back(kind: str) -> None:
    cls = LOSSES[kind]
    changed = {f.name: f.default * 2 + 0.25 for f in dataclasses.fields(cls)
               if isinstance(f.default, float)}  # off their defaults, where the rules allow
    config = TrainConfig().replace(loss=kind, **_valid(cls, changed))
    flat = config.to_dict()
    assert flat["loss"] == kind and not set(flat) & (set(OWNERS) - set(cls.names()))
    assert TrainConfig.from_dict(flat) == config


def _valid(cls, fields: dict) -> dict:
    """``fields`` less those the loss's rules refuse at these values."""
    kept = {}
    for name, value in fields.items():
        try:
            cls(**{**kept, name: value})
            kept[name] = value
        except ValueError:
            pass
    return kept


def test_another_loss_setting_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="orpo_lambda: a setting of loss orpo, and this "
                                         "run's loss is simpo"):
        TrainConfig().replace(loss="simpo", orpo_lambda=0.3)
    with pytest.raises(ValueError, match="unknown config field"):
        TrainConfig().replace(nonesuch_beta=0.3)
    kept = TrainConfig().replace(orpo_lambda=0.5).replace(loss="orpo")  # same loss: kept
    assert kept.loss.orpo_lambda == 0.5
    assert TrainConfig().replace(orpo_lambda=0.5).replace(loss="dpo").loss == LOSSES["dpo"]()


def test_a_sweep_over_losses_gives_each_trial_its_own_settings(tmp_path) -> None:
    spec = parse_spec({"name": "s", "model": "m", "data": "d", "metric": "val/logps/accuracies",
                       "fixed": {"orpo_lambda": 1.0, "rpo_alpha": 1.0, "steps": 2},
                       "grid": {"loss": ["orpo", "dpo"]}})
    plans = {p.fields["loss"]: p for p in spec.trials(tmp_path)}
    assert plans["orpo"].config.loss == LOSSES["orpo"](orpo_lambda=1.0)
    assert plans["dpo"].config.loss == LOSSES["dpo"](rpo_alpha=1.0)
    assert plans["orpo"].fields["rpo_alpha"] == 1.0  # the trial's id and param columns


def test_a_setting_of_a_loss_no_trial_trains_is_refused() -> None:
    with pytest.raises(SpecError, match=r"fixed\.simpo_beta: a setting of loss simpo, which no "
                                        "trial of this sweep trains with"):
        parse_spec({"name": "s", "model": "m", "data": "d", "fixed": {"simpo_beta": 3.0}})
    with pytest.raises(SpecError, match=r"grid\.dpo_beta"):
        parse_spec({"name": "s", "model": "m", "data": "d", "fixed": {"loss": "simpo"},
                    "grid": {"dpo_beta": [0.1, 0.2]}})
