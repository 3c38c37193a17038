"""One typed trial plan from spec to actor: its TrainConfig built once, its keys unchanged."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from engine.settings.config import TrainConfig
from tasks.sweep.spec_file import parse_spec
from tasks.sweep.sweep_plan import cache_key
from tasks.sweep.trial_plan import AUTO, TrialPlan


@pytest.mark.unit
def test_cache_keys_come_from_the_plan_s_config_and_ids_from_the_spec(tmp_path: Path) -> None:
    """Ids are those printed before plans were typed (a hash of the spec's point); keys
    are a hash of every effective setting of the plan's one TrainConfig, defaults
    included. Would catch: a key that misses a default the spec left out (a changed default
    would reuse results trained at the old one), a key that tells ``lora_rank: 8`` from
    ``lora_rank: 8.0`` or a value the spec wrote from the same default left out, or an
    ``auto`` resolved to 3 keyed apart from a plain 3."""
    spec = parse_spec({"name": "a", "model": "m", "data": "d", "memory_budget_gb": 8,
                       "fixed": {"steps": 5, "learning_rate": "1e-4",
                                 "lora_keys": ["self_attn.q_proj"]},
                       "grid": {"segment_size": ["auto", 2, 3.0], "lora_rank": [4, 8.0]}})
    plans = [p.resolve({"segment_size": 3}) if p.auto else p
             for p in spec.trials(Path("/tmp/sweepout"))]
    keys = [cache_key(p.config, "fp", "mk") for p in plans]
    assert [p.id for p in plans] == [  # [0, 1, 3, 4] as before plans were typed
        "t-b513ce53df", "t-7799dcf59a", "t-c8b0470868", "t-14f06ac7e2", "t-24bd16bde4",
        "t-bd695cdf12"]
    assert keys == [  # lora_rank 4 then 8.0; auto -> 3 keyed as segment_size 3.0
        "89f6912569b61101", "8ea1b39e89a023ed", "89f6912569b61101", "ceab6d930586a6d1",
        "10b8a5239727548c", "ceab6d930586a6d1"]  # 2026-12-07: shared_lora_inputs, compile
    default = parse_spec({"name": "a", "model": "m", "data": "d",
                          "fixed": {"steps": 5, "lora_rank": 8, "lora_scale": 20.0}})
    left_out = parse_spec({"name": "a", "model": "m", "data": "d", "fixed": {"steps": 5}})
    [a], [b] = default.trials(tmp_path), left_out.trials(tmp_path)
    assert a.id != b.id and cache_key(a.config, "f", "m") == cache_key(b.config, "f", "m")
    assert cache_key(a.config, "f", "m") != cache_key(a.config.replace(seed=1), "f", "m")
    sent = TrialPlan.from_dict(pickle.loads(pickle.dumps(plans[0].to_dict())))
    assert sent.config.segment_size == 3 and sent.config.lora_keys == ("self_attn.q_proj",)
    assert sent.config == plans[0].config and sent.params() == plans[0].params()
    with pytest.raises(ValueError, match="segment_size still auto"):
        spec.trials(tmp_path)[0].to_dict()


@pytest.mark.integration
def test_train_config_is_built_once_per_trial_from_spec_to_actor(
        tiny_model: Path, tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """A grid of three trials, one ``segment_size: auto``, planned as a sweep plans them:
    listed, resolved by the real memory probe on the tiny model (its Ray task run in this
    process), keyed for the cache, sent as ``to_dict`` (pickled, as Ray would) and rebuilt
    in the actor. TrainConfig is constructed once per trial on the driver, and once more
    for the auto one, whose probed size makes a new frozen config (the plan's one truth
    holds what trains); three times in the actors; validated exactly as often (by its
    construction: ``check_values`` runs nowhere else). The spec's ``reference`` string (as
    the spec keeps it: plain, for ids and Optuna) is parsed once per trial on the driver,
    by its config, and once in its actor, where ``to_dict``'s string is read back. Would
    catch: a config rebuilt to validate a value, to key it, to list its params or to
    probe, a second validation of one config, a reference parsed again on its way, or a
    plan that reaches the actor still auto."""
    import sys

    import ray

    from engine.settings import reference_kind
    from tasks.nodes.placement import Placement
    from tasks.sweep.sweep_plan import plan_sweep

    built = {"driver": 0, "probe": 0, "actor": 0}
    where = ["driver"]
    init = TrainConfig.__init__

    def counted(self: TrainConfig, *args: Any, **kwargs: Any) -> None:
        built[where[-1]] += 1
        init(self, *args, **kwargs)

    checked = dict.fromkeys(built, 0)
    check = TrainConfig.check_values

    def counted_check(self: TrainConfig) -> None:
        checked[where[-1]] += 1
        check(self)

    class InProcess:  # Placement.fresh_task's Ray task, run here so its builds are seen
        def __init__(self, fn: Any):
            self.fn = fn

        def remote(self, *args: Any) -> Any:
            where.append("probe")
            try:
                return self.fn(*pickle.loads(pickle.dumps(args)))
            finally:
                where.pop()

    parsed = dict.fromkeys(built, 0)
    parse = reference_kind.parse_reference

    def counted_parse(value: Any) -> Any:
        parsed[where[-1]] += isinstance(value, str)  # a Reference passes through as it is
        return parse(value)

    spec = parse_spec({"name": "s", "model": str(tiny_model), "data": str(tiny_data),
                       "memory_budget_gb": 1000.0,
                       "fixed": {"steps": 2, "batch_size": 4, "lora_rank": 4,
                                 "reference": "base"},
                       "grid": {"segment_size": ["auto", 1, 2]}})
    for module in list(sys.modules.values()):  # each module that imported it by name
        if getattr(module, "parse_reference", None) is parse:
            monkeypatch.setattr(module, "parse_reference", counted_parse)
    monkeypatch.setattr(TrainConfig, "__init__", counted)
    monkeypatch.setattr(TrainConfig, "check_values", counted_check)
    monkeypatch.setattr(Placement, "fresh_task", lambda self, fn, env=None: InProcess(fn))
    monkeypatch.setattr(ray, "get", lambda value: value)
    plan = plan_sweep(spec, tmp_path / "sweep", Placement())
    sent = [pickle.dumps(p.to_dict()) for p in plan.todo]
    assert built["driver"] == 3 + 1 and built["probe"] >= 1  # the probe's rebuild, its sizes
    where.append("actor")
    actors = [TrialPlan.from_dict(pickle.loads(s)) for s in sent]
    assert (built["driver"], built["actor"]) == (4, 3)
    [auto] = [a for a in actors if plan.keyed[a.id].plan.probed]  # the probe's pick, sent
    assert auto.config.segment_size in (0, 1, 2) and not auto.auto
    assert [a.config.segment_size for a in actors][1:] == [1, 2]
    assert set(plan.keyed) == {a.id for a in actors}  # each keyed for the cache
    assert checked == built  # validated once a build, the actor's three included
    assert (parsed["driver"], parsed["actor"]) == (3, 3)  # once a trial in each process
    assert parsed["probe"] <= built["probe"]  # at most once a build there too


@pytest.mark.integration
def test_a_point_no_config_takes_is_one_failed_row_and_the_others_run(
        tiny_model: Path, tiny_data: Path, tmp_path: Path) -> None:
    """A grid crossing mlp_chunk with lora_dropout (a rule across fields): the one bad
    point becomes a failed row naming why, with its params, and the three others are
    planned, as when the bad one failed in its actor. Would catch: the whole sweep refused
    for one point, or the point dropped from the table."""
    from tasks.nodes.placement import Placement
    from tasks.sweep.sweep_plan import SweepInputs

    spec = parse_spec({"name": "x", "model": str(tiny_model), "data": str(tiny_data),
                       "fixed": {"steps": 1},
                       "grid": {"mlp_chunk": [0, 64], "lora_dropout": [0.0, 0.1]}})
    planned, refused = SweepInputs.read(spec, tmp_path / "out", Placement()).plan_points()
    assert len(planned) == 3
    [bad] = refused
    assert bad["status"] == "failed" and "mlp_chunk" in bad["reason"] and bad["reason"].startswith(
        f"trial {bad['trial_id']}")
    assert (bad["param/mlp_chunk"], bad["param/lora_dropout"]) == (64, 0.1)


@pytest.mark.unit
def test_optuna_choices_keep_their_values_and_a_bad_point_is_one_row(monkeypatch) -> None:
    """Optuna's choices are the spec's values (None and lists stay themselves; auto is its
    word), and a sampled point no TrainConfig takes is reported once however often the
    sampler repeats it. Would catch: choices turned into their repr (a lora_keys choice
    training the key "None"), or the results table holding the same trial N times."""
    import ray

    from tasks.sweep.optuna_search import OptunaSource, distribution
    from tasks.sweep.sweep_spec import Dist, PlanError

    dist = distribution(Dist("choice", (None, AUTO, 3, "x")))
    assert list(dist.choices) == [None, "auto", 3, "x"]

    class Remote:
        def __init__(self, fn):
            self.remote = fn

    told: list[tuple] = []

    class Study:  # the sampler repeating one point
        ask = Remote(lambda: (len(told), {"mlp_chunk": 64, "lora_dropout": 0.1}))
        tell = Remote(lambda *args: told.append(args))

    def build(params: dict[str, Any], number: int) -> TrialPlan:
        raise PlanError(f"trial t-x {params}: mlp_chunk with lora_dropout > 0")

    spec = parse_spec({"name": "o", "model": "m", "data": "d", "search": "optuna",
                       "num_samples": 4, "metric": "val/loss", "mode": "min",
                       "space": {"mlp_chunk": {"choice": [0, 64]},
                                 "lora_dropout": {"choice": [0.0, 0.1]}}})
    monkeypatch.setattr(ray, "get", lambda x: x)
    source = OptunaSource(spec, Study(), build, lambda plan: None, lambda s: None)
    assert source.ask() is None  # every sample the same bad point: nothing to train
    assert len(told) == 4 and all(state == "fail" for _, _, state in told)
    [row] = source.reused
    assert row["status"] == "failed" and row["param/mlp_chunk"] == 64


@pytest.mark.unit
def test_a_failed_trial_s_note_is_its_reason_not_its_params(tmp_path: Path) -> None:
    """The trials table's note of a refused point was the first 60 characters of its
    reason, all of them the trial's id and params' JSON; a crash's note ran over lines.
    Would catch: the rule cut off behind the params, or a note of more than one line."""
    import io

    from rich.console import Console

    from cli.sweep_display import results_table
    from tasks.sweep.sweep_spec import PlanError, trial_id

    spec = parse_spec({"name": "x", "model": "m", "data": "d",
                       "grid": {"mlp_chunk": [0, 64], "lora_dropout": [0.0, 0.1]}})
    params = {"mlp_chunk": 64, "lora_dropout": 0.1, "lora_rank": 16}
    with pytest.raises(PlanError) as err:  # the row tasks/sweep/run.py makes of it
        spec.plan(params, tmp_path)
    refused = {"trial_id": trial_id(params), "status": "failed", "reason": str(err.value)}
    crashed = {"trial_id": "t-1", "status": "failed",
               "reason": "RuntimeError: out of memory\nwhile allocating 3 GB"}
    console = Console(file=io.StringIO(), width=300)
    console.print(results_table(spec, [refused, crashed], tmp_path))
    text = console.file.getvalue()
    assert "mlp_chunk with lora_dropout > 0: masks would differ from the unchunked path" in text
    assert '"lora_rank"' not in text and "RuntimeError: out of memory" in text
    assert "while allocating" not in text, text


@pytest.mark.unit
def test_forward_options_are_one_value_with_the_trainer_s_defaults() -> None:
    """The forward-only passes (reference, score, evaluation) take one ForwardOptions; its
    defaults are TrainConfig's and a run's is its config's, a rank's share of the batch.
    Would catch: a default drifting from the trainer's (evaluation at a batch it never
    trained at), or a rank's reference pass over the whole batch."""
    import dataclasses

    from engine.settings.forward_options import ForwardOptions

    defaults = TrainConfig.defaults()
    assert {f.name: getattr(ForwardOptions(), f.name)
            for f in dataclasses.fields(ForwardOptions)} == {
        f.name: defaults[f.name] for f in dataclasses.fields(ForwardOptions)}
    cfg = TrainConfig(batch_size=8, head_chunk=64, prefix_share="off",
                      allow_tokenizer_mismatch=True)
    assert cfg.forward() == ForwardOptions(8, 64, "off", True)
    assert cfg.forward(ranks=4) == ForwardOptions(2, 64, "off", True)
    assert TrainConfig(batch_size=2).forward(ranks=4).batch_size == 1
