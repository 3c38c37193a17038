"""Issue 68's speed goal: `pomona bench grpo` runs a whole GRPO step of each trainer at toy
sizes and prints what docs/performance.md reads."""

from __future__ import annotations

import json

import pytest

from tests.test_bench import bench

pytestmark = pytest.mark.integration


def test_grpo_bench_times_a_whole_step_beside_mlx_lm_lora() -> None:
    """`pomona bench grpo`: the GRPO trainer's whole step (rollouts, reward, update) with
    the group-shared forward and without, and mlx-lm-lora's train_grpo on the same model
    and prompts, each row its timed steps, rollout time and the tokens it generated; and
    the memory probe's peak on the first row's settings."""
    out = bench("grpo", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                "--intermediate", "128", "--vocab", "512", "--prompt", "64", "--completion",
                "8", "--generations", "4", "--prompts", "2", "--warmup", "1", "--steps", "2",
                "--peer", "mlx-lm-lora", "--probe", "--json")
    shared, rows, probe, peer = out["rows"]
    assert (shared["name"], rows["name"]) == ("pomona", "pomona_rows")
    assert (shared["prefix_share_rate"], rows["prefix_share_rate"]) == (1, 0)
    for row in (shared, rows, peer):
        assert len(row["steps_s"]) == 2 and 0 < row["gen_s"] < row["step_s"], row
        assert 0 < row["completion_tokens"] <= 8 and row["peak_mb"] > 0
    assert peer["name"] == "mlx-lm-lora-grpo" and "rollouts" in peer["semantics"]
    assert probe["name"] == "probe" and probe["peak_mb"] == max(
        probe["rollout_peak_mb"], probe["update_peak_mb"]) > 0, probe
    assert set(out["ratios"]) == {"pomona_step_vs_pomona_rows",
                                  "pomona_step_vs_mlx-lm-lora-grpo"}
    assert out["ratios"]["pomona_step_vs_mlx-lm-lora-grpo"] == pytest.approx(
        shared["step_s"] / peer["step_s"])


def test_grpo_learn_scores_the_same_test_prompts_before_and_after(tmp_path) -> None:
    """`pomona bench grpo-learn` at toy size: the warm start and each seed's GRPO adapter
    score the same held-out prompts, with the paired test's counts."""
    out = bench("grpo-learn", "--rows", "200", "--sft-steps", "2", "--steps", "2",
                "--seeds", "0,1", "--work", str(tmp_path), "--json")
    assert [r["seed"] for r in out["rows"]] == [0, 1]
    for r in out["rows"]:
        assert r["prompts"] == out["rows"][0]["prompts"] > 10  # a tenth held out for test
        assert 0 <= r["start"] <= 1 and 0 <= r["end"] <= 1
        assert r["wins"] + r["losses"] <= r["prompts"] and 0 < r["p"] <= 1
    assert (tmp_path / "grpo-s1" / "adapters.safetensors").exists()


def test_the_grpo_benches_refuse_bad_arguments_in_one_line(tmp_path, capsys) -> None:
    """Seeds that are no integers, a count below what a step needs, a --work that holds
    someone's files (left as they were): exit 2, one line, before any model is made."""
    from benchmarks import grpo_bench, grpo_learning

    (tmp_path / "theirs.txt").write_text("keep me")
    cases = [(grpo_learning, ["--seeds", "0,a"], "--seeds '0,a': expected integers"),
             (grpo_learning, ["--seeds", "1,1"], "a seed twice"),
             (grpo_learning, ["--steps", "0"], "--steps 0: must be at least 1"),
             (grpo_learning, ["--work", str(tmp_path)], "not empty"),
             (grpo_bench, ["--generations", "1"], "--generations 1: must be at least 2"),
             (grpo_bench, ["--steps", "0"], "--steps 0: must be at least 1"),
             (grpo_bench, ["--segment-size", "-1"], "--segment-size -1: must be at least 0")]
    for module, args, message in cases:
        assert module.main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert [p.name for p in tmp_path.iterdir()] == ["theirs.txt"]
    assert (tmp_path / "theirs.txt").read_text() == "keep me"


def test_grpo_bench_quantize_makes_the_base_a_4_bit_one(tmp_path) -> None:
    """`--quantize 4`: the bench's base goes through mlx_lm.convert (QLoRA's), as a
    user's 4-bit model does."""
    from benchmarks.grpo_bench import model_and_prompts, parser

    a = parser().parse_args(["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads",
                             "2", "--intermediate", "128", "--vocab", "512", "--quantize", "4"])
    model, _ = model_and_prompts(a, tmp_path / "q4")
    assert json.loads((model / "config.json").read_text())["quantization"]["bits"] == 4
    plain, _ = model_and_prompts(parser().parse_args(["--layers", "2", "--hidden", "64"]),
                                 tmp_path / "plain")  # the default: --dtype's weights
    assert "quantization" not in json.loads((plain / "config.json").read_text())
