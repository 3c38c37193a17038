"""`pomona bench sweep` (issue 72, step 2): a real ``pomona sweep`` of T trials in its own
process, its wall time against its trials' training, and each trial's phases from its row."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_sweep_bench_splits_a_trials_cost(tmp_path, capsys) -> None:
    """Two one-step trials on one slot with reuse_actors (the first in a fresh process,
    the second in the first's): every phase a trial is measured (none negative, the load
    check within the set-up), the overhead is the wall time beyond the training, and the
    driver's CPU and memory are its process's. A bad count is one line, exit 2."""
    from benchmarks.sweep_cost import PHASES, main

    work = tmp_path / "work"
    assert main(["--trials", "2", "--slots", "1", "--steps", "1", "--rows", "60", "--work",
                 str(work), "--reuse-actors", "on", "--json"]) == 0
    [sweep] = json.loads(capsys.readouterr().out)["sweeps"]
    assert (sweep["reuse_actors"], sweep["reused"]) == (True, 1)
    phases = sweep["phases_s"]
    assert tuple(phases) == PHASES and min(phases.values()) >= 0, phases
    assert 0 < phases["load_check"] <= phases["set_up"] and phases["actor_start"] > 0
    assert sweep["train_sum_s"] > 0 and sweep["wall_s"] > sweep["ideal_s"]
    assert sweep["overhead_per_trial_s"] == pytest.approx(
        (sweep["wall_s"] - sweep["train_sum_s"]) / 2)
    assert sweep["driver_cpu_s"] > 0 and sweep["driver_peak_mb"] > 50
    assert main(["--trials", "0", "--work", str(tmp_path / "other")]) == 2
    assert "at least 1 each" in capsys.readouterr().err
