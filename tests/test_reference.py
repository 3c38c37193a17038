"""DPO's reference log-probs (engine/train/reference.py): computed once, cached by content,
refused when made for another model, dataset or reference adapter, and read back bit for
bit; ``reference: DIR`` is that adapter on the base, not the base.

Every test points ``XDG_CACHE_HOME`` at its own temporary folder: nothing here reads or
writes the user's cache. Tolerances: reference values from the cache equal a fresh
computation exactly (float32 in the file, float32 from the forward); a policy equal to its
reference has DPO rewards within 1e-5 of 0 (β = 0.1 times float32 sums of ~100 nats).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from engine.data.pairs import load_pairs
from engine.settings.config import TrainConfig
from engine.settings.forward_options import ForwardOptions
from engine.train import reference as reference_mod
from engine.train.reference import (
    ReferenceSpec,
    cache_dir,
    compute_reference,
    ensure_reference,
    prepare_reference,
)
from engine.train.reference_file import read_reference
from engine.train.trainer import train
from tasks.models.model_factory import init_model
from tests.conftest import TINY
from tests.pairs import REFERENCE_OPTIONS as OPTIONS
from tests.pairs import write_reference_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("private_cache")]
ROOT = Path(__file__).resolve().parents[1]


def cfg(model: Path, data: Path, out: Path, **kw) -> TrainConfig:
    base = dict(model=str(model), data=str(data), out=str(out), steps=1, batch_size=4,
                learning_rate=1e-3, lora_rank=4, lora_scale=2.0, report_every=1, val_every=0)
    return TrainConfig().replace(**{**base, **kw})


def records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def trained_adapter(model: Path, data: Path, out: Path, steps: int, lr: float) -> Path:
    """An ORPO adapter trained ``steps`` steps, with the file-hash cache kept private."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(out.parent / "xdg-cache"))
        train(cfg(model, data, out, steps=steps, learning_rate=lr))
    return out


@pytest.fixture(scope="module")
def orpo_adapter(tiny_model: Path, tiny_data: Path, tmp_path_factory) -> Path:
    """An adapter of the tiny model: 2 ORPO steps at a rate that moves its log-probs."""
    return trained_adapter(tiny_model, tiny_data, tmp_path_factory.mktemp("sft") / "adapter",
                           2, 1e-2)


def test_cache_equals_a_fresh_forward_bit_for_bit(tiny_model: Path, tiny_data: Path,
                                                  private_cache: Path, monkeypatch) -> None:
    """ensure_reference writes the cache file under XDG_CACHE_HOME; reading it gives
    exactly a fresh compute_reference's numbers (every pair of every split); they are the
    base model's SUMMED response log-probs (a plain mlx-lm forward agrees); a second
    ensure_reference reads the same file and computes nothing."""
    spec = ReferenceSpec(str(tiny_model), str(tiny_data))
    path, cached = ensure_reference(spec, options=OPTIONS)
    assert not cached and path == cache_dir() / f"{spec.key()}.parquet"
    assert path.is_file() and path.is_relative_to(private_cache)
    got = read_reference(path, spec.key())
    fresh = compute_reference(spec, OPTIONS)
    assert got == fresh  # exact: float32 written, float32 computed
    data = load_pairs(tiny_data)
    pairs = [*data.train, *data.valid, *data.test]
    assert sorted(got) == sorted(p.id for p in pairs) and len(got) == 80

    base, _ = mlx_lm.load(str(tiny_model))  # independent: a dense forward, no engine code
    for p in pairs[:1] + data.valid[:1]:
        for which, response in ((0, p.chosen), (1, p.rejected)):
            seq = [*p.prompt, *response]
            logits = base(mx.array([seq[:-1]]))[0].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            start = len(p.prompt) - 1
            want = sum(float(lp[t, seq[t + 1]]) for t in range(start, len(seq) - 1))
            assert got[p.id][which] == pytest.approx(want, rel=1e-5), (p.id, which)

    stat = path.stat()

    def recompute(*args, **kwargs):
        raise AssertionError("a cached reference was computed again")

    monkeypatch.setattr(reference_mod, "compute_reference", recompute)
    again, cached = ensure_reference(spec, options=OPTIONS)
    assert cached and again == path
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    assert sorted(p.name for p in cache_dir().glob("*.parquet")) == [path.name]


def test_keys_follow_content_and_foreign_files_are_refused(tiny_model: Path, tiny_data: Path,
                                                          orpo_adapter: Path,
                                                          tmp_path: Path) -> None:
    """The key changes with the model's weights (another seed), the dataset (one more
    row) and the reference adapter, never with their paths (a copy keeps it). A file
    made for one key read with another, or handed to train as --reference-logps for
    another dataset, is a ValueError naming both keys, before any step."""
    import shutil

    base = ReferenceSpec(str(tiny_model), str(tiny_data))
    other_model = init_model(replace(TINY, seed=1), tmp_path / "tiny-seed1")
    lines = tiny_data.read_text().splitlines()
    extra = json.loads(lines[0])
    extra["id"] += "-again"
    bigger = tmp_path / "bigger.jsonl"
    bigger.write_text("\n".join([*lines, json.dumps(extra)]) + "\n")
    copied = tmp_path / "copy.jsonl"
    shutil.copy(tiny_data, copied)
    keys = {base.key(), replace(base, model=str(other_model)).key(),
            replace(base, data=str(bigger)).key(),
            replace(base, reference=str(orpo_adapter)).key()}
    assert len(keys) == 4
    assert replace(base, data=str(copied)).key() == base.key()  # content, not path
    assert replace(base, model=str(shutil.copytree(tiny_model, tmp_path / "m2"))).key() == \
        base.key()

    theirs = replace(base, data=str(bigger)).key()
    made = write_reference_for(tmp_path / "bigger.parquet", theirs, bigger)
    with pytest.raises(ValueError) as err:
        read_reference(made, base.key())
    assert theirs in str(err.value) and base.key() in str(err.value)

    out = tmp_path / "run"
    with pytest.raises(ValueError) as err:
        train(cfg(tiny_model, tiny_data, out, loss="dpo", reference_logps=str(made)))
    assert theirs in str(err.value) and base.key() in str(err.value)
    assert not (out / "metrics.jsonl").exists() and not (out / "adapters.safetensors").exists()
    assert not list(cache_dir().glob("*.parquet"))  # nothing computed instead

    short = write_reference_for(tmp_path / "short.parquet", base.key(), tiny_data, drop=1)
    with pytest.raises(ValueError, match=r"no reference log-probs for pair id"):
        train(cfg(tiny_model, tiny_data, out, loss="dpo", reference_logps=str(short)))
    assert not (out / "metrics.jsonl").exists()


def test_an_adapter_for_another_base_is_refused_before_any_forward(
        tiny_model: Path, tiny_data: Path, tmp_path: Path, monkeypatch) -> None:
    """A reference adapter trained on another model (half the width, half the layers) is
    one ValueError line naming the adapter folder, raised before any forward and before
    any cache file; a folder that is no adapter is one FileNotFoundError line."""
    small = init_model(replace(TINY, layers=2, hidden=32, intermediate=64),
                       tmp_path / "small-model")
    foreign = trained_adapter(small, tiny_data, tmp_path / "foreign", 1, 1e-3)
    forwards = []
    import engine.forward.scoring as scoring_mod  # the one forward-only loop's forward

    real = scoring_mod.forward_logps
    monkeypatch.setattr(scoring_mod, "forward_logps",
                        lambda *a, **k: forwards.append(1) or real(*a, **k))
    spec = ReferenceSpec(str(tiny_model), str(tiny_data), str(foreign))
    for call in (lambda: prepare_reference(spec),
                 lambda: compute_reference(spec, OPTIONS),
                 lambda: ensure_reference(spec, options=OPTIONS)):
        with pytest.raises(ValueError) as err:
            call()
        message = str(err.value)
        assert "\n" not in message and str(foreign) in message, message
        assert "does not fit" in message and str(tiny_model) in message, message
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=re.escape(str(foreign))):
        train(cfg(tiny_model, tiny_data, out, loss="dpo", reference=str(foreign)))
    assert not forwards, "a forward ran before the adapter was refused"
    assert not list(cache_dir().glob("*.parquet")) and not (out / "metrics.jsonl").exists()

    empty = tmp_path / "not-an-adapter"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as err:
        prepare_reference(replace(spec, reference=str(empty)))
    assert "\n" not in str(err.value) and str(empty) in str(err.value)
    assert "adapter_config.json" in str(err.value)


def test_reference_adapter_is_the_policy_at_its_own_warm_start(tiny_model: Path,
                                                                tiny_data: Path,
                                                                orpo_adapter: Path,
                                                                tmp_path: Path) -> None:
    """``reference: DIR`` (SFT, here ORPO, then DPO): its log-probs differ from the
    base's and have their own key; DPO warm-started from that adapter against it starts
    with rewards 0 and loss ln 2 (policy == reference at step 0), and against the base
    with rewards β·(S_adapter − S_base), the two cached files' difference: the reference
    is the adapter on the base, and ``base`` is the base with LoRA off."""
    beta = 0.1
    runs = {}
    for name in ("adapter", "base"):
        reference = str(orpo_adapter) if name == "adapter" else "base"
        out = tmp_path / name
        train(cfg(tiny_model, tiny_data, out, loss="dpo", dpo_beta=beta, val_every=1,
                  warm_start=str(orpo_adapter), reference=reference, head_chunk=16))
        runs[name] = next(r for r in records(out) if r["split"] == "valid" and r["step"] == 0)
    spec = ReferenceSpec(str(tiny_model), str(tiny_data))
    adapted_spec = replace(spec, reference=str(orpo_adapter))
    assert adapted_spec.key() != spec.key()
    assert sorted(p.name for p in cache_dir().glob("*.parquet")) == sorted(
        f"{s.key()}.parquet" for s in (spec, adapted_spec))
    base = read_reference(cache_dir() / f"{spec.key()}.parquet", spec.key())
    adapted = read_reference(cache_dir() / f"{adapted_spec.key()}.parquet",
                             adapted_spec.key())
    assert base.keys() == adapted.keys()
    assert max(abs(adapted[i][0] - base[i][0]) for i in base) > 1e-2

    same = runs["adapter"]
    for key in ("val/rewards/chosen", "val/rewards/rejected", "val/rewards/margins"):
        assert abs(same[key]) <= 1e-5, (key, same[key])
    assert same["val/loss"] == pytest.approx(math.log(2), abs=1e-5)

    valid = load_pairs(tiny_data).valid
    for j, key in ((0, "val/rewards/chosen"), (1, "val/rewards/rejected")):
        want = beta * sum(adapted[p.id][j] - base[p.id][j] for p in valid) / len(valid)
        assert abs(want) > 1e-3  # the check above is not vacuous
        assert runs["base"][key] == pytest.approx(want, rel=1e-3, abs=1e-5), key


def test_python_m_engine_train_dpo_caches_its_reference(tiny_model: Path, tiny_data: Path,
                                                        tmp_path: Path) -> None:
    """`python -m engine train --loss dpo`: the first run says it computes the reference
    (with its progress) and writes it under XDG_CACHE_HOME; its first step starts at the
    base (rewards 0, loss ln 2); a second run reads the file and says so."""
    cache = tmp_path / "cli-cache"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}

    def run(out: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "engine", "train", "--model", str(tiny_model), "--data",
             str(tiny_data), "--out", str(tmp_path / out), "--loss", "dpo", "--steps", "2",
             "--batch-size", "2", "--report-every", "1", "--val-every", "0"],
            capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc

    first = run("a")
    files = list((cache / "pomona" / "reference").glob("*.parquet"))
    assert len(files) == 1, first.stderr
    log = first.stderr
    assert re.search(r"reference log-probs.*computing", log), log
    assert re.search(r"reference log-probs: 80/80 pairs", log), log
    assert re.search(r"^step 2/\d+ loss ", log, re.M), log
    step1 = next(r for r in records(tmp_path / "a") if r["split"] == "train")
    assert step1["step"] == 1 and step1["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert abs(step1["rewards/chosen"]) <= 1e-5
    stat = files[0].stat()

    second = run("b")
    assert re.search(r"reference log-probs: cached", second.stderr), second.stderr
    assert "computing" not in second.stderr
    assert files[0].stat().st_mtime_ns == stat.st_mtime_ns
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["steps"] == 2


@pytest.mark.unit
def test_bad_dpo_settings_are_refused_by_name() -> None:
    """A config refuses a β that trains nothing or is not a number, and label smoothing or
    a loss type the loss refuses, naming the field (the loss's settings: valid when built)."""
    ok = TrainConfig(model="m", data="d", loss="dpo")
    ok.validate()
    for field, value in (("dpo_beta", 0.0), ("dpo_beta", -0.1), ("dpo_beta", float("nan")),
                         ("dpo_label_smoothing", 0.5), ("dpo_label_smoothing", -0.1),
                         ("dpo_loss_type", "nonesuch")):
        with pytest.raises(ValueError, match=field):
            ok.replace(**{field: value}).validate()


def test_score_and_evaluation_report_dpo_under_its_own_reference(tiny_model: Path,
                                                                 tiny_data: Path,
                                                                 orpo_adapter: Path,
                                                                 tmp_path: Path) -> None:
    """A DPO adapter trained against ``reference: DIR`` is scored and evaluated under DPO
    against that same reference (its adapter config names it): evaluation's valid figures
    equal training's last validation, and score's per-pair rewards average to them."""
    from engine.cli import main as engine_main
    from tasks.eval.evaluate import evaluate_adapter

    out = tmp_path / "dpo"
    train(cfg(tiny_model, tiny_data, out, loss="dpo", steps=2, val_every=2,
              reference=str(orpo_adapter), warm_start=str(orpo_adapter), dpo_beta=0.5))
    last = [r for r in records(out) if r["split"] == "valid"][-1]
    metrics = evaluate_adapter(str(tiny_model), str(out), str(tiny_data),
                               options=ForwardOptions(batch_size=4, head_chunk=16)).metrics
    for name in ("loss", "rewards/chosen", "rewards/margins", "logps/accuracies"):
        assert metrics[f"eval/valid/{name}"] == pytest.approx(last[f"val/{name}"], rel=1e-4,
                                                              abs=1e-6), name
    assert abs(last["val/rewards/chosen"]) > 1e-4  # it moved off its reference
    scores = tmp_path / "scores.jsonl"
    assert engine_main(["score", "--model", str(tiny_model), "--adapter", str(out), "--data",
                      str(tiny_data), "--out", str(scores), "--split", "valid",
                      "--batch-size", "4", "--head-chunk", "16"]) == 0
    rows = [json.loads(line) for line in scores.read_text().splitlines()]
    mean = sum(r["chosen_reward"] for r in rows) / len(rows)
    assert mean == pytest.approx(last["val/rewards/chosen"], rel=1e-4, abs=1e-6)


def test_review_fixes_probe_keys_paths_and_identical_rows(tiny_model: Path, tiny_data: Path,
                                                         orpo_adapter: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The memory probe measures DPO (it never needs the reference's values); a sweep's
    trial key follows the reference adapter's bytes; a relative --reference is stored
    absolute; identical rows under one id (tokenize's content ids) are not refused; a
    search over dpo_loss_type cannot rank sigmoid against IPO on val/loss."""
    import shutil

    from engine.train.probe import probe_steps
    from tasks.sweep.spec_file import parse_spec
    from tasks.sweep.sweep_plan import cache_key
    from tasks.sweep.sweep_spec import SpecError

    rows = probe_steps(cfg(tiny_model, tiny_data, tmp_path / "p", loss="dpo"),
                       [{"segment_size": 0}, {"segment_size": 1}])
    assert all("error" not in r and r["peak_gb"] > 0 for r in rows), rows

    moved = shutil.copytree(orpo_adapter, tmp_path / "ref")
    key = cache_key(TrainConfig(loss="dpo", reference=str(moved)), "data", "model")
    trained_adapter(tiny_model, tiny_data, tmp_path / "again", 1, 1e-2)
    shutil.copy(tmp_path / "again" / "adapters.safetensors", moved / "adapters.safetensors")
    assert cache_key(TrainConfig(loss="dpo", reference=str(moved)), "data", "model") != key

    monkeypatch.chdir(tmp_path)
    train(cfg(tiny_model, tiny_data, tmp_path / "rel", loss="dpo", reference="ref"))
    block = json.loads((tmp_path / "rel" / "adapter_config.json").read_text())["pomona"]
    assert block["reference"] == str(moved.resolve())

    lines = tiny_data.read_text().splitlines()
    twice = tmp_path / "twice.jsonl"
    twice.write_text("\n".join([*lines, lines[0]]) + "\n")
    assert len(compute_reference(ReferenceSpec(str(tiny_model), str(twice)))) == len(lines)

    spec = {"name": "t", "model": str(tiny_model), "data": str(tiny_data),
            "fixed": {"loss": "dpo"}, "grid": {"dpo_loss_type": ["sigmoid", "ipo"]}}
    with pytest.raises(SpecError, match="not comparable"):
        parse_spec({**spec, "metric": "val/loss"})
    parse_spec({**spec, "metric": "val/logps/accuracies", "mode": "max"})


def test_an_adapter_for_another_base_of_the_same_shape_is_refused(
        tiny_model: Path, tiny_data: Path, tmp_path: Path) -> None:
    """Issue 36 item 7: a reference adapter trained on a base of the same shape (another
    seed) fits every tensor; old code attached it. Its config's base content key refuses it."""
    twin = init_model(replace(TINY, seed=1), tmp_path / "twin-model")
    foreign = trained_adapter(twin, tiny_data, tmp_path / "twin-adapter", 1, 1e-3)
    spec = ReferenceSpec(str(tiny_model), str(tiny_data), str(foreign))
    with pytest.raises(ValueError) as err:
        prepare_reference(spec)
    message = str(err.value)
    assert "\n" not in message and str(foreign) in message and "trained on base" in message, message
    prepare_reference(ReferenceSpec(str(twin), str(tiny_data), str(foreign)))  # its own


def test_a_reference_retrained_in_place_is_said_at_score(
        tiny_model: Path, tiny_data: Path, tmp_path: Path, capsys) -> None:
    """Issue 36 item 13: old code recomputed the reference from the retrained adapter and
    scored against it in silence; now a warning on stderr names the changed reference_key
    (where the command's user reads it: ``log_to_stderr`` keeps engine notes off the root
    logger, so a log capture saw it only when an earlier test had left that on)."""
    from engine.cli import main as engine_main

    sft = trained_adapter(tiny_model, tiny_data, tmp_path / "sft", 1, 1e-3)
    out = tmp_path / "dpo"
    train(cfg(tiny_model, tiny_data, out, loss="dpo", reference=str(sft)))
    args = ["--model", str(tiny_model), "--adapter", str(out), "--data", str(tiny_data),
            "--split", "valid", "--batch-size", "4", "--head-chunk", "16"]
    assert engine_main(["score", *args, "--out", str(tmp_path / "a.jsonl")]) == 0
    assert "reference_key" not in capsys.readouterr().err  # unchanged: nothing to say
    trained_adapter(tiny_model, tiny_data, sft, 2, 1e-2)  # retrained in place
    assert engine_main(["score", *args, "--out", str(tmp_path / "b.jsonl")]) == 0
    err = capsys.readouterr().err
    assert "reference_key" in err and str(sft) in err
