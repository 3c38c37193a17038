"""The loss protocol (engine/losses/): every registered loss declares what it reports, its
settings are options by their flat names, a config holds one loss's settings and refuses
another's, and a sweep over losses gives each trial its own."""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
import numpy as np
import pytest

from engine.losses import (
    LOSSES,
    OWNERS,
    PAIR_LOSSES,
    READERS,
    REGISTRY,
    Norms,
    pair_loss,
    spec_of,
    validation_metrics,
)
from engine.settings.config import TrainConfig
from tasks.sweep.spec_file import parse_spec
from tasks.sweep.spec_rules import SpecError


@pytest.mark.unit
def test_each_setting_belongs_to_one_loss_or_to_sampling() -> None:
    """A setting is one loss's own, or a sampling setting (engine/losses/sampled.py)
    read by exactly the losses that sample: grpo, and the pair losses' online pairs."""
    from engine.losses.sampled import SAMPLED_FIELDS, Sampled

    shared = (*SAMPLED_FIELDS, "pairs")
    names = [n for cls in REGISTRY for n in cls.names() if n not in shared]
    samplers = {cls.kind for cls in REGISTRY if issubclass(cls, Sampled)}
    assert len(names) == len(set(names)) == len(OWNERS) - len(shared)
    assert samplers == {"grpo", "orpo", "simpo", "cpo", "dpo"}
    assert {r.kind for r in READERS["pairs"]} == samplers - {"grpo"}
    for name in SAMPLED_FIELDS:
        assert {r.kind for r in READERS[name]} == samplers and OWNERS[name].kind == "grpo"
    assert set(LOSSES) == {cls.kind for cls in REGISTRY} and len(LOSSES) == len(REGISTRY)


@pytest.mark.unit
@pytest.mark.parametrize("kind", sorted(PAIR_LOSSES))
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


@pytest.mark.unit
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


@pytest.mark.unit
def test_another_loss_setting_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="orpo_lambda: a setting of loss orpo, and this "
                                         "run's loss is simpo"):
        TrainConfig().replace(loss="simpo", orpo_lambda=0.3)
    with pytest.raises(ValueError, match="unknown config field"):
        TrainConfig().replace(nonesuch_beta=0.3)
    kept = TrainConfig().replace(orpo_lambda=0.5).replace(loss="orpo")  # same loss: kept
    assert kept.loss.orpo_lambda == 0.5
    assert TrainConfig().replace(orpo_lambda=0.5).replace(loss="dpo").loss == LOSSES["dpo"]()


@pytest.mark.unit
def test_a_sweep_over_losses_gives_each_trial_its_own_settings(tmp_path) -> None:
    spec = parse_spec({"name": "s", "model": "m", "data": "d", "metric": "val/logps/accuracies",
                       "fixed": {"orpo_lambda": 1.0, "rpo_alpha": 1.0, "steps": 2},
                       "grid": {"loss": ["orpo", "dpo"]}})
    plans = {p.params()["loss"]: p for p in spec.trials(tmp_path)}
    assert plans["orpo"].config.loss == LOSSES["orpo"](orpo_lambda=1.0)
    assert plans["dpo"].config.loss == LOSSES["dpo"](rpo_alpha=1.0)
    # Each trial's param columns are its own loss's settings: the ORPO trial had no rpo_alpha.
    assert "rpo_alpha" not in plans["orpo"].params() and plans["dpo"].params()["rpo_alpha"] == 1.0


@pytest.mark.unit
def test_a_setting_of_a_loss_no_trial_trains_is_refused() -> None:
    with pytest.raises(SpecError, match=r"fixed\.simpo_beta: a setting of loss simpo, which no "
                                        "trial of this sweep trains with"):
        parse_spec({"name": "s", "model": "m", "data": "d", "fixed": {"simpo_beta": 3.0}})
    with pytest.raises(SpecError, match=r"grid\.dpo_beta"):
        parse_spec({"name": "s", "model": "m", "data": "d", "fixed": {"loss": "simpo"},
                    "grid": {"dpo_beta": [0.1, 0.2]}})


@pytest.mark.slow
def test_a_sweep_over_every_loss_trains_each_with_its_own_settings(
        ray_cluster, tiny_model, tiny_data, tmp_path) -> None:
    """``loss:`` over every registered loss in one grid, each loss's first setting given
    in ``fixed`` off its default: every trial completes, its adapter records its own loss
    and its own settings alone; losses that read a reference get theirs made (KTO's with
    its KL partners: two files for the base when DPO and KTO both run)."""
    from tasks.nodes.placement import Placement
    from tasks.sweep.references import reference_needs
    from tasks.sweep.run import run_sweep
    from tasks.sweep.sweep_plan import plan_sweep

    own = {cls.kind: next(iter(dataclasses.fields(cls)), None)
           for cls in PAIR_LOSSES.values()}
    fixed = {f.name: f.default * 2 + 0.25 for f in own.values()
             if f is not None and isinstance(f.default, float)}
    spec = parse_spec({"name": "losses", "model": str(tiny_model), "data": str(tiny_data),
                       "metric": "val/logps/accuracies", "mode": "max", "max_concurrent": 2,
                       "fixed": {"steps": 2, "batch_size": 4, "lora_rank": 4, "val_every": 2,
                                 **fixed},
                       "grid": {"loss": sorted(PAIR_LOSSES)}})
    kinds = {cls.needs_kl for cls in REGISTRY if cls.needs_reference}
    needs = reference_needs(plan_sweep(spec, tmp_path, Placement()))
    assert sorted(r.kl for r, _ in needs) == sorted(kinds)
    rows = run_sweep(spec, tmp_path)
    assert [r["status"] for r in rows] == ["completed"] * len(PAIR_LOSSES), [
        r.get("reason") for r in rows]
    for r in rows:
        block = json.loads((tmp_path / r["trial_id"] / "adapter_config.json").read_text())
        kind = block["pomona"]["loss"]
        assert kind == r["param/loss"] and r["best_val_accuracy"] is not None
        theirs = set(OWNERS) - set(LOSSES[kind].names())
        assert not theirs & set(block["pomona"]), (kind, sorted(block["pomona"]))
        for name, value in fixed.items():
            if name in LOSSES[kind].names():
                assert block["pomona"][name] == value, (kind, name)
