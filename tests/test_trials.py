"""Trials on a real local Ray cluster: one fresh process per trial, concurrency bounded."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.trials import Placement, run_trials

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A private local Ray with 2 CPU slots and 2 fake GPUs (never joins another cluster)."""
    import ray

    tmp = tmp_path_factory.mktemp("ray")
    os.environ["RAY_TMPDIR"] = str(tmp)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _temp_dir=str(tmp),
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}},
             log_to_driver=False)
    yield ray
    ray.shutdown()


def _trials(model: Path, data: Path, out: Path, n: int, **extra) -> list[tuple[str, dict]]:
    return [(f"t{i}", {"model": str(model), "data": str(data), "out": str(out / f"t{i}"),
                       "steps": 2, "batch_size": 2, "lora_rank": 4, "val_every": 0,
                       "report_every": 1, "seed": i, **extra}) for i in range(n)]


def _max_overlap(rows: list[dict]) -> int:
    events = sorted([(r["started"], 1) for r in rows] + [(r["ended"], -1) for r in rows])
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def test_four_trials_on_two_slots(ray_cluster, tiny_model, tiny_data, tmp_path) -> None:
    rows = run_trials(_trials(tiny_model, tiny_data, tmp_path, 4), tmp_path, Placement(),
                      max_concurrent=4)
    assert [r["status"] for r in rows] == ["completed"] * 4, [r.get("reason") for r in rows]
    assert _max_overlap(rows) <= 2  # 2 CPU slots, even with 4 allowed by the sweep
    assert len({r["pid"] for r in rows}) == 4  # a fresh process per trial
    table = pq.read_table(tmp_path / "results.parquet").to_pylist()
    assert [r["trial_id"] for r in table] == ["t0", "t1", "t2", "t3"]
    assert all((tmp_path / f"t{i}" / "adapters.safetensors").exists() for i in range(4))


def test_gpu_placement_pins_one_device_each(ray_cluster, tiny_model, tiny_data,
                                            tmp_path) -> None:
    rows = run_trials(_trials(tiny_model, tiny_data, tmp_path, 2), tmp_path, Placement(gpus=1),
                      max_concurrent=2)
    assert all(r["status"] == "completed" for r in rows)
    assert all(r["cuda_visible_devices"] in ("0", "1") for r in rows)


def test_a_failing_trial_is_reported_and_the_rest_complete(ray_cluster, tiny_model, tiny_data,
                                                           tmp_path) -> None:
    trials = _trials(tiny_model, tiny_data, tmp_path, 2)
    trials.append(("bad", {**trials[0][1], "data": str(tmp_path / "missing.jsonl"),
                           "out": str(tmp_path / "bad")}))
    rows = run_trials(trials, tmp_path, Placement(), max_concurrent=2)
    assert [r["status"] for r in rows] == ["completed", "completed", "failed"]
    assert "missing.jsonl" in rows[2]["reason"]
