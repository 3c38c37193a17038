"""Issue 73, step 2: verifier-built pairs (engine/train/online_pairs.py). A pair loss with
``pairs: online`` samples G completions of each prompt from the policy as it trains and
trains on the best and the worst by reward; ties are skipped and counted; a resumed run
samples what the straight run did; each mistake is refused before step 1 in one line."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from engine.data.prompts import PromptRow
from engine.forward.rollouts import Rollouts
from engine.losses import Orpo
from engine.train.online_pairs import best_and_worst, sample_stats
from tasks.sweep.spec_file import parse_spec
from tasks.sweep.spec_rules import SpecError
from tests.test_grpo_train import assert_resumed_is_straight, pomona, records

DIGITS = "python:tests.grpo_rewards:digits"  # a random model's samples differ on it
DIGIT_VERIFIER = """
def score(prompt, completion, row):
    text = completion.replace(" ", "")
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0
"""


def online_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(model), "--data", str(data), "--out", str(out),
            "--loss", "orpo", "--pairs", "online", "--batch-size", "2",
            "--max-completion-length", "6", "--num-generations", "4", *extra]


@pytest.mark.unit
def test_each_prompt_pairs_its_best_and_worst_sample_and_a_tie_gives_none() -> None:
    """Group 0's best (0.9, the second drawn of two) is chosen and its worst rejected,
    each with its stop token; group 1's rewards tie: no pair; group 2's maximum is shared,
    and the first drawn of equals is taken."""
    rows = [PromptRow(f"p{i}", (1, 2, i), "", "") for i in range(3)]
    tokens = [[10], [11], [12, 13], [14], [20], [21], [22], [23], [30], [31], [32], [33]]
    stops = [2, None, 2, 2] * 3
    rewards = [0.1, 0.9, 0.5, 0.9, 0.3, 0.3, 0.3, 0.3, 1.0, 0.0, 1.0, 0.0]
    pairs = best_and_worst(rows, Rollouts(tokens, stops, 0, 0.0), rewards, 4, 7)
    assert [(p.id, list(p.chosen), list(p.rejected)) for p in pairs] == [
        ("p0@7", [11], [10, 2]), ("p2@7", [30, 2], [31])]
    assert sample_stats(rewards, 4)["frac_reward_zero_std"] == pytest.approx(1 / 3)


@pytest.mark.unit
def test_orpo_trains_on_its_own_samples_and_reports_them(tiny_model, parity,
                                                        tmp_path) -> None:
    """``pomona train --loss orpo --pairs online``: each record carries the samples'
    rewards (TRL's names) and the pairs made of them, every prompt a pair or a tie, and
    validation scores the data's fixed valid pairs; the adapter records how it trained."""
    import json

    code, lines = pomona(*online_args(tiny_model, parity, tmp_path / "run", "--reward",
                                      DIGITS, "--steps", "2", "--report-every", "1"))
    assert code == 0, lines
    train = records(tmp_path / "run")
    assert len(train) == 2
    for rec in train:
        assert {"reward", "reward_std", "frac_reward_zero_std", "rewards/digits/mean",
                "completions/mean_length", "loss", "log_odds_ratio"} <= set(rec), rec
        assert rec["online/pairs"] + rec["online/tied_prompts"] == 2 * (
            1 + rec["online/extra_draws"]) and rec["online/pairs"] >= 1
    valid = records(tmp_path / "run", "valid")
    assert [r["step"] for r in valid] == [0, 2] and valid[0]["val/rows"] == 8
    block = json.loads((tmp_path / "run" / "adapter_config.json").read_text())["pomona"]
    assert block["pairs"] == "online" and block["reward"] == [DIGITS]


@pytest.mark.unit
def test_dpo_takes_each_sampled_pairs_reference_as_it_is_made(tiny_model, parity,
                                                              tmp_path) -> None:
    """DPO on online pairs: each step's pairs get the reference's log-probs of those very
    completions. At step 1 the policy is the base (LoRA's B starts at 0) and so is the
    reference: every reward β·(logp − ref) is 0, up to float32 rounding; had the sampled
    pairs no reference, or another's, DPO would refuse or read nonzero margins."""
    code, lines = pomona(*online_args(tiny_model, parity, tmp_path / "dpo", "--loss", "dpo",
                                      "--reward", DIGITS, "--steps", "1",
                                      "--report-every", "1"))
    assert code == 0, lines
    [first] = records(tmp_path / "dpo")
    assert first["online/pairs"] >= 1
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(first[name]) < 1e-5, (name, first)
    assert first["loss"] == pytest.approx(0.6931, abs=1e-4)  # −log σ(0)


@pytest.mark.unit
def test_a_resumed_online_run_is_the_straight_run(tiny_model, parity, tmp_path) -> None:
    """Stopped at a checkpoint and resumed, a run samples the pairs the straight run did
    (each step's prompts and samples are the seed's and the step's) and ends with its
    adapter."""
    assert_resumed_is_straight(
        lambda out, *extra: online_args(tiny_model, parity, out, *extra), tmp_path)


@pytest.mark.unit
def test_a_resume_keeps_its_pairs_fixed_or_online(tiny_model, parity, tmp_path) -> None:
    """A checkpoint of online pairs resumed on fixed ones (which record no ``pairs``) is
    refused in one line, as any other setting that alters the run is."""
    common = ("--steps", "2", "--checkpoint-every", "2", "--val-every", "0")
    assert pomona(*online_args(tiny_model, parity, tmp_path / "r", "--reward", DIGITS,
                               *common))[0] == 0
    code, lines = pomona("train", "--model", str(tiny_model), "--data", str(parity), "--out",
                         str(tmp_path / "r"), "--loss", "orpo", "--batch-size", "2",
                         "--steps", "4", "--checkpoint-every", "2", "--val-every", "0",
                         "--resume", "auto")
    assert code == 2 and "pairs was 'online' there, 'fixed' now" in lines[-1], lines


@pytest.mark.unit
def test_online_pairs_mistakes_are_refused_in_one_line(tiny_model, parity, tmp_path) -> None:
    """No reward; online pairs on a loss that has none (KTO: its KL partners are fixed
    pairs'); a sampling setting with fixed pairs; and a step whose every sample ties (the
    random model never answers parity right: every reward 0): one line, naming the step,
    nothing trained."""
    cases = [
        ((), "loss orpo learns from a reward: give one"),
        (("--loss", "kto", "--reward", DIGITS),
         "a setting of loss grpo, and of orpo, simpo, dpo, cpo with pairs: online; this "
         "run's loss is kto"),
        (("--reward", "task:parity", "--steps", "2"), "step 1: every prompt's 4 samples "
                                                      "were rewarded alike in 4 draws"),
    ]
    for i, (extra, message) in enumerate(cases):
        code, lines = pomona(*online_args(tiny_model, parity, tmp_path / f"r{i}", *extra))
        errors = [x for x in lines if x.startswith("error:")]
        assert code == 2 and len(errors) == 1 and message in errors[0], (extra, lines)
    code, lines = pomona("train", "--model", str(tiny_model), "--data", str(parity), "--out",
                         str(tmp_path / "f"), "--loss", "simpo", "--num-generations", "4")
    assert code == 2 and lines == [
        "error: num_generations: read by loss grpo, or by loss simpo with pairs: online "
        "(this run's pairs are fixed); give --pairs online or drop num_generations"], lines


def online_spec(model: str, data: str, reward: str, **top) -> dict:
    return {"name": "o", "model": model, "data": data, "max_concurrent": 2,
            "fixed": {"loss": "orpo", "reward": reward, "steps": 2, "batch_size": 2,
                      "num_generations": 4, "max_completion_length": 4, "lora_rank": 4,
                      "val_every": 0},
            "grid": {"pairs": ["fixed", "online"]}, **top}


@pytest.mark.unit
def test_a_sweep_sets_fixed_pairs_beside_online_ones_and_keys_the_reward(tmp_path) -> None:
    """``grid: {pairs: [fixed, online]}``: the fixed trial reads no sampling setting (its
    config and key are a fixed run's), the online one does, and only its key holds the
    reward module's bytes; packs, gangs, an auto setting and no reward are refused."""
    from tasks.sweep.sweep_plan import cache_key
    from tests.test_grpo_sweep import VERIFIER, verifier

    name = verifier(tmp_path)
    spec = parse_spec(online_spec("m", "d", f"python:{name}:score"))
    plans = {p.config.loss.pairs: p.config for p in
             (spec.plan(x, tmp_path / "o") for x in spec.listing())}
    assert (spec.metric, spec.mode) == ("val/loss", "min")
    assert "reward" not in plans["fixed"].to_dict() and plans["fixed"].loss == Orpo()
    assert plans["online"].loss.reward == (f"python:{name}:score",)
    keys = {k: cache_key(c, "data", "model") for k, c in plans.items()}
    (tmp_path / f"{name}.py").write_text(VERIFIER.replace("isalpha", "isdigit"))
    assert cache_key(plans["fixed"], "data", "model") == keys["fixed"]
    assert cache_key(plans["online"], "data", "model") != keys["online"]
    base = online_spec("m", "d", "task:sort")
    cases = [({"pack": 2}, "pack: 2: pairs: online trains one trial to a process"),
             ({"ranks_per_trial": 2}, "ranks_per_trial: 2: pairs: online trains on one rank"),
             ({"fixed": {**base["fixed"], "segment_size": "auto"}, "memory_budget_gb": 8},
              "segment_size: auto with pairs: online"),
             ({"fixed": {k: v for k, v in base["fixed"].items() if k != "reward"}},
              "pairs: online learns from a reward: give fixed.reward"),
             ({"grid": {"orpo_lambda": [0.1, 1.0]}},  # no trial samples: reward unread
              "fixed.num_generations: read by loss grpo or by pairs: online, and no trial")]
    for change, message in cases:
        with pytest.raises(SpecError, match=r"^[^\n]*$") as err:
            parse_spec({**base, **change})
        assert message in str(err.value), (change, err.value)


@pytest.mark.integration
def test_fixed_and_online_pairs_train_side_by_side_on_ray(ray_cluster, tiny_model, parity,
                                                          tmp_path) -> None:
    """Both trials complete on Ray's workers, the online one rewarded by a module only the
    driver's path holds (sent by content), each ranked on ``best/val/loss``."""
    from tasks.sweep.run import run_sweep
    from tests.test_grpo_sweep import verifier

    name = verifier(tmp_path, DIGIT_VERIFIER)
    rows = run_sweep(parse_spec(online_spec(str(tiny_model), str(parity),
                                            f"python:{name}:score")), tmp_path / "sweep")
    assert [r["status"] for r in rows] == ["completed"] * 2, [r.get("reason") for r in rows]
    table = pq.read_table(tmp_path / "sweep" / "results.parquet").to_pylist()
    # a fixed trial's columns are a fixed run's, as its key is: no pairs, no sampling
    assert {(r["param/pairs"], r["param/num_generations"]) for r in table} == {
        (None, None), ("online", 4)}
    assert all(r["best/val/loss"] > 0 for r in table), table
