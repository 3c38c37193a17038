"""Issue 67 case 3: a sweep's results.parquet names each trial's adapter relative to the
sweep folder, and reading it resolves them there. An absolute path followed a copied
sweep back to the original's adapters (a trial deleted from the copy was ranked from the
original) and left a moved one with tracebacks and stale paths that no re-run mended. The
board's side, on a real copied sweep: tests/test_pipeline.py."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.board.leaderboard import rank_trials
from tasks.board.results_table import MISSING, read_results, write_results
from tasks.sweep.sweep_plan import previous_results

pytestmark = pytest.mark.unit


def adapter_in(folder: Path, value: float = 0.5) -> Path:
    """An adapter folder as mlx-lm writes one: one factor, its config."""
    import json

    import mlx.core as mx

    folder.mkdir(parents=True)
    mx.save_safetensors(str(folder / "adapters.safetensors"),
                        {"layers.0.q_proj.lora_a": mx.full((4, 2), value)})
    (folder / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "lora_parameters": {"rank": 2, "scale": 1.0}}))
    return folder


def test_rows_name_adapters_in_their_own_sweep_wherever_it_moved(tmp_path: Path) -> None:
    old = tmp_path / "old-sweep"
    rows = [{"trial_id": t, "status": "completed", "adapter": str(adapter_in(old / t)),
             "best/val/loss": loss} for t, loss in (("t-a", 0.5), ("t-b", 0.4))]
    rows.append({"trial_id": "t-c", "status": "failed", "adapter": str(old / "t-c"),
                 "reason": "diverged"})
    rows.append({"trial_id": "t-d", "status": "completed", "best/val/loss": 0.3,
                 "adapter": str(adapter_in(old / "t-d", float("nan")))})  # diverged on disk
    write_results(rows, old / "results.parquet", sweep=True)
    assert [r["adapter"] for r in pq.read_table(old / "results.parquet").to_pylist()] == [
        "t-a", "t-b", "t-c", "t-d"]  # relative: the trial's folder name
    moved = tmp_path / "moved"
    old.rename(moved)
    (moved / "t-b" / "adapters.safetensors").unlink()
    got = {r["trial_id"]: r for r in read_results(moved)}
    assert got["t-a"]["adapter"] == str(moved / "t-a")
    assert got["t-b"]["status"] == MISSING and got["t-b"]["adapter"] is None
    assert str(moved / "t-b") in got["t-b"]["reason"]
    assert got["t-c"]["status"] == "failed" and got["t-c"]["adapter"] is None
    # a NaN adapter costs its trial, not the board (its evaluation would refuse it)
    assert got["t-d"]["status"] == MISSING and "NaN" in got["t-d"]["reason"]
    ranked = {r["trial_id"]: r.get("rank") for r in rank_trials(
        list(got.values()), {}, "val/loss", "min")}
    assert ranked == {"t-a": 1, "t-b": None, "t-c": None, "t-d": None}
    # a re-run there: t-b is not cached (its adapter is gone), t-a's row points here
    before = previous_results(moved)
    assert before["t-b"]["status"] == MISSING and before["t-a"]["adapter"] == str(moved / "t-a")
    # a sweep's start reads no trial's weights (the board does): t-d is there, as it was
    assert before["t-d"]["status"] == "completed" and "remove" in got["t-d"]["reason"]


def test_a_trials_row_in_its_folder_is_recognised_and_never_a_users_file(
        tmp_path: Path) -> None:
    """Issue 67 case 9's row beside the adapter (tasks/sweep/trial_row.py): recognised with
    its key only where written after the adapter; a user's trial.json is never replaced."""
    import os

    from tasks.sweep.trial_row import TRIAL_ROW, keep_row, recovered

    folder = adapter_in(tmp_path / "t-a")
    row = {"trial_id": "t-a", "status": "completed", "adapter": str(folder)}
    keep_row(tmp_path, row, "k1")
    assert recovered(tmp_path, "t-a", "k1")["adapter"] == str(folder)
    assert recovered(tmp_path, "t-a", "k2") is None  # another key: trains again
    os.utime(folder / TRIAL_ROW, (1, 1))  # an adapter pulled after the row: not this row's
    assert recovered(tmp_path, "t-a", "k1") is None
    users = adapter_in(tmp_path / "t-b") / TRIAL_ROW
    users.write_text('{"my": "notes"}\n')
    keep_row(tmp_path, {**row, "trial_id": "t-b"}, "k1")
    assert users.read_text() == '{"my": "notes"}\n' and recovered(tmp_path, "t-b", "k1") is None


def test_a_table_an_earlier_version_wrote_with_absolute_paths_reads_in_place(
        tmp_path: Path) -> None:
    """Tables written before the change hold absolute paths: the trial's folder in the
    sweep being read is what counts, never the path recorded."""
    original, copy = tmp_path / "original", tmp_path / "copy"
    adapter_in(original / "t-a")
    adapter_in(copy / "t-a")
    import pyarrow as pa

    pq.write_table(pa.table({"trial_id": ["t-a"], "status": ["completed"],
                             "adapter": [str(original / "t-a")]}), copy / "results.parquet")
    [row] = read_results(copy)
    assert row["adapter"] == str(copy / "t-a")
