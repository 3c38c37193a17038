"""`python -m engine train` as a user meets its errors: one line, exit 2, never a
traceback or argparse's page of usage."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.data.batch import Pair
from engine.data.pairs import write_pairs_jsonl

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def train(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "engine", "train", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr, proc.stderr
    # One line of error; the load check's report (two lines) may come before it.
    [line] = [x for x in proc.stderr.strip().splitlines() if not x.startswith("load check")]
    return line


def test_train_mistakes_are_one_line(tiny_model: Path, tiny_data: Path, tmp_path: Path) -> None:
    """A file where --out should be a folder was a traceback (only ValueError was caught);
    a negative number without '=' printed argparse's whole usage."""
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    line = train("--model", str(tiny_model), "--data", str(tiny_data), "--out", str(taken))
    assert "taken" in line
    line = train("--model", str(tiny_model), "--data", str(tiny_data), "--learning-rate",
                 "-1e-4")
    assert "--learning-rate=-1e-4" in line


def test_pairs_beyond_the_context_are_refused_by_id(tiny_model: Path, tmp_path: Path) -> None:
    """A row longer than the model's context (4096 here) would exhaust memory mid-run."""
    pairs = [Pair("ok", [5] * 20, [6] * 5, [7] * 5), Pair("huge", [5] * 5000, [6], [7])]
    data = write_pairs_jsonl(pairs, tmp_path / "pairs.jsonl", split="train")
    line = train("--model", str(tiny_model), "--data", str(data), "--out", str(tmp_path / "o"))
    assert "'huge'" in line and "4096" in line and "--max-length" in line


def test_score_loss_mistakes_are_one_line(tiny_model: Path, tiny_data: Path, tmp_path: Path,
                                          capsys) -> None:
    """A negative or NaN loss weight, and an adapter whose config names an unknown loss,
    are refused by name before anything is scored (were: scored silently / a traceback)."""
    import json

    from engine.cli import main as engine_main

    base = ["--model", str(tiny_model), "--data", str(tiny_data), "--out",
            str(tmp_path / "s.jsonl")]
    for flag, value, name in (("--simpo-beta", "-1", "simpo_beta"),
                              ("--orpo-lambda", "nan", "orpo_lambda")):
        assert engine_main(["score", *base, "--loss", "simpo", flag, value]) == 2
        assert name in capsys.readouterr().err
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"pomona": {"loss": "nonesuch"}}))
    assert engine_main(["score", *base, "--adapter", str(adapter)]) == 2  # through score's own path
    err = capsys.readouterr().err
    assert "adapter_config.json" in err and "nonesuch" in err, err
    assert not (tmp_path / "s.jsonl").exists()


def test_verify_prints_the_figures_it_checked(tiny_model: Path, tiny_data: Path,
                                              tmp_path: Path, capsys) -> None:
    """Issue 28, item 14: `--verify` printed nothing when it passed. Would catch: a pass
    with no line saying what was compared, within what tolerance."""
    import json

    from engine.cli import main as engine_main

    code = engine_main(["train", "--model", str(tiny_model), "--data", str(tiny_data), "--out",
                      str(tmp_path / "v"), "--steps", "1", "--batch-size", "2", "--verify",
                      "--segment-size", "2", "--head-chunk", "8", "--val-every", "0"])
    err = capsys.readouterr().err
    assert code == 0, err
    [line] = [x for x in err.splitlines() if "--verify" in x]
    assert line.startswith("--verify passed: segment_size=2, head_chunk=8, shared=") and \
        "matches the plain dense path on 2 pairs (loss rel err " in line and \
        "grad rel err " in line and "tolerance " in line, line
    figures = json.loads((tmp_path / "v" / "summary.json").read_text())["verified"]
    assert figures["pairs"] == 2 and figures["grad_rel_err"] <= figures["tolerance"]


def test_verify_checks_a_bf16_model_on_its_float32_copy(tiny_data: Path, tmp_path: Path,
                                                        capsys) -> None:
    """A bf16 (or 4-bit) model's two paths cannot be asked to agree in bf16 (a deep Gemma's
    differ by O(1)); `--verify` compares them on the float32 structural copy, at the
    float32 tolerance, and says so. Would catch: the bf16 comparison (tolerance 3e-2) back."""
    from engine.cli import main as engine_main
    from tasks.models.model_factory import ModelSpec, init_model

    spec = ModelSpec(layers=4, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512,
                     dtype="bfloat16")  # tiny_model's, in bf16
    model = init_model(spec, tmp_path / "bf16")
    code = engine_main(["train", "--model", str(model), "--data", str(tiny_data), "--out",
                      str(tmp_path / "v"), "--steps", "1", "--batch-size", "2", "--verify",
                      "--segment-size", "2", "--head-chunk", "8", "--val-every", "0"])
    err = capsys.readouterr().err
    assert code == 0, err
    [line] = [x for x in err.splitlines() if "--verify" in x]
    assert "on a float32 copy (layers [2, 3] of 4" in line and "tolerance 0.001" in line, line
