"""The `pomona` CLI and the demo: real commands on real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx_lm
import pytest
from typer.testing import CliRunner

from flows.cli import app

pytestmark = pytest.mark.integration
runner = CliRunner()


def test_help_lists_the_verbs() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for verb in ("model", "data", "demo"):
        assert verb in result.output


def test_model_init_cli_writes_a_loadable_model(tmp_path: Path) -> None:
    out = tmp_path / "m"
    args = ["model", "init", "--out", str(out), "--layers", "1", "--hidden", "64",
            "--intermediate", "128", "--vocab", "400", "--arch", "qwen2"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == 1
    model, _ = mlx_lm.load(str(out))
    assert len(model.layers) == 1
    again = runner.invoke(app, args)  # refuses to clobber without --overwrite
    assert again.exit_code == 2 and "--overwrite" in again.output


def test_model_init_cli_rejects_bad_shape(tmp_path: Path) -> None:
    result = runner.invoke(app, ["model", "init", "--out", str(tmp_path / "m"), "--hidden", "100"])
    assert result.exit_code == 2
    assert "hidden=100" in result.output
    assert not (tmp_path / "m").exists()


def test_data_synth_cli(tmp_path: Path) -> None:
    out = tmp_path / "d.jsonl"
    result = runner.invoke(app, ["data", "synth", "--task", "reverse", "--n", "7", "--seed", "2",
                                 "--layout", "conversational", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 7 and isinstance(rows[0]["prompt"], list)
    bad = runner.invoke(app, ["data", "synth", "--task", "nope", "--out", str(out)])
    assert bad.exit_code == 2 and "unknown task 'nope'" in bad.output


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    # A real subprocess through the console script's module, as a user would run it.
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "demo", "--out", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ORPO training" in proc.stdout and "held-out preference accuracy" in proc.stdout
    adapter = tmp_path / "demo" / "adapter"
    rows = [json.loads(x) for x in (adapter / "metrics.jsonl").read_text().splitlines()]
    acc = [r["val/rewards/accuracies"] for r in rows if r["split"] == "valid"]
    assert acc[-1] >= acc[0] + 0.1, acc  # the demo really trains
    model, _ = mlx_lm.load(str(tmp_path / "demo" / "model"), adapter_path=str(adapter))
    assert model is not None
