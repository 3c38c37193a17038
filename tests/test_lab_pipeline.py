"""The pipeline on a simulated lab with private disks (tests/lab_nodes.py), on a lab of its
own: the head holds the model and the raw data, two workers hold nothing; the pipeline
trains on both workers and its leaderboard equals a one-node run of the same spec."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.lab_nodes import SPEC, Lab, pomona, stocked_lab

pytestmark = [pytest.mark.slow, pytest.mark.long]

COMPARED = ("eval/valid/loss", "eval/valid/logps/accuracies", "eval/test/loss",
            "eval/test/logps/margin")


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    yield from stocked_lab(tmp_path_factory.mktemp("lab"), tiny_model)


def board(path: Path) -> dict[str, dict]:
    return {r["trial_id"]: r for r in pq.read_table(path).to_pylist()}


def test_pipeline_on_private_disks_equals_one_node(lab: Lab, tiny_model: Path, tmp_path: Path,
                                                   prefect_api) -> None:
    """The pipeline on the lab (nothing shared but the code) completes with trials on both
    workers, and its leaderboard equals a one-node run of the same spec within 1e-6."""
    pomona(lab, "head", "pipeline", "/tmp/lab/sort.jsonl", "/tmp/lab/model",
           "/tmp/lab/spec.yaml", "--out", "/tmp/lab/out", "--address", lab.address,
           "--resource", "mlx_gpu", "--generations", "0")
    out = lab.get("head", "/tmp/lab/out", tmp_path / "lab")
    results = pq.read_table(out / "sweep" / "results.parquet").to_pylist()
    assert {r["node"] for r in results} == {"w1", "w2"}, [r["node"] for r in results]
    if "libopenblas" in os.environ.get("LD_PRELOAD", ""):  # the driver's preload reached them
        assert all(r["openblas"] for r in results), [r["openblas"] for r in results]
    assert all((out / "sweep" / r["trial_id"] / "adapters.safetensors").exists()
               for r in results)
    assert (out / "best-adapter" / "adapters.safetensors").exists()
    lines = (out / "sweep" / results[0]["trial_id"] / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x)["step"] for x in lines if json.loads(x).get("split") == "train"]
    assert steps == sorted(set(steps)), steps  # pulled back once, nothing duplicated

    from flows.pipeline import pipeline

    raw = tmp_path / "sort.jsonl"
    lab.get("head", "/tmp/lab/sort.jsonl", tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    state = pipeline(str(raw), str(tiny_model), str(spec), str(tmp_path / "one"),
                     generations=0, return_state=True)
    assert state.is_completed(), state
    here, there = board(tmp_path / "one" / "leaderboard.parquet"), board(
        out / "leaderboard.parquet")
    assert set(here) == set(there)
    for tid, row in here.items():
        for key in COMPARED:
            assert there[tid][key] == pytest.approx(row[key], abs=1e-6), (tid, key)
