"""The training loop: accumulation, resume, determinism, adapters mlx-lm accepts, CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from engine.data.batch import Pair
from engine.data.pairs import load_pairs, write_pairs_jsonl
from engine.model.adapters import ADAPTER_FILE, CONFIG_FILE
from engine.settings.config import TrainConfig
from engine.train.trainer import train

pytestmark = [pytest.mark.integration, pytest.mark.long]  # conftest.py: scheduled first


def cfg(model: Path, data: Path, out: Path, **kw) -> TrainConfig:
    base = dict(model=str(model), data=str(data), out=str(out), steps=4, batch_size=4,
                learning_rate=1e-3, lora_rank=4, lora_scale=2.0, report_every=1, val_every=0)
    return TrainConfig().replace(**{**base, **kw})


def adapters(out: Path) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in mx.load(str(out / ADAPTER_FILE)).items()}


def losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["split"] == "train"]


def assert_phases(result) -> None:
    """Where a run's seconds went (engine/train/run_parts.py's PHASES): each phase, none
    negative, the load check within the set-up, the first step within the steps, all within
    the run, as summary.json says too."""
    from engine.train.run_parts import PHASES

    phases = result.phases
    assert tuple(phases) == PHASES and min(phases.values()) >= 0, phases
    assert phases["load_check"] <= phases["set_up"] and phases["first_step"] <= phases["steps"]
    assert phases["set_up"] + phases["steps"] + phases["finish"] <= result.seconds
    assert json.loads((Path(result.out) / "summary.json").read_text())["phases"] == phases


def test_two_identical_runs_give_identical_adapters(tiny_model, tiny_data, tmp_path) -> None:
    assert_phases(train(cfg(tiny_model, tiny_data, tmp_path / "a", lora_dropout=0.1)))
    train(cfg(tiny_model, tiny_data, tmp_path / "b", lora_dropout=0.1))
    a, b = adapters(tmp_path / "a"), adapters(tmp_path / "b")
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    c = adapters(tmp_path / "c") if train(cfg(tiny_model, tiny_data, tmp_path / "c",
                                              seed=1, lora_dropout=0.1)) else None
    assert any(not np.array_equal(a[k], c[k]) for k in a)


def test_accumulation_4x1_equals_1x4(tiny_model, tiny_data) -> None:
    """Four micro-batches of one pair give the one-batch-of-four loss and gradients."""
    from engine.backward.step import step_grads
    from engine.data.batch import make_batch
    from engine.losses import spec_of
    from engine.model.arch import make_stack
    from engine.model.load import LoraSpec, attach_lora, lora_modules
    from tests.parity import assert_same

    model, _ = mlx_lm.load(str(tiny_model))
    attach_lora(model, LoraSpec(rank=4, scale=2.0), seed=0)
    for _, m in lora_modules(model):
        m.lora_b = mx.ones_like(m.lora_b) * 0.01
    stack = make_stack(model)
    pairs = load_pairs(tiny_data).train[:4]
    spec = spec_of("orpo", "full", orpo_lambda=0.1)
    for k in (0, 2):
        c = TrainConfig(model="m", data="d", segment_size=k)
        one = step_grads(model, stack, [make_batch(pairs, "full")], spec, c, step=1)
        four = step_grads(model, stack, [make_batch([p], "full") for p in pairs], spec, c, 1)
        assert one[1]["pairs"] == four[1]["pairs"] == 4
        assert_same((mx.array(four[0]), {}, four[2]), (mx.array(one[0]), {}, one[2]))
        for key in ("nll_sum", "rewards/accuracies", "log_odds_ratio"):
            assert four[1][key] == pytest.approx(one[1][key], rel=1e-5)


def test_resume_reproduces_uninterrupted_run(tiny_model, tiny_data, tmp_path) -> None:
    full = cfg(tiny_model, tiny_data, tmp_path / "full", steps=6, warmup_steps=2)
    train(full)
    part = full.replace(out=str(tmp_path / "part"), steps=6, checkpoint_every=3)
    # Run 3 steps, "crash", resume from the step-3 checkpoint to 6.
    train(part.replace(steps=3))
    ckpt = tmp_path / "part" / "checkpoints" / "step_0000003"
    assert (ckpt / "optimizer.safetensors").exists() and (ckpt / ADAPTER_FILE).exists()
    train(part.replace(resume="auto"))
    assert losses(tmp_path / "part") == pytest.approx(losses(tmp_path / "full"), rel=1e-6)
    a, b = adapters(tmp_path / "full"), adapters(tmp_path / "part")
    assert all(np.allclose(a[k], b[k], rtol=1e-6, atol=1e-8) for k in a)


def test_adapter_loads_in_mlx_lm_with_matching_logits(tiny_model, tiny_data, tmp_path) -> None:
    from engine.model.adapters import load_adapter_weights
    from engine.model.load import LoraSpec, attach_lora

    out = tmp_path / "run"
    train(cfg(tiny_model, tiny_data, out, segment_size=1, head_chunk=16))
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["fine_tune_type"] == "lora" and config["num_layers"] == 4
    assert set(config["lora_parameters"]) >= {"rank", "scale", "dropout"}
    theirs, tokenizer = mlx_lm.load(str(tiny_model), adapter_path=str(out))
    ours, _ = mlx_lm.load(str(tiny_model))
    attach_lora(ours, LoraSpec(rank=4, scale=2.0), seed=123)
    load_adapter_weights(ours, out)
    tokens = mx.array([tokenizer.encode("Sort these numbers in ascending order: 5 3 9")])
    a, b = theirs(tokens), ours(tokens)
    assert float(mx.abs(a - b).max()) <= 1e-5
    base, _ = mlx_lm.load(str(tiny_model))
    assert float(mx.abs(base(tokens) - a).max()) > 1e-4  # the adapter changed something
    # mlx-lm's own generation with the adapter: the greedy tokens our model picks.
    prompt = tokenizer.encode("Sort: 3 1 2")
    got = [r.token for r in mlx_lm.stream_generate(theirs, tokenizer, prompt, max_tokens=4)]
    seq = list(prompt)
    for _ in range(4):
        nxt = int(mx.argmax(ours(mx.array([seq]))[0, -1]))
        if nxt in tokenizer.eos_token_ids:
            break
        seq.append(nxt)
    assert got == seq[len(prompt):], (got, seq[len(prompt):])
    fused = tmp_path / "fused"
    proc = subprocess.run([sys.executable, "-m", "mlx_lm", "fuse", "--model", str(tiny_model),
                           "--adapter-path", str(out), "--save-path", str(fused)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    fused_model, _ = mlx_lm.load(str(fused))
    assert float(mx.abs(fused_model(tokens) - a).max()) <= 1e-4


def test_warm_start_continues_from_an_adapter(tiny_model, tiny_data, tmp_path) -> None:
    first = train(cfg(tiny_model, tiny_data, tmp_path / "first", steps=3))
    warm = cfg(tiny_model, tiny_data, tmp_path / "warm", steps=1, learning_rate=1e-12,
               warm_start=str(tmp_path / "first"))
    train(warm)
    a, b = adapters(tmp_path / "first"), adapters(tmp_path / "warm")
    assert all(np.allclose(a[k], b[k], atol=1e-9) for k in a)  # ~zero lr: weights carried
    assert first.steps == 3
    with pytest.raises(ValueError, match="does not fit"):
        train(warm.replace(out=str(tmp_path / "bad"), lora_rank=8))


def test_segment_memory_log(tiny_model, tiny_data, tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "train", "--model", str(tiny_model), "--data",
         str(tiny_data), "--out", str(tmp_path / "m"), "--steps", "1", "--segment-size", "2"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "POMONA_SEG_MEM_LOG": "1"})
    assert proc.returncode == 0, proc.stderr
    phases = [line.split(":")[0] for line in proc.stderr.splitlines() if "[seg-mem]" in line]
    assert phases == ["[seg-mem] embed", "[seg-mem] forward 0-2", "[seg-mem] forward 2-4",
                      "[seg-mem] head", "[seg-mem] backward 2-4", "[seg-mem] backward 0-2"]


def test_verify_passes_for_segmented_path(tiny_model, tiny_data, tmp_path,
                                          monkeypatch) -> None:
    """``--verify`` compares the configured path with the plain one, and stops a run whose
    segmented gradients are off (here: doubled by a broken backward)."""
    import engine.check.load_check as load_check
    from engine.check.load_check import VerifyFailed

    run = cfg(tiny_model, tiny_data, tmp_path / "v", steps=1, verify=True, segment_size=3,
              head_chunk=8)
    figures = train(run).verified
    assert figures["arrays"] > 0 and figures["pairs"] > 0
    assert figures["grad_rel_err"] <= figures["tolerance"] and figures["loss_rel_err"] <= 1e-5
    right = load_check.value_and_grad

    def doubled(model, stack, batch, fn, *levers):  # the configured path only
        loss, sums, grads = right(model, stack, batch, fn, *levers)
        return loss, sums, grads if not levers else {k: 2 * g for k, g in grads.items()}

    monkeypatch.setattr(load_check, "value_and_grad", doubled)
    with pytest.raises(VerifyFailed, match="grad rel err"):
        train(run.replace(out=str(tmp_path / "broken")))


def test_empty_responses_are_counted_not_trained(tiny_model, tmp_path) -> None:
    # 1 bad row of 31: under the 5% a load allows (engine/data/pairs.py: MAX_BAD_FRACTION)
    pairs = [Pair(f"p{i}", [1, 20, 30], [40, 4], [41, 4]) for i in range(30)]
    pairs += [Pair("empty", [1, 20], [], [41, 4])]
    data = write_pairs_jsonl(pairs, tmp_path / "d.jsonl", split="train")
    result = train(cfg(tiny_model, data, tmp_path / "r", steps=2, batch_size=3))
    assert result.rejected_rows == {"empty chosen response": 1}
    assert np.isfinite(result.final["loss"])


def test_config_yaml_then_cli_precedence(tmp_path) -> None:
    from engine.cli import config_from_args

    y = tmp_path / "c.yaml"
    y.write_text("steps: 7\nlearning_rate: 0.01\nlora_keys: [self_attn.q_proj]\n")
    c = config_from_args(["--config", str(y), "--steps", "9", "--model", "m", "--data", "d"])
    assert (c.steps, c.learning_rate, c.lora_keys, c.model) == (9, 0.01, ("self_attn.q_proj",), "m")
    y.write_text("stepz: 3\n")
    with pytest.raises(ValueError, match="stepz"):
        config_from_args(["--config", str(y)])
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(model="m", data="d", batch_size=0).validate()


def test_python_m_engine_train_and_score(tiny_model, tiny_data, tmp_path) -> None:
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "train", "--model", str(tiny_model), "--data",
         str(tiny_data), "--out", str(out), "--steps", "2", "--batch-size", "2",
         "--segment-size", "2", "--head-chunk", "32", "--report-every", "1"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "step 2/2 loss " in proc.stderr, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["trainable_params"] > 0
    scores = tmp_path / "scores.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "score", "--model", str(tiny_model), "--adapter",
         str(out), "--data", str(tiny_data), "--out", str(scores), "--split", "valid"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in scores.read_text().splitlines()]
    assert len(rows) == 16
    assert set(rows[0]) == {"id", "chosen_logp_mean", "rejected_logp_mean", "nll", "loss",
                            "log_odds_ratio", "log_odds_chosen"}
    simpo = tmp_path / "simpo.jsonl"  # another loss than the adapter's, asked for by name
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "score", "--model", str(tiny_model), "--adapter",
         str(out), "--data", str(tiny_data), "--out", str(simpo), "--split", "valid",
         "--loss", "simpo", "--simpo-beta", "3", "--simpo-gamma", "0.5"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for r in (json.loads(x) for x in simpo.read_text().splitlines()):
        margin = 3 * (r["chosen_logp_mean"] - r["rejected_logp_mean"]) - 0.5
        assert set(r) == {"id", "chosen_logp_mean", "rejected_logp_mean", "nll", "loss"}
        assert r["loss"] == pytest.approx(math.log1p(math.exp(-margin)), rel=1e-4, abs=1e-6)
    bad = subprocess.run([sys.executable, "-m", "engine", "train", "--model", str(tiny_model),
                          "--data", str(tmp_path / "missing.jsonl"), "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "missing.jsonl" in bad.stderr
    typo = subprocess.run([sys.executable, "-m", "engine", "score", "--model",
                           "models/no-such-model", "--data", str(tiny_data), "--out",
                           str(scores)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=tmp_path)
    assert typo.returncode == 2, typo.stderr
    assert "'models/no-such-model': no such directory here" in typo.stderr  # not a hub error


@pytest.mark.unit
def test_a_missing_model_directory_is_named(tmp_path, monkeypatch) -> None:
    from engine.model.load import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in (str(tmp_path / "nope"), "./nope", "~/no-such-pomona-model"):
        with pytest.raises(FileNotFoundError, match=r"model not found: .*no such directory"):
            load_model(name)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"'org/typo': no such directory here .*"
                                                r"as a Hugging Face repo id"):
        load_model("org/typo")


def test_prefix_share_rate_counts_shared_and_fallen_back_batches(tiny_model, tmp_path) -> None:
    long_prompt = [Pair(f"l{i}", [1, *range(20, 60)], [70 + i, 4], [80 + i, 4]) for i in range(4)]
    short_prompt = [Pair(f"s{i}", [1], list(range(20, 40)) + [4], list(range(40, 60)) + [4])
                    for i in range(4)]
    rates = {}
    for name, pairs, mode in (("long", long_prompt, "auto"), ("short", short_prompt, "auto"),
                              ("forced", short_prompt, "on"), ("off", long_prompt, "off")):
        data = write_pairs_jsonl(pairs, tmp_path / f"{name}.jsonl", split="train")
        train(cfg(tiny_model, data, tmp_path / name, steps=2, batch_size=2, grad_accum=2,
                  prefix_share=mode))
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        rates[name] = [r["prefix_share_rate"] for r in rows if r["split"] == "train"]
    assert rates == {"long": [1.0, 1.0], "short": [0.0, 0.0], "forced": [1.0, 1.0],
                     "off": [0.0, 0.0]}


def test_memory_limit_is_applied_then_restored_and_changes_no_number(tiny_model, tiny_data,
                                                                     tmp_path, caplog,
                                                                     monkeypatch) -> None:
    """``memory_limit_gb`` sets MLX's limit for the run only (a later run in the process
    must not inherit it) and, being a wait, not a change of maths, gives the same adapter
    and losses. Catches a limit set in the wrong unit (GB vs GiB), left behind, or dropped.
    Called as a library in a process started without MLX's queue cap, it says so."""
    from engine.host.command_queue import QUEUE_MB, bounded_mb
    from engine.train import run_parts  # memory_limit's home

    monkeypatch.delenv(QUEUE_MB, raising=False)

    seen = []
    real = run_parts.mx.set_memory_limit

    def spy(limit: int) -> int:
        seen.append(limit)
        return real(limit)

    before = mx.set_memory_limit(2**40)  # a known value to come back to
    try:
        run_parts.mx.set_memory_limit = spy
        train(cfg(tiny_model, tiny_data, tmp_path / "limited", memory_limit_gb=0.5))
        run_parts.mx.set_memory_limit = real
        assert seen == [2**29, 2**40]  # 0.5 GiB for the run, then the limit it found
        assert mx.set_memory_limit(2**40) == 2**40
        train(cfg(tiny_model, tiny_data, tmp_path / "free"))
    finally:
        run_parts.mx.set_memory_limit = real
        mx.set_memory_limit(before)
    [note] = [r for r in caplog.records if "command buffers" in r.getMessage()]
    assert note.levelname == "WARNING" and f"{QUEUE_MB}={bounded_mb()}" in note.getMessage()
    a, b = adapters(tmp_path / "limited"), adapters(tmp_path / "free")
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert losses(tmp_path / "limited") == losses(tmp_path / "free")


def test_best_evaluation_is_picked_by_the_ranking_metric(tiny_model, tiny_data, tmp_path
                                                         ) -> None:
    """best_val (what a sweep ranks on as best/<metric>) is the evaluation best on
    best_metric in best_mode, not the val/loss-best one; a metric the run does not report
    is an error naming those it does."""
    picked = {}
    for metric, mode in (("val/loss", "min"), ("val/rewards/margins", "max"),
                         ("val/rewards/margins", "min")):
        out = tmp_path / f"{metric.replace('/', '_')}-{mode}"
        result = train(cfg(tiny_model, tiny_data, out, steps=6, val_every=1,
                           learning_rate=3e-3, best_metric=metric, best_mode=mode))
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if r["split"] == "valid" and r["step"] > 0]
        assert len(evals) == 6
        assert result.best_val[metric] == (min if mode == "min" else max)(
            r[metric] for r in evals)
        picked[metric, mode] = result.best_val["step"]
    # The margins' best and worst evaluations differ: the pick follows the metric.
    assert picked["val/rewards/margins", "max"] != picked["val/rewards/margins", "min"]
    with pytest.raises(ValueError, match=r"val/nope.*val/loss"):
        train(cfg(tiny_model, tiny_data, tmp_path / "nope", steps=1, val_every=1,
                  best_metric="val/nope"))
    assert not (tmp_path / "nope" / "metrics.jsonl").exists()  # refused before any step
    with pytest.raises(ValueError, match="best_metric='loss'"):
        cfg(tiny_model, tiny_data, tmp_path / "x", best_metric="loss").validate()
