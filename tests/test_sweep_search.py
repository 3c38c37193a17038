"""Optuna search with pruning, segment_size: auto and Ctrl-C, on a real local Ray cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from engine.host.command_queue import bounded_mb
from tasks.nodes.placement import Placement
from tasks.sweep.run import run_sweep
from tasks.sweep.scheduler import TrialsInterrupted
from tasks.sweep.spec_file import parse_spec

pytestmark = [pytest.mark.slow, pytest.mark.long]  # conftest.py: scheduled first


def _spec(model: Path, data: Path, **extra) -> dict:
    return {"name": "s", "model": str(model), "data": str(data), "max_concurrent": 1,
            "fixed": {"steps": 12, "batch_size": 4, "lora_rank": 4, "val_every": 4,
                      "val_batches": 2, "report_every": 4, **extra.pop("fixed", {})},
            **extra}


def test_optuna_prunes_a_hopeless_trial(ray_cluster, tiny_model, tiny_data, tmp_path) -> None:
    """Learning rates over 7 decades: the tiny ones cannot move val/loss and are pruned."""
    raw = _spec(tiny_model, tiny_data, search="optuna", num_samples=5, seed=3,
                space={"learning_rate": {"loguniform": [1.0e-9, 3.0e-2]}},
                pruning={"startup_trials": 1, "warmup_steps": 1})
    spec = parse_spec(raw)
    rows = run_sweep(spec, tmp_path)
    statuses = [r["status"] for r in rows]
    assert len(rows) == 5 and set(statuses) <= {"completed", "pruned"}, statuses
    assert "pruned" in statuses, [(r["param/learning_rate"], r["status"]) for r in rows]
    pruned = [r for r in rows if r["status"] == "pruned"]
    assert all(r["reason"].startswith("pruned at step") for r in pruned)
    done = [r for r in rows if r["status"] == "completed"]
    assert all(r["best/val/loss"] is not None for r in done)
    assert all(r["mlx_queue_mb"] is None for r in done)  # no limit: MLX's own queue
    table = pq.read_table(tmp_path / "results.parquet").to_pylist()
    assert sorted(r["trial_id"] for r in table) == sorted(r["trial_id"] for r in rows)
    # A re-run asks the same seeded sampler: its first (startup, never pruned) sample is
    # the first run's, from the cache (one sample: the pruned ones would train again).
    [again] = run_sweep(parse_spec({**raw, "num_samples": 1}), tmp_path)
    assert again["skipped"] and again["trial_id"] == rows[0]["trial_id"], again


def test_segment_size_auto_fits_the_budget(ray_cluster, tiny_model, tiny_data, tmp_path) -> None:
    """Two budgets from the probe's own measurements: the smaller picks a smaller size, and
    re-running the same sweep under it re-trains (the resolved size is part of the key)."""
    from tasks.sweep.memory_probe import AUTO_HEADROOM, per_rank, probe_key
    from tasks.sweep.sweep_plan import data_fingerprint

    raw = _spec(tiny_model, tiny_data, fixed={"segment_size": "auto", "head_chunk": 16,
                                              "batch_size": 8, "steps": 2, "val_every": 0},
                memory_budget_gb=1000.0)
    big = run_sweep(parse_spec(raw), tmp_path)
    probes = json.loads((tmp_path / "probes.json").read_text())
    [peaks] = probes.values()
    peaks = {int(k): v for k, v in peaks.items()}
    assert sorted(peaks) == [0, 1, 2]  # plain and the powers of two below 4 layers
    assert big[0]["status"] == "completed" and big[0]["param/segment_size"] == 0
    # Under the budget (its memory limit) the trial's actor started with MLX's queue capped
    # (engine/host/command_queue.py), as the probes did.
    assert big[0]["mlx_queue_mb"] == str(bounded_mb())
    smallest = min(peaks, key=peaks.get)
    assert smallest != 0 and peaks[smallest] * AUTO_HEADROOM < peaks[0], peaks
    raw["memory_budget_gb"] = budget = peaks[smallest] * AUTO_HEADROOM
    [small] = run_sweep(parse_spec(raw), tmp_path)
    assert small["status"] == "completed" and not small["skipped"]
    assert small["param/segment_size"] != 0
    assert peaks[small["param/segment_size"]] * AUTO_HEADROOM <= budget
    assert small["param/memory_limit_gb"] == pytest.approx(budget)
    assert json.loads(small["segment_size_probe_gb"]).keys() == {"0", "1", "2"}
    [plan] = parse_spec(raw).trials(tmp_path)  # its config, as the probe was keyed on
    assert plan.config.memory_limit_gb == pytest.approx(budget)
    assert probe_key(per_rank(plan, 1), data_fingerprint(str(tiny_data))) in probes
    raw["memory_budget_gb"] = peaks[smallest] / 2  # nothing fits: said, with the numbers
    with pytest.raises(Exception, match="no segment size fits memory_budget_gb"):
        run_sweep(parse_spec(raw), tmp_path)


def test_pack_auto_fits_packs_to_the_budget(ray_cluster, tiny_model, tiny_data,
                                            tmp_path) -> None:
    """``pack: auto``: four learning rates probed as packs of 1..4; a budget that fits
    all four packs them as one, one between the probed peaks of 2 and 3 as two packs of
    two (probed again under that limit, stopping at 3; every trial trained again under its
    new limit), each trial's result the same to the parity tolerance. Would catch: auto
    ignoring the budget, a pack past it, or a probe re-run for a budget it answered."""

    raw = _spec(tiny_model, tiny_data, fixed={"steps": 2, "val_every": 0, "head_chunk": 16},
                grid={"learning_rate": [1e-4, 2e-4, 4e-4, 8e-4]}, pack="auto",
                memory_budget_gb=1000.0)
    plans: list[dict] = []
    one = run_sweep(parse_spec(raw), tmp_path, progress=lambda kind, s: plans.append(s)
                    if kind == "plan" else None)
    assert [r["status"] for r in one] == ["completed"] * 4
    assert {r["pack_size"] for r in one} == {4} and len({r["pack"] for r in one}) == 1
    assert plans[0]["pack_auto"] == 4
    peaks = {int(k): v for k, v in json.loads(one[0]["pack_probe_gb"]).items()}
    assert sorted(peaks) == [1, 2, 3, 4] and peaks[1] < peaks[2] < peaks[3] < peaks[4]
    raw["memory_budget_gb"] = budget = (peaks[2] + peaks[3]) / 2
    two = run_sweep(parse_spec(raw), tmp_path)
    probes = json.loads((tmp_path / "probes.json").read_text())
    assert sorted(len(rows) for rows in probes.values()) == [3, 4]  # the first over: no more
    assert [r["status"] for r in two] == ["completed"] * 4 and not any(r["skipped"]
                                                                        for r in two)
    assert [r["pack_size"] for r in two] == [2] * 4 and len({r["pack"] for r in two}) == 2
    assert all(r["param/memory_limit_gb"] == pytest.approx(budget) for r in two)
    for a, b in zip(one, two, strict=True):
        assert b["final_loss"] == pytest.approx(a["final_loss"], rel=1e-5)


def test_ctrl_c_cancels_running_trials_and_keeps_results(ray_cluster, tiny_model, tiny_data,
                                                         tmp_path, request) -> None:
    """KeyboardInterrupt arriving once the first trial is running (as Ctrl-C would)."""
    import _thread
    import signal
    import threading

    # interrupt_main does nothing where SIGINT is ignored (a worker started by a shell's
    # `&`): the sweep then ran its 100,000-step trials to the end.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))

    raw = _spec(tiny_model, tiny_data, fixed={"steps": 100000, "val_every": 0},
                grid={"seed": [0, 1, 2]}, max_concurrent=2)

    fired = threading.Event()

    def progress(kind: str, summary: dict) -> None:
        if kind == "running" and not fired.is_set():  # once, as one Ctrl-C
            fired.set()
            threading.Timer(2.0, _thread.interrupt_main).start()

    with pytest.raises(TrialsInterrupted):
        run_sweep(parse_spec(raw), tmp_path, Placement(), progress=progress)
    rows = pq.read_table(tmp_path / "results.parquet").to_pylist()
    assert rows and all(r["status"] == "cancelled" for r in rows), rows
    assert len(rows) <= 2  # the third trial never started


def test_memory_mode_writes_a_pareto_table_and_plot(ray_cluster, tiny_model, tiny_data,
                                                    tmp_path) -> None:
    from tasks.sweep.memory_sweep import run_memory_sweep

    raw = {"name": "mem", "kind": "memory", "model": str(tiny_model), "data": str(tiny_data),
           "probe_batches": 2, "fixed": {"batch_size": 8, "lora_rank": 4},
           "grid": {"segment_size": [0, 1], "head_chunk": [0, 16]}}
    rows = run_memory_sweep(parse_spec(raw), tmp_path)
    assert sorted((r["segment_size"], r["head_chunk"]) for r in rows) == [(0, 0), (0, 16),
                                                                          (1, 0), (1, 16)]
    assert all(r["peak_gb"] > 0 and r["tokens_per_sec"] > 0 for r in rows)
    front = [r for r in rows if r["pareto"]]
    assert front  # someone is optimal; and nobody on it is beaten on both axes
    for r in front:
        assert not any(o["peak_gb"] < r["peak_gb"] and o["tokens_per_sec"] > r["tokens_per_sec"]
                       for o in rows)
    lean = min(r["peak_gb"] for r in rows)  # the leanest is on it (the faster of a tie:
    assert max((r for r in rows if r["peak_gb"] == lean),  # it weakly dominates the other)
               key=lambda r: r["tokens_per_sec"])["pareto"]
    assert pq.read_table(tmp_path / "memory.parquet").num_rows == 4
    md = (tmp_path / "memory.md").read_text()
    assert "segment_size=1 head_chunk=16" in md and "★" in md
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
