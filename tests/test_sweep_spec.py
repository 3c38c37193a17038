"""Sweep specs: validation names the bad key; trials expand deterministically."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.sweep.spec_file import load_spec, parse_spec
from tasks.sweep.sweep_spec import SpecError, trial_id

pytestmark = pytest.mark.unit
BASE = {"name": "s", "model": "m", "data": "d"}


def test_grid_expands_to_the_cartesian_product_with_fixed_params() -> None:
    spec = parse_spec({**BASE, "fixed": {"steps": 5},
                       "grid": {"segment_size": [1, 2], "lora_rank": [4, 8, 16]}})
    trials = spec.trials()
    assert len(trials) == 6 and spec.search == "grid"
    assert {(t.params()["segment_size"], t.params()["lora_rank"]) for t in trials} == {
        (s, r) for s in (1, 2) for r in (4, 8, 16)}
    assert all(t.params()["steps"] == 5 for t in trials)
    assert len({t.id for t in trials}) == 6


def test_random_search_is_seeded_and_within_bounds() -> None:
    raw = {**BASE, "search": "random", "num_samples": 20, "seed": 3,
           "space": {"learning_rate": {"loguniform": [1e-5, 1e-3]},
                     "lora_rank": {"choice": [4, 8]}, "warmup_steps": {"int": [0, 3]},
                     "orpo_lambda": {"uniform": [0.05, 0.5]}}}
    a, b = parse_spec(raw).trials(), parse_spec(raw).trials()
    assert [t.params() for t in a] == [t.params() for t in b]
    assert a != parse_spec({**raw, "seed": 4}).trials()
    for t in a:
        assert 1e-5 <= t.params()["learning_rate"] <= 1e-3
        assert t.params()["lora_rank"] in (4, 8) and t.params()["warmup_steps"] in range(4)
        assert 0.05 <= t.params()["orpo_lambda"] <= 0.5


def test_trial_ids_are_stable_and_order_free() -> None:
    assert trial_id({"a": 1, "b": 2}) == trial_id({"b": 2, "a": 1})
    assert trial_id({"a": 1}) != trial_id({"a": 2})


@pytest.mark.parametrize(("raw", "message"), [
    ({**BASE, "bogus": 1}, "unknown key.*bogus"),
    ({"name": "s", "data": "d"}, "model: required"),
    ({**BASE, "grid": {"learnin_rate": [1e-4]}}, "grid.learnin_rate: not a training param"),
    ({**BASE, "fixed": {"batch_size": 0}}, r"fixed.batch_size=0"),
    ({**BASE, "grid": {"loss": ["nonesuch"]}}, r"grid.loss='nonesuch'"),
    ({**BASE, "fixed": {"out": "x"}}, "fixed.out: set by the sweep"),
    ({**BASE, "search": "random", "space": {"lora_rank": {"normal": [1, 2]}}},
     "space.lora_rank: expected one of"),
    ({**BASE, "search": "random", "space": {"learning_rate": {"loguniform": [0, 1]}}},
     "space.learning_rate.loguniform"),
    ({**BASE, "search": "grid", "space": {"lora_rank": {"choice": [4]}}}, "grid search has no"),
    ({**BASE, "fixed": {"steps": 3}, "grid": {"steps": [1]}}, "steps: given in more than one"),
    ({**BASE, "mode": "biggest"}, "mode='biggest'"),
    ({**BASE, "grid": {"segment_size": ["auto"]}}, "segment_size: auto needs memory_budget_gb"),
    ({**BASE, "search": "optuna", "grid": {"lora_rank": [4]},
      "space": {"learning_rate": {"loguniform": [1e-4, 1e-3]}}}, "optuna samples a space"),
    ({**BASE, "pruning": True}, "pruning: needs search: optuna"),
    ({**BASE, "search": "optuna", "space": {"lora_rank": {"choice": [4]}},
      "pruning": {"patience": 3}}, "pruning: expected true or a mapping"),
    ({**BASE, "metric": "loss"}, "metric='loss': expected a validation metric"),
    ({**BASE, "retries": -1}, "retries=-1"),
    ({**BASE, "name": "../../etc"}, "name='../../etc': letters, digits"),
    ({**BASE, "reuse_actors": "yes"}, "reuse_actors='yes': expected true or false"),
])
def test_errors_name_the_bad_key(raw: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_spec(raw, "sweep.yaml")


def test_segment_size_auto_is_allowed(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nmodel: m\ndata: d\nmemory_budget_gb: 8\n"
                    "grid:\n  segment_size: [auto, 2]\n")
    plans = load_spec(path).trials()
    assert [t.config.segment_size for t in plans] == [0, 2]  # auto: the default, probed from
    assert [t.auto for t in plans] == [{"segment_size"}, set()]
    path.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match=r"s\.yaml: not valid YAML"):
        load_spec(path)


def test_shipped_configs_parse() -> None:
    configs = sorted((Path(__file__).resolve().parents[1] / "flows" / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        assert load_spec(path).trials()


def test_loss_is_searched_like_any_key_and_ranked_on_a_shared_metric() -> None:
    """A grid or space over ``loss`` expands to trials of each loss; val/loss (each loss's
    own scale) cannot rank them, val/rewards/accuracies can (sft's rewards are ℓ)."""
    grid = {**BASE, "grid": {"loss": ["orpo", "simpo"]}, "metric": "val/rewards/accuracies",
            "mode": "max"}
    assert [t.params()["loss"] for t in parse_spec(grid).trials()] == ["orpo", "simpo"]
    space = {**BASE, "search": "random", "num_samples": 6, "metric": "val/nll_loss",
             "space": {"loss": {"choice": ["orpo", "simpo", "sft"]}}}
    assert {t.params()["loss"] for t in parse_spec(space).trials()} <= {"orpo", "simpo", "sft"}
    with pytest.raises(SpecError, match="not comparable across losses"):
        parse_spec({**grid, "metric": "val/loss"})
    assert len(parse_spec({**grid, "grid": {"loss": ["orpo", "sft"]}}).trials()) == 2
    with pytest.raises(SpecError, match="loss"):
        parse_spec({**grid, "grid": {"loss": ["orpo", "nonesuch"]}})
    assert parse_spec({**BASE, "fixed": {"loss": "simpo"}}).metric == "val/loss"  # one loss


def test_each_trial_picks_its_best_evaluation_by_the_ranking_metric(tmp_path) -> None:
    """A sweep ranked on accuracy (max) trains trials whose best_val is the most accurate
    evaluation; a spec cannot set another rule (the sweep would rank on values picked by
    it), and a metric its loss does not report is refused before anything trains."""
    spec = parse_spec({"name": "s", "model": "m", "data": "d", "metric":
                       "val/rewards/accuracies", "mode": "max",
                       "grid": {"learning_rate": [1e-4, 2e-4]}})
    configs = [t.config for t in spec.trials(tmp_path)]
    assert {(c.best_metric, c.best_mode) for c in configs} == {
        ("val/rewards/accuracies", "max")}
    for where in ({"fixed": {"best_metric": "val/nll_loss"}},
                  {"grid": {"best_mode": ["min", "max"]}}):
        with pytest.raises(SpecError, match="set by the sweep itself"):
            parse_spec({"name": "s", "model": "m", "data": "d", **where})
    with pytest.raises(SpecError, match=r"val/log_odds_ratio.*simpo"):
        parse_spec({"name": "s", "model": "m", "data": "d", "metric": "val/log_odds_ratio",
                    "fixed": {"loss": "simpo"}})
    parse_spec({"name": "s", "model": "m", "data": "d", "metric": "val/log_odds_ratio"})


def test_the_board_of_a_sweep_over_losses_ranks_on_a_shared_metric(tmp_path, tiny_model,
                                                                    tiny_data) -> None:
    """`pomona leaderboard` on trials of ORPO and DPO refuses val/loss (each loss's own
    scale) and DPO's relative rewards, before any evaluation; it takes logps/accuracies."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.board.leaderboard import check_leaderboard_inputs

    pq.write_table(pa.table({"trial_id": ["a", "b"], "param/loss": ["orpo", "dpo"]}),
                   tmp_path / "results.parquet")
    for metric in ("val/loss", "val/rewards/accuracies"):
        with pytest.raises(ValueError, match=f"{metric}: not comparable.*dpo"):
            check_leaderboard_inputs(tmp_path, str(tiny_model), str(tiny_data), metric, "max")
    check_leaderboard_inputs(tmp_path, str(tiny_model), str(tiny_data),
                             "val/logps/accuracies", "max")


def test_duplicate_keys_are_refused_naming_the_key_and_line(tmp_path: Path) -> None:
    """Issue 36, low: a key given twice was accepted and the last one won."""
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nmodel: m\ndata: d\nfixed:\n  steps: 5\n  lora_rank: 4\n"
                    "  steps: 50\n")
    with pytest.raises(SpecError, match=r"s\.yaml: key 'steps' given twice \(line 7\)"):
        load_spec(path)
    path.write_text("name: s\nmodel: m\ndata: d\nname: t\n")
    with pytest.raises(SpecError, match=r"key 'name' given twice \(line 4\)"):
        load_spec(path)


def test_a_unicode_name_is_accepted_and_a_path_is_not() -> None:
    """Issue 36, low: a unicode ``name`` was refused, even with --out given."""
    assert parse_spec({**BASE, "name": "тест-実験_1"}).name == "тест-実験_1"
    for bad in ("../x", "a/b", ".hidden", "a b"):
        with pytest.raises(SpecError, match="letters, digits"):
            parse_spec({**BASE, "name": bad})


def test_a_huge_grid_is_warned_of_with_its_count(tmp_path: Path, caplog) -> None:
    """Issue 36, item 17 (its spec part): a 10,000-trial grid was accepted without a word."""
    path = tmp_path / "s.yaml"
    values = ", ".join(str(1e-5 * (i + 1)) for i in range(100))
    path.write_text(f"name: s\nmodel: m\ndata: d\ngrid:\n  learning_rate: [{values}]\n"
                    "  lora_rank: [" + ", ".join(str(i + 1) for i in range(100)) + "]\n")
    with caplog.at_level("WARNING", logger="pomona.sweep"):
        spec = load_spec(path)
    assert spec.size() == 10_000 == len(spec.points())
    [record] = [r for r in caplog.records if r.name == "pomona.sweep"]
    assert "10,000 trials planned" in record.getMessage()
    caplog.clear()
    path.write_text("name: s\nmodel: m\ndata: d\ngrid:\n  lora_rank: [4, 8]\n")
    with caplog.at_level("WARNING", logger="pomona.sweep"):
        assert load_spec(path).size() == 2
    assert not [r for r in caplog.records if r.name == "pomona.sweep"]


def test_reuse_actors_reaches_the_trials_rules() -> None:
    """``reuse_actors`` (tasks/sweep/warm_actor.py): off unless asked, and the scheduler's
    rules carry it as the spec gives it."""
    assert not parse_spec(BASE).rules.reuse_actors
    assert parse_spec({**BASE, "reuse_actors": True}).rules.reuse_actors
