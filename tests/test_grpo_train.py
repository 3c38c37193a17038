"""Issue 68, step 2: ``pomona train --loss grpo`` (and ``python -m engine train``) on the
plain forward. A tiny random model learns from a verifier alone, metrics.jsonl carries
TRL's names, a resumed run is the straight run, and each mistake is refused before step
1 in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli.main import app

ROOT = Path(__file__).resolve().parents[1]
TRL_NAMES = {"reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
             "completions/clipped_ratio", "clip_ratio/region_mean", "clip_ratio/low_mean",
             "clip_ratio/high_mean", "loss", "grad_norm", "learning_rate", "tokens_per_sec",
             "rollout_tokens_per_sec"}


def pomona(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(app, list(args), env={"RAY_ADDRESS": "", "PREFECT_API_URL": ""})
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output, result.output
    return result.exit_code, [x for x in result.output.splitlines() if x.strip()]


def records(out: Path, split: str = "train") -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


def grpo_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(model), "--data", str(data), "--out", str(out),
            "--loss", "grpo", "--batch-size", "2", "--max-completion-length", "6",
            "--num-generations", "4", *extra]


@pytest.mark.unit
def test_the_demo_command_trains_and_reports_trls_names(tiny_model, parity, tmp_path) -> None:
    """The issue's command on the demo's task: an mlx-lm adapter recording its loss and
    reward, every TRL name in metrics.jsonl, validation rewarded."""
    from engine.model.load import load_model

    code, lines = pomona(*grpo_args(tiny_model, parity, tmp_path / "run", "--reward",
                                    "task:parity", "--steps", "2", "--report-every", "1"))
    assert code == 0, lines
    train = records(tmp_path / "run")
    own = {"rewards/parity/mean", "dynamic_sampling/replaced_groups"}  # dapo's, by default
    assert len(train) == 2 and TRL_NAMES | own <= set(train[0]), train[0]
    assert "kl" not in train[0]  # β = 0: no reference pass
    phases = json.loads((tmp_path / "run" / "summary.json").read_text())["phases"]
    assert set(phases) == {"set_up", "load_check", "first_step", "steps", "finish"}, phases
    assert phases["first_step"] <= phases["steps"]  # GRPO's: its updates; rollouts apart
    valid = records(tmp_path / "run", "valid")
    assert [r["step"] for r in valid] == [0, 2] and valid[0]["val/rows"] == 8
    block = json.loads((tmp_path / "run" / "adapter_config.json").read_text())["pomona"]
    assert block["loss"] == "grpo" and block["reward"] == ["task:parity"]
    load_model(str(tiny_model), str(tmp_path / "run"))  # mlx-lm's adapter, whole
    code, lines = pomona("score", "--model", str(tiny_model), "--adapter", str(tmp_path / "run"),
                         "--data", str(parity), "--out", str(tmp_path / "s.jsonl"))
    assert code == 0 and "which scores no pairs: its metrics are loss orpo's" in lines[0], lines
    code, lines = pomona("score", "--model", str(tiny_model), "--data", str(parity), "--out",
                         str(tmp_path / "t.jsonl"), "--loss", "grpo")
    assert code == 2 and lines == ["error: --loss grpo: expected one of orpo, simpo, sft, dpo, "
                                     "cpo, kto"], lines


def test_a_random_model_learns_from_a_verifier_alone(tiny_model, parity, tmp_path) -> None:
    """``python -m engine train`` (no Prefect, no Ray) with a ``python:`` verifier the
    random model's completions differ on: the mean reward of the last 10 steps beats the
    first 10's by 0.15 on each of two seeds, with β > 0 (the KL reported) and μ = 2.
    40 steps: seed 1 sits near 0.2 for 20 steps before it climbs, and at 30 steps CI's CPU
    saw it rise only 0.13. Measured 2026-12-07 on this 2-core CPU, seeds 0-3 at 40 steps:
    rises of 0.44-0.74 on 1 BLAS thread and 0.43-0.75 on 2 (seed 1: 0.17 → 0.79 and 0.67).
    At G = 4 the advantages are noisier, and one seed of three rose only 0.1."""
    for seed in (0, 1):
        out = tmp_path / f"s{seed}"
        args = grpo_args(tiny_model, parity, out, "--reward", "python:tests.grpo_rewards:digits",
                         "--steps", "40", "--batch-size", "4", "--num-generations", "8",
                         "--report-every", "1", "--val-every", "0", "--learning-rate", "2e-2",
                         "--lr-schedule",
                         "constant", "--seed", str(seed), "--grpo-beta", "0.01",
                         "--grpo-num-iterations", "2")[1:]
        proc = subprocess.run([sys.executable, "-m", "engine", "train", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-2000:]
        rewards = [r["reward"] for r in records(out)]
        assert np.mean(rewards[-10:]) > np.mean(rewards[:10]) + 0.15, rewards
        assert all(r["kl"] >= 0 for r in records(out))


@pytest.mark.unit
def test_a_resumed_run_is_the_straight_run(tiny_model, parity, tmp_path) -> None:
    """Stopped at a checkpoint and resumed, a run samples the same rollouts and ends
    with the straight run's adapter (the rollouts' seed is the run's and the step's), at
    μ = 2 (a cycle of rollouts serves two steps)."""
    assert_resumed_is_straight(lambda out, *extra: grpo_args(tiny_model, parity, out, *extra),
                               tmp_path, "--grpo-num-iterations", "2")


def assert_resumed_is_straight(args, tmp_path: Path, *extra: str) -> None:
    """4 steps straight, and 2 then resumed to 4 from the step-2 checkpoint (``args(out,
    *flags)``: a run's command line): the same adapter and the same last reward."""
    import mlx.core as mx

    common = ("--reward", "python:tests.grpo_rewards:digits", "--learning-rate", "1e-2",
              "--lr-schedule", "constant", "--checkpoint-every", "2", "--val-every", "0",
              "--report-every", "1", *extra)
    assert pomona(*args(tmp_path / "a", *common, "--steps", "4"))[0] == 0
    assert pomona(*args(tmp_path / "b", *common, "--steps", "2"))[0] == 0
    code, lines = pomona(*args(tmp_path / "b", *common, "--steps", "4", "--resume", "auto"))
    assert code == 0, lines
    a = mx.load(str(tmp_path / "a" / "adapters.safetensors"))
    b = mx.load(str(tmp_path / "b" / "adapters.safetensors"))
    assert all(mx.allclose(a[k], b[k], rtol=1e-5, atol=1e-7).item() for k in a)
    assert records(tmp_path / "a")[-1]["reward"] == records(tmp_path / "b")[-1]["reward"]


@pytest.mark.unit
def test_grpo_mistakes_are_refused_before_step_1_in_one_line(tiny_model, parity,
                                                             tmp_path) -> None:
    """No reward, a scorer that does not exist, a weight per scorer missing, a verifier
    that fails on the data (tried before step 1, naming it and the row), and GRPO's
    settings handed to a pair loss: each exits 2 in one line (the verifier's once the model
has loaded, after its load check's lines), and no run is written: a folder it claimed,
    nothing in it but the mark, is gone again."""
    cases = {("--steps", "1"): "loss grpo learns from a reward: give one",
             ("--reward", "nonesuch"): "scorer 'nonesuch': expected exact, contains",
             ("--reward", "contains", "--reward", "exact", "--reward-weights", "1"):
                 "reward_weights=[1.0]: one weight per reward scorer",
             ("--reward", "python:tests.grpo_rewards:broken"):
                 "scorer python:tests.grpo_rewards:broken: row "}
    for i, (extra, message) in enumerate(cases.items()):
        code, lines = pomona(*grpo_args(tiny_model, parity, tmp_path / f"r{i}", *extra))
        errors = [x for x in lines if not x.startswith("load check")]  # the model's, said
        assert code == 2 and len(errors) == 1 and message in errors[0], (extra, lines)
        assert not (tmp_path / f"r{i}").exists(), (extra, list((tmp_path / f"r{i}").iterdir()))
    code, lines = pomona(*grpo_args(tiny_model, parity, tmp_path / "best", "--reward",
                                    "task:parity", "--best-metric", "val/accuracy"))
    assert code == 2 and "best_metric='val/accuracy': loss grpo reports" in lines[-1], lines
    code, lines = pomona(*grpo_args(tiny_model, parity, tmp_path / "few", "--reward",
                                    "task:parity", "--batch-size", "40"))
    assert code == 2 and "32 train prompts, fewer than one step's 40" in lines[-1], lines
    assert not (tmp_path / "best").exists() and not (tmp_path / "few").exists()
    code, lines = pomona("train", "--model", str(tiny_model), "--data", str(parity), "--out",
                         str(tmp_path / "pair"), "--loss", "orpo", "--reward", "task:parity")
    assert code == 2 and lines == [
        "error: reward: read by loss grpo, or by loss orpo with pairs: online (this run's "
        "pairs are fixed); give --pairs online or drop reward"], lines


@pytest.mark.unit
def test_dapo_samples_a_flat_group_again_until_its_rewards_differ(tiny_model, parity) -> None:
    """DAPO's dynamic sampling on the real model and verifier: every group whose G rewards
    were equal is drawn again, a new draw kept only where its rewards differ; the groups
    that had signal keep their completions."""
    from engine.data.prompts import prompts_for
    from engine.settings.config import TrainConfig
    from engine.train.group_steps import Sampler, flat_groups, resample_flat, rewarded
    from engine.train.prepared import prepare_training
    from engine.train.reward_source import load_reward

    cfg = TrainConfig(model=str(tiny_model), data=str(parity)).replace(
        loss="grpo", reward="python:tests.grpo_rewards:digits", num_generations=2,
        max_completion_length=3, grpo_max_resample_rounds=4)
    prep = prepare_training(cfg)
    prompts = prompts_for(cfg.data, cfg.model, prep.stack, prep.tokenizer).train[:16]
    reward = load_reward(cfg.loss)
    sampler = Sampler(prep.model, prep.tokenizer, cfg.loss, reward, 8)
    first, first_rewards, _ = rewarded(sampler, prompts, 7)
    rollouts, rewards, replaced = resample_flat(sampler, prompts, 7, (first, first_rewards))
    before, after = flat_groups(first_rewards, 2), flat_groups(rewards, 2)
    assert before and replaced == len(before) - len(after) > 0 and set(after) <= set(before)
    for i in set(range(16)) - set(before):
        assert rollouts.tokens[2 * i: 2 * i + 2] == first.tokens[2 * i: 2 * i + 2]
    texts = [prep.tokenizer.decode(t, skip_special_tokens=True) for t in rollouts.tokens]
    rows = [p for p in prompts for _ in range(2)]
    again, _ = reward([p.prompt_text for p in rows], texts, [p.row() for p in rows])
    assert again == rewards  # each kept completion with its own reward
    for i in set(before) - set(after):  # a replaced group: new completions, rewards apart
        assert rewards[2 * i] != rewards[2 * i + 1]
        assert rollouts.tokens[2 * i: 2 * i + 2] != first.tokens[2 * i: 2 * i + 2]


@pytest.mark.unit
def test_the_group_shared_update_trains_what_the_plain_one_trains(tiny_model, parity,
                                                                   tmp_path) -> None:
    """``--prefix-share on`` (one row a group), ``off`` (a row a completion) and ``on``
    through the staged backward (segments of 1, a head of 16 rows) take the same first
    update on the same rollouts: its reward, loss and gradient norm (1e-5
    relative; Adam's sign-like first step would turn a 1e-7 gradient into a whole
    learning rate, so the adapters are not compared), and ``auto`` shares only where the
    prompt outweighs the completions (shares_group)."""
    from engine.forward.group_layout import shares_group

    first = {}
    for name, levers in (("on", ()), ("off", ()), ("staged", ("--segment-size", "1",
                                                               "--head-chunk", "16"))):
        out = tmp_path / name
        share = "off" if name == "off" else "on"
        code, lines = pomona(*grpo_args(tiny_model, parity, out, "--reward",
                                        "python:tests.grpo_rewards:digits", "--steps", "1",
                                        "--val-every", "0", "--grpo-beta", "0.04",
                                        "--grad-accum", "2", "--prefix-share", share, *levers))
        assert code == 0, lines
        first[name] = records(out)[0]
        assert first[name]["prefix_share_rate"] == float(share == "on")
    off = first["off"]
    for on in (first["on"], first["staged"]):
        assert on["reward"] == off["reward"] and on["grad_norm"] > 0
        for name in ("grad_norm", "kl"):
            assert on[name] == pytest.approx(off[name], rel=1e-5), name
        assert on["loss"] == pytest.approx(off["loss"], rel=1e-5, abs=1e-7)
    assert shares_group([512], [128] * 8, "auto") and not shares_group([32], [128] * 8, "auto")
    assert shares_group([32], [128] * 8, "on") and not shares_group([512], [128] * 8, "off")


@pytest.mark.unit
def test_auto_shares_a_group_on_cuda_by_the_same_token_rule(monkeypatch) -> None:
    """On CUDA, ``auto`` takes the group layout by the token rule as on CPU (measured on an
    H100: fed 0.30 of the rows' tokens gave 0.57× their update, 0.56 gave 1.2×)."""
    import mlx.core as mx

    from engine.forward.group_layout import shares_group
    from engine.forward.layout_policy import is_cuda

    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    is_cuda.cache_clear()  # it caches the device: the pretended one must not outlive this
    try:
        assert is_cuda()
        assert shares_group([512], [128] * 8, "auto")
        assert not shares_group([128], [128] * 8, "auto")
    finally:
        is_cuda.cache_clear()


@pytest.mark.unit
def test_an_adapter_as_the_kl_reference(tiny_model, parity, tmp_path) -> None:
    """``--reference DIR`` with β > 0: a run warm-started from DIR begins at KL 0 (the
    policy is its reference) where against the base it does not, the policy's own LoRA is
    back after each reference pass (the update moved it), and a reference of another LoRA
    rank is refused before step 1 in one line."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engine.settings.config import TrainConfig
    from engine.settings.reference_kind import AdapterRef
    from engine.train.group_reference import kl_reference
    from engine.train.prepared import prepare_training

    common = ("--reward", "python:tests.grpo_rewards:digits", "--val-every", "0",
              "--report-every", "1", "--grpo-beta", "0.04")
    start = tmp_path / "start"
    code, lines = pomona(*grpo_args(tiny_model, parity, start, *common, "--steps", "2",
                                    "--learning-rate", "1e-2"))
    assert code == 0, lines
    kl = {}
    for name, reference in (("self", str(start)), ("base", "base")):
        code, lines = pomona(*grpo_args(tiny_model, parity, tmp_path / name, *common,
                                        "--steps", "2", "--warm-start", str(start),
                                        "--reference", reference, "--learning-rate", "1e-2"))
        assert code == 0, lines
        kl[name] = [r["kl"] for r in records(tmp_path / name)]
    assert kl["self"][0] == pytest.approx(0.0, abs=1e-6) and kl["self"][1] > 0
    assert kl["base"][0] > 1e-3
    prep = prepare_training(TrainConfig(model=str(tiny_model), data=str(parity)).replace(
        loss="grpo", reward="python:tests.grpo_rewards:digits"))
    model, worn = prep.model, mx.load(str(start / "adapters.safetensors"))
    own = dict(tree_flatten(model.trainable_parameters()))
    model.train()
    with kl_reference(AdapterRef(str(start)), model, str(tiny_model)).worn(model):
        inside = dict(tree_flatten(model.trainable_parameters()))
        assert all(mx.array_equal(inside[k], worn[k]).item() for k in worn)
        assert not model.training
        assert any(not mx.array_equal(inside[k], own[k]).item() for k in own)
    after = dict(tree_flatten(model.trainable_parameters()))
    assert model.training and all(after[k] is own[k] for k in own)
    code, lines = pomona(*grpo_args(tiny_model, parity, tmp_path / "nowhere", *common,
                                    "--reference", str(tmp_path / "nonesuch")))
    errors = [x for x in lines if not x.startswith("load check")]
    assert code == 2 and errors == [f"error: reference adapter {tmp_path / 'nonesuch'}: no "
                                    "such directory (give an adapter folder, or base)"], lines
    code, lines = pomona(*grpo_args(tiny_model, parity, tmp_path / "misfit", *common,
                                    "--reference", str(start), "--lora-rank", "2"))
    errors = [x for x in lines if not x.startswith("load check")]
    assert code == 2 and len(errors) == 1, lines
    assert f"reference adapter {start}: " in errors[0] and "--lora-rank" in errors[0], errors
    assert not (tmp_path / "misfit" / "adapters.safetensors").exists()


@pytest.mark.unit
def test_each_micro_batch_draws_its_own_dropout_masks(tiny_model, parity, tmp_path,
                                                      monkeypatch) -> None:
    """With LoRA dropout, every micro-batch of every step is seeded as the pair trainer
    seeds it (``micro_seed``), so no two draw the same masks."""
    from engine.model.load import micro_seed
    from engine.train import grpo_trainer

    seeds: list[int] = []
    real = grpo_trainer.set_dropout_seed
    monkeypatch.setattr(grpo_trainer, "set_dropout_seed",
                        lambda model, seed: seeds.append(seed) or real(model, seed))
    code, lines = pomona(*grpo_args(tiny_model, parity, tmp_path / "d", "--reward",
                                    "python:tests.grpo_rewards:digits", "--steps", "2",
                                    "--val-every", "0", "--grad-accum", "2",
                                    "--lora-dropout", "0.1", "--seed", "3"))
    assert code == 0, lines
    assert seeds == [micro_seed(3, step, i) for step in (1, 2) for i in (0, 1)]
