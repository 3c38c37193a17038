"""The whole pipeline on a tiny Gemma 4 (PLE, sliding layers, shared K/V) from the sweep
spec users copy, flows/configs/gemma4.yaml (8 of its 24 steps: CI time): Prefect flow,
Ray trials, leaderboard, export."""

from __future__ import annotations

from pathlib import Path

import mlx_lm
import pyarrow.parquet as pq
import pytest
import yaml

from tasks.models.model_factory import ModelSpec, init_model

pytestmark = [pytest.mark.slow, pytest.mark.long]  # conftest.py: scheduled first
SPEC = Path(__file__).resolve().parents[1] / "flows" / "configs" / "gemma4.yaml"


def test_pipeline_on_gemma4(prefect_api, ray_cluster, tmp_path: Path) -> None:
    from flows.pipeline import pipeline
    from tasks.data.synthetic import synth_rows, write_rows

    model = init_model(ModelSpec(arch="gemma4_text", layers=12, kv_shared_layers=4,
                                 hidden=128, window=32), tmp_path / "model")
    raw = write_rows(list(synth_rows("sort", 120, seed=0)), tmp_path / "raw.jsonl")
    out = tmp_path / "out"
    spec = yaml.safe_load(SPEC.read_text())  # the users' spec, shorter (CI time)
    spec["fixed"].update(steps=8, val_every=4, report_every=4)
    (tmp_path / "gemma4.yaml").write_text(yaml.safe_dump(spec))
    state = pipeline(str(raw), str(model), str(tmp_path / "gemma4.yaml"), str(out),
                     generations=1, soup_k=0, return_state=True)
    assert state.is_completed(), state
    results = pq.read_table(out / "sweep" / "results.parquet").to_pylist()
    assert sorted(r["param/segment_size"] for r in results) == [1, 5]
    assert all(r["status"] == "completed" for r in results), results
    board = pq.read_table(out / "leaderboard.parquet").to_pylist()
    assert {r["trial_id"] for r in board} == {*(r["trial_id"] for r in results), "base"}
    loaded, tok = mlx_lm.load(str(model), adapter_path=str(out / "best-adapter"))
    assert isinstance(mlx_lm.generate(loaded, tok, prompt=tok.encode("Sort: 3 1 2"),
                                      max_tokens=3), str)
