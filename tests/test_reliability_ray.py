"""Issue 14 on a real local Ray (and Prefect API): a finished trial is on disk before any
later error (item 3), a model re-made in place re-runs its trials (item 5), and a sweep
flow run with result persistence on by default stores no pickle (item 12)."""

from __future__ import annotations

import json
from dataclasses import replace

import pyarrow.parquet as pq
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long]  # conftest.py: scheduled first

FIXED = {"steps": 2, "batch_size": 2, "lora_rank": 4, "val_every": 0}


def test_a_finished_trial_survives_a_later_error(ray_cluster, tiny_model, tiny_data,
                                                 tmp_path) -> None:
    """results.parquet was written once, after the last trial: any later error (there, a
    column Arrow refused) lost every trial. Would catch: results held back until the end,
    or one trial's error on the driver ending the sweep (it now costs that trial only)."""
    from tasks.sweep.run import run_sweep
    from tasks.sweep.spec_file import parse_spec

    spec = parse_spec({"name": "s", "model": str(tiny_model), "data": str(tiny_data),
                       "fixed": FIXED, "grid": {"seed": [0, 1]}})
    first = spec.trials()[0].id

    def wrap(trial, run):
        if trial.id != first:
            raise RuntimeError("the sweep broke after its first trial")
        return run()

    run_sweep(spec, tmp_path, wrap=wrap)
    rows = pq.read_table(tmp_path / "results.parquet").to_pylist()
    assert [(r["trial_id"], r["status"], r["param/seed"]) for r in rows] == \
        [(first, "completed", 0), (spec.trials()[1].id, "failed", 1)]
    assert rows[1]["reason"] == "driver_error: RuntimeError: the sweep broke after its first trial"


def test_a_model_remade_in_place_reruns_its_trials(ray_cluster, tiny_data, tmp_path,
                                                   monkeypatch) -> None:
    """The issue: `model init` again over the same path with another seed, and the sweep
    said "2 trials: 2 cached", reusing adapters trained on the old weights. Would catch: a
    sweep cache keyed on the model's path."""
    from tasks.models.model_factory import init_model
    from tasks.sweep.run import run_sweep
    from tasks.sweep.spec_file import parse_spec
    from tests.conftest import TINY

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = init_model(TINY, tmp_path / "model")
    spec = parse_spec({"name": "s", "model": str(model), "data": str(tiny_data),
                       "max_concurrent": 2, "fixed": FIXED, "grid": {"seed": [0]}})
    out = tmp_path / "sweep"
    assert [r["skipped"] for r in run_sweep(spec, out)] == [False]
    assert [r["skipped"] for r in run_sweep(spec, out)] == [True]
    init_model(replace(TINY, seed=7), model, overwrite=True)
    again = run_sweep(spec, out)
    assert [(r["status"], r["skipped"]) for r in again] == [("completed", False)]


def test_sweep_flow_results_are_never_pickled(prefect_api, ray_cluster, tiny_model, tiny_data,
                                              tmp_path) -> None:
    """With PREFECT_RESULTS_PERSIST_BY_DEFAULT on, each trial task run and the flow run
    stored its result with pickle. Would catch: any persisted result that is not JSON."""
    from prefect.settings import (
        PREFECT_LOCAL_STORAGE_PATH,
        PREFECT_RESULTS_PERSIST_BY_DEFAULT,
        temporary_settings,
    )

    from flows.sweep_flow import sweep_flow

    spec = tmp_path / "flow.yaml"
    spec.write_text(f"name: persisted\nmodel: {tiny_model}\ndata: {tiny_data}\n"
                    "max_concurrent: 2\nfixed: {steps: 2, batch_size: 2, lora_rank: 4, "
                    "val_every: 0}\ngrid: {seed: [0, 1]}\n")
    storage = tmp_path / "storage"
    with temporary_settings(updates={PREFECT_RESULTS_PERSIST_BY_DEFAULT: True,
                                     PREFECT_LOCAL_STORAGE_PATH: storage}):
        state = sweep_flow(str(spec), str(tmp_path / "out"), return_state=True)
    assert state.is_completed(), state
    assert [r["status"] for r in state.result()] == ["completed"] * 2
    stored = [p.read_bytes() for p in storage.rglob("*") if p.is_file()]
    assert stored, "the flow's result was not persisted at all"
    for raw in stored:  # a result as is (the flow's) or a result record (a task's)
        assert b"pickle" not in raw, raw[:300]
        value = json.loads(raw)  # cloudpickle's bytes are not JSON
        if isinstance(value, dict) and "metadata" in value:
            assert value["metadata"]["serializer"]["type"] == "json", raw[:300]
    assert any(b"t-" in raw and b"completed" in raw for raw in stored)  # the trial rows
