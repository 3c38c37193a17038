"""Issue 73, step 1: GRPO trials in a sweep. A spec's ``loss: grpo`` with its reward and
rollout settings sweepable, ranked on ``val/reward``; a ``python:`` reward's module keyed
by its bytes (an edited verifier trains again) and sent to a trial's node by content
(tasks/nodes/trial_inputs.py ``importable``); packs, gangs and a missing or broken reward
refused when the spec is read, each in one line."""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.nodes.node_files import Bundle, local_reader
from tasks.sweep.spec_file import parse_spec
from tasks.sweep.spec_rules import SpecError

VERIFIER = '''
def score(prompt, completion, row):
    """The share of the completion's characters that are letters."""
    text = completion.replace(" ", "")
    return sum(c.isalpha() for c in text) / len(text) if text else 0.0
'''


def grpo_spec(model: str, data: str, reward: str, **top) -> dict:
    return {"name": "g", "model": model, "data": data, "max_concurrent": 2,
            "fixed": {"loss": "grpo", "reward": reward, "steps": 2, "batch_size": 2,
                      "num_generations": 2, "max_completion_length": 4, "lora_rank": 4,
                      "val_every": 0},
            **top}


def verifier(folder: Path, body: str = VERIFIER) -> str:
    """A lab's own reward module in ``folder`` (on this process's path, as the lab's
    driver imports it; a node's worker has no such path), named afresh each test."""
    name = f"lab_reward_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(body)
    sys.path.insert(0, str(folder))
    return name


@pytest.mark.unit
def test_a_grpo_spec_sweeps_its_settings_and_refuses_what_it_cannot_run() -> None:
    raw = grpo_spec("m", "d", "task:sort")
    raw["fixed"].pop("num_generations")
    spec = parse_spec({**raw, "grid": {
        "grpo_beta": [0.0, 0.04], "temperature": [0.7, 1.0], "num_generations": [2, 4],
        "grpo_loss_type": ["grpo", "dapo"], "grpo_epsilon": [0.2, 0.3]}})
    assert (spec.metric, spec.mode) == ("val/reward", "max")  # it reports no val/loss
    plans = [spec.plan(p, Path("runs/g")) for p in spec.listing()]
    assert len(plans) == 32 and {p.config.loss.kind for p in plans} == {"grpo"}
    assert {(p.config.loss.temperature, p.config.loss.num_generations) for p in plans} == {
        (0.7, 2), (0.7, 4), (1.0, 2), (1.0, 4)}
    assert {p.params()["reward"] for p in plans} == {("task:sort",)}
    base = grpo_spec("m", "d", "task:sort")
    grpo = {"loss": "grpo"}
    cases = [("pack", 2, "pack: 2: loss grpo trains one trial to a process"),
             ("ranks_per_trial", 2, "ranks_per_trial: 2: loss grpo trains on one rank"),
             ("fixed", grpo, "loss grpo learns from a reward: give fixed.reward"),
             ("fixed", {**grpo, "reward": "nonesuch"}, "fixed.reward: scorer 'nonesuch'"),
             ("fixed", {**grpo, "reward": "python:no_such_mod:f"},
              "fixed.reward: scorer python:no_such_mod:f: cannot import it"),
             ("grid", {"reward": ["task:sort", "contains", "bad"]}, "grid.reward: scorer 'bad'")]
    for key, value, message in cases:
        raw = {**base, key: value}
        if key == "grid":
            raw["fixed"] = {k: v for k, v in base["fixed"].items() if k != "reward"}
        with pytest.raises(SpecError, match=r"^[^\n]*$") as err:
            parse_spec(raw)
        assert message in str(err.value), (key, value, err.value)
    with pytest.raises(SpecError, match="loss: grpo and orpo share no validation metric"):
        parse_spec({**base, "fixed": {"reward": "task:sort"}, "grid": {"loss": ["orpo", "grpo"]}})


@pytest.mark.unit
def test_an_edited_python_reward_keys_its_trials_anew(tmp_path) -> None:
    """The reward's module bytes are in the trial's cache key (as a ``python:`` scorer's
    are in an evaluation's): the same file keeps the key, an edit changes it."""
    from tasks.sweep.sweep_plan import cache_key

    name = verifier(tmp_path)
    spec = parse_spec(grpo_spec("m", "d", f"python:{name}:score"))
    config = spec.plan(next(spec.listing()), tmp_path / "g").config
    key = cache_key(config, "data", "model")
    assert cache_key(config, "data", "model") == key
    (tmp_path / f"{name}.py").write_text(VERIFIER.replace("isalpha", "isdigit"))
    assert cache_key(config, "data", "model") != key
    builtin = parse_spec(grpo_spec("m", "d", "task:sort"))
    assert cache_key(builtin.plan(next(builtin.listing()), tmp_path / "g").config,
                     "data", "model") != key


@pytest.mark.unit
def test_a_python_reward_reaches_a_node_by_content(tmp_path, monkeypatch) -> None:
    """A node without the lab's module gets the sweep's bytes and imports them ahead of
    its own older copy; one it cannot import is a one-line error naming it, never a
    silent zero reward."""
    import tasks.nodes.trial_inputs as trial_inputs
    from tasks.eval.rewards import reward_sources
    from tasks.nodes.trial_inputs import importable

    monkeypatch.setenv("POMONA_CACHE", str(tmp_path / "cache"))
    (tmp_path / "driver").mkdir()
    name = verifier(tmp_path / "driver")
    spec = parse_spec(grpo_spec("m", "d", f"python:{name}:score"))
    config = spec.plan(next(spec.listing()), tmp_path / "g").config
    sources = reward_sources(config.loss)
    assert sources == {name: str(tmp_path / "driver" / f"{name}.py")}
    bundle = Bundle.of(sources[name])
    served = shutil.copytree(tmp_path / "driver", tmp_path / "served")  # the driver's bytes
    sys.path.remove(str(tmp_path / "driver"))
    shutil.rmtree(tmp_path / "driver")  # this "node" lacks the driver's folder
    sys.modules.pop(name)
    (tmp_path / "node").mkdir()  # and holds an older module of that name on its path
    (tmp_path / "node" / f"{name}.py").write_text("def score(p, c, r):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "node"))
    monkeypatch.setattr(trial_inputs, "server_reader", lambda server, digest: local_reader(
        Bundle.of(served / f"{name}.py")))
    copies = importable({"modules": {name: bundle.to_dict()}, "server": None})
    assert Path(copies[name]).is_relative_to(tmp_path / "cache" / "inputs")
    assert sys.modules[name].score("", "ab1", {}) == pytest.approx(2 / 3)  # not the old 0
    broken = Bundle.of(served / f"{name}.py")
    (served / f"{name}.py").write_text("raise SystemExit(3)\n")  # the bytes it was sent as
    sys.modules.pop(name)
    monkeypatch.setattr(trial_inputs, "fetch", lambda bundle, read: str(served / f"{name}.py"))
    with pytest.raises(RuntimeError, match=f"^reward module {name}: cannot import the "
                                           r"sweep's copy \(SystemExit: 3\)$"):
        importable({"modules": {name: broken.to_dict()}, "server": None})
    sys.modules.pop(name, None)


@pytest.mark.integration
def test_a_grpo_sweep_trains_on_ray_and_an_edited_reward_trains_again(
        ray_cluster, tiny_model, tiny_data, tmp_path) -> None:
    """Two GRPO trials on Ray's workers, rewarded by a lab's module that only the driver's
    path holds, their segment size the memory probe's pick (its rollouts rewarded by that
    module too): both complete ranked on ``best/val/reward``; a re-run is cached; the
    module edited, both train again."""
    from tasks.sweep.run import run_sweep

    name = verifier(tmp_path)
    raw = grpo_spec(str(tiny_model), str(tiny_data), f"python:{name}:score",
                    grid={"temperature": [0.7, 1.0]}, memory_budget_gb=1000.0)
    raw["fixed"]["segment_size"] = "auto"
    rows = run_sweep(parse_spec(raw), tmp_path / "sweep")
    assert [r["status"] for r in rows] == ["completed"] * 2, [r.get("reason") for r in rows]
    table = pq.read_table(tmp_path / "sweep" / "results.parquet").to_pylist()
    assert {r["param/temperature"] for r in table} == {0.7, 1.0}
    probed = json.loads((tmp_path / "sweep" / "probes.json").read_text())
    assert len(probed) == 1 and all(v > 0 for v in next(iter(probed.values())).values())
    assert {r["param/segment_size"] for r in table} == {0}  # the plain path fits 1000 GB
    assert all(0 <= r["best/val/reward"] <= 1 for r in table), table
    from tasks.board.plots import rewards_png  # the board's reward curves, from metrics.jsonl
    from tasks.board.results_table import read_results

    drawn = rewards_png(read_results(tmp_path / "sweep"), tmp_path / "plots" / "rewards.png")
    assert drawn is not None and drawn.read_bytes()[:4] == b"\x89PNG"
    pairs = tmp_path / "pair-run"
    pairs.mkdir()
    (pairs / "metrics.jsonl").write_text(json.dumps({"split": "train", "step": 1,
                                                     "loss": 0.7}) + "\n")
    assert rewards_png([{"trial_id": "p", "adapter": str(pairs)}], tmp_path / "n.png") is None
    assert all(r["skipped"] for r in run_sweep(parse_spec(raw), tmp_path / "sweep"))
    (tmp_path / f"{name}.py").write_text(VERIFIER.replace("isalpha", "isdigit"))
    again = run_sweep(parse_spec(raw), tmp_path / "sweep")
    assert [r["skipped"] for r in again] == [False, False]
    assert [r["status"] for r in again] == ["completed"] * 2, [r.get("reason") for r in again]


@pytest.mark.unit
def test_a_grpo_trial_whose_groups_all_tied_says_so() -> None:
    """A GRPO gradient is exactly 0 where every group's rewards tie: such a trial is not
    ranked, and says it had no signal (a saturated model's zero gradient still says it
    stopped learning)."""
    from tasks.eval.degenerate import degenerate_reason

    reports = [(1, 0.3), (2, 0.0), (3, 0.0)]
    assert degenerate_reason(reports, {}, frozenset({2, 3})).startswith(
        "degenerate: no signal: every group's rewards tied for 2 report(s) "
        "(frac_reward_zero_std 1.0 from step 2")
    assert "stopped learning" in degenerate_reason(reports, {}, frozenset({3}))
    assert degenerate_reason([(1, 0.0), (2, 0.2)], {}, frozenset({1})) == ""


@pytest.mark.integration
def test_a_grpo_adapter_is_evaluated_by_its_answers_and_the_default_pair_loss(
        tiny_model, tiny_data, tmp_path) -> None:
    """The pipeline's evaluation of a GRPO trial (and of the base beside it, under the
    first trial's loss): its pairs scored under ORPO's metrics, as ``pomona score`` does
    (loss grpo has no pair terms: it stopped the pipeline), its answers by the scorers."""
    from engine.model.adapters import pairs_scored_under
    from engine.settings.config import TrainConfig
    from engine.train.grpo_trainer import train_groups
    from tasks.eval.evaluate import evaluate_adapter
    from tasks.eval.generation_eval import parse_generation

    out = tmp_path / "grpo"
    train_groups(TrainConfig(model=str(tiny_model), data=str(tiny_data), out=str(out),
                             steps=2, batch_size=2, lora_rank=4, val_every=0).replace(
        loss="grpo", reward="task:sort", num_generations=2, max_completion_length=4))
    assert pairs_scored_under(out).loss.kind == "orpo"
    generation = parse_generation({"scorers": ["task:sort"], "prompts": 4, "max_tokens": 8})
    for adapter, loss in ((str(out), None), (None, pairs_scored_under(out))):
        metrics = evaluate_adapter(str(tiny_model), adapter, str(tiny_data), loss,
                                   generation=generation).metrics
        assert metrics["eval/valid/rows"] == 16 and 0 <= metrics["eval/valid/loss"] < 100
        assert 0 <= metrics["gen/valid/sort"] <= 1, metrics
