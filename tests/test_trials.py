"""Trials on a real local Ray cluster: one fresh process per trial, concurrency bounded."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.nodes.placement import Placement
from tasks.sweep.scheduler import run_trials
from tasks.sweep.trial_rules import TrialRules

pytestmark = [pytest.mark.slow, pytest.mark.long]  # conftest.py: scheduled first


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


PHASE_COLUMNS = {f"phase/{k}" for k in ("actor_start", "imports", "inputs", "set_up",
                                         "load_check", "first_step", "steps", "finish",
                                         "pull")}


def test_four_trials_on_two_slots(ray_cluster, tiny_model, tiny_data, tmp_path) -> None:
    """Each row also says where its trial's time went (issue 72): the fresh actor's start,
    its inputs, the run's phases (within the run's own seconds, itself within the trial's
    duration in its process) and the pull."""
    rows = run_trials(_trials(tiny_model, tiny_data, tmp_path, 4), Placement(),
                      TrialRules(max_concurrent=4), results=tmp_path / "results.parquet")
    assert [r["status"] for r in rows] == ["completed"] * 4, [r.get("reason") for r in rows]
    assert _max_overlap(rows) <= 2  # 2 CPU slots, even with 4 allowed by the sweep
    assert len({r["pid"] for r in rows}) == 4  # a fresh process per trial
    table = pq.read_table(tmp_path / "results.parquet").to_pylist()
    assert [r["trial_id"] for r in table] == ["t0", "t1", "t2", "t3"]
    for r in table:
        assert set(r) >= PHASE_COLUMNS and all(r[c] >= 0 for c in PHASE_COLUMNS), r
        run = sum(r[f"phase/{k}"] for k in ("set_up", "first_step", "steps", "finish"))
        assert run - r["phase/first_step"] <= r["train_s"] + 1e-3  # first_step: in steps
        assert r["phase/load_check"] <= r["phase/set_up"]
        assert 0 < r["train_s"] <= r["duration_s"]
    assert all((tmp_path / f"t{i}" / "adapters.safetensors").exists() for i in range(4))


def test_gpu_placement_pins_one_device_each(ray_cluster, tiny_model, tiny_data,
                                            tmp_path) -> None:
    rows = run_trials(_trials(tiny_model, tiny_data, tmp_path, 2), Placement(gpus=1),
                      TrialRules(max_concurrent=2))
    assert all(r["status"] == "completed" for r in rows)
    assert all(r["cuda_visible_devices"] in ("0", "1") for r in rows)


def test_a_failing_trial_is_reported_and_the_rest_complete(ray_cluster, tiny_model, tiny_data,
                                                           tmp_path) -> None:
    trials = _trials(tiny_model, tiny_data, tmp_path, 2)
    trials.append(("bad", {**trials[0][1], "data": str(tmp_path / "missing.jsonl"),
                           "out": str(tmp_path / "bad")}))
    rows = run_trials(trials, Placement(), TrialRules(max_concurrent=2))
    assert [r["status"] for r in rows] == ["completed", "completed", "failed"]
    assert "missing.jsonl" in rows[2]["reason"]


def test_sweep_reruns_exactly_what_changed(ray_cluster, tiny_model, tiny_data,
                                           tmp_path, monkeypatch) -> None:
    """And issue 67 case 9: results.parquet lost to a full disk (its write failing while
    the trials' adapters and summaries were whole) made the re-run train every finished
    trial again: each is recognised from the row it left in its own folder."""
    import errno
    import shutil

    import tasks.sweep.run as sweep_run
    from tasks.sweep.run import run_sweep
    from tasks.sweep.spec_file import parse_spec

    data = shutil.copy(tiny_data, tmp_path / "data.jsonl")
    raw = {"name": "s", "model": str(tiny_model), "data": str(data), "max_concurrent": 2,
           "fixed": {"steps": 2, "batch_size": 2, "lora_rank": 4, "val_every": 0},
           "grid": {"segment_size": [0, 2]}}
    out = tmp_path / "sweep"  # beside its input: a sweep writes only into its own folder
    first = run_sweep(parse_spec(raw), out)
    assert [r["status"] for r in first] == ["completed"] * 2
    assert not any(r["skipped"] for r in first)
    table = pq.read_table(out / "results.parquet").to_pylist()
    assert {r["param/segment_size"] for r in table} == {0, 2}
    again = run_sweep(parse_spec(raw), out)
    assert all(r["skipped"] for r in again)

    def full_disk(rows, path, **_):
        raise OSError(errno.ENOSPC, f"cannot write {path}: no space left on its disk")

    with monkeypatch.context() as patch:
        patch.setattr(sweep_run, "write_results", full_disk)
        with pytest.raises(OSError, match="no space left"):
            run_sweep(parse_spec({**raw, "grid": {"segment_size": [0, 1]}}), out)
    (out / "results.parquet").unlink()  # as a disk that was full left it: never written
    changed = run_sweep(parse_spec({**raw, "grid": {"segment_size": [0, 1]}}), out)
    assert [r["skipped"] for r in changed] == [True, True]  # seg 1 finished, its row lost
    assert [r["status"] for r in changed] == ["completed"] * 2
    assert {r["adapter"] for r in changed} == {str(out / r["trial_id"]) for r in changed}
    lines = Path(data).read_text().splitlines(keepends=True)
    Path(data).write_text("".join(lines[1:]))  # the same path, different data: all re-run
    redone = run_sweep(parse_spec({**raw, "grid": {"segment_size": [0, 1]}}), out)
    assert [r["skipped"] for r in redone] == [False, False]


def test_a_malformed_summary_costs_its_trial_not_the_results(ray_cluster, tiny_model,
                                                              tiny_data, tmp_path,
                                                              monkeypatch) -> None:
    """A node that answers a summary this driver cannot rank (an older Pomona's: a dict
    where the trial id goes crashed the driver and results.parquet was never written):
    that trial fails naming why, the other completes, and the table is written."""
    import tasks.sweep.attempts
    from tasks.sweep.run import run_sweep
    from tasks.sweep.spec_file import parse_spec
    from tasks.sweep.trial import TrialActor

    class OlderNode(TrialActor):  # defined here: Ray ships it by value to the worker
        def run(self, plan, *args, **kwargs):
            summary = super().run(plan, *args, **kwargs)
            if plan["config"]["seed"] == 1:
                return {**summary, "trial_id": {"id": plan["id"]}}
            return summary

    monkeypatch.setattr(tasks.sweep.attempts, "TrialActor", OlderNode)
    raw = {"name": "m", "model": str(tiny_model), "data": str(tiny_data), "max_concurrent": 2,
           "fixed": {"steps": 2, "batch_size": 2, "lora_rank": 4, "val_every": 0},
           "grid": {"seed": [0, 1]}}
    rows = run_sweep(parse_spec(raw), tmp_path / "sweep")
    table = pq.read_table(tmp_path / "sweep" / "results.parquet").to_pylist()
    assert [r["status"] for r in rows] == [r["status"] for r in table] == ["completed",
                                                                           "failed"]
    assert table[1]["reason"].startswith("malformed_summary from ") and "trial_id" in \
        table[1]["reason"], table[1]["reason"]
    assert table[1]["trial_id"] == rows[1]["trial_id"] and table[1]["param/seed"] == 1


def test_sweep_refuses_a_cluster_without_the_gpus_it_needs() -> None:
    """check_cluster alone, on resource tables (no Ray, model or data)."""
    from tasks.nodes.placement import Placement
    from tasks.sweep.run import check_cluster

    with pytest.raises(RuntimeError, match="no GPUs"):
        check_cluster(Placement(gpus=1), {"CPU": 8.0})
    with pytest.raises(RuntimeError, match="'mlx_gpu' resources"):
        check_cluster(Placement(resource="mlx_gpu"), {"CPU": 8.0, "GPU": 1.0})
    assert check_cluster(Placement(), {"CPU": 2.0}) == 2
    with pytest.raises(RuntimeError, match=r"expects 4 GPUs .* offers 2"):
        check_cluster(Placement(gpus=1), {"CPU": 8.0, "GPU": 2.0}, expected=4)
    assert check_cluster(Placement(), {"CPU": 2.0}, expected=4) == 2  # CPU slots: fewer run


def test_non_finite_and_time_limited_trials_are_reported(ray_cluster, tiny_model, tiny_data,
                                                         tmp_path) -> None:
    base = _trials(tiny_model, tiny_data, tmp_path, 1)[0][1]
    trials = [("ok", base),
              ("nan", {**base, "out": str(tmp_path / "nan"), "learning_rate": 1e30,
                       "steps": 4, "grad_clip": 0.0}),
              ("slow", {**base, "out": str(tmp_path / "slow"), "steps": 100000})]
    # The limit in a run of its own: under CI's load the "ok" trial alone took over 10 s.
    rows = run_trials(trials[:2], Placement(), TrialRules(max_concurrent=2))
    rows += run_trials(trials[2:], Placement(), TrialRules(max_concurrent=1, time_limit_s=5))
    by = {r["trial_id"]: r for r in rows}
    assert by["ok"]["status"] == "completed"
    assert by["nan"]["status"] == "failed" and by["nan"]["reason"].startswith("non_finite")
    assert by["slow"]["status"] == "failed" and by["slow"]["reason"].startswith("time_limit")
