"""The README's first command: `pomona demo`, the whole pipeline on fixtures it makes.

The suite's longest test (marked ``long(2)``): the collection hook in conftest.py schedules
it first, so that on pytest-xdist workers it runs beside the rest instead of after it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx_lm
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long(2)]  # the longest: first of all


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    """The README's first command, as a user runs it: a subprocess, its own Prefect server.
    Also the suite's check that ORPO training learns: the best adapter beats the base model
    on held-out test pairs by 0.1 or more."""
    import pyarrow.parquet as pq

    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"),
           "RAY_TMPDIR": tempfile.mkdtemp(prefix="rd", dir="/tmp")}
    env.pop("RAY_AUTH_MODE", None)  # Ray's default (token auth on), as a user gets it
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "demo", "--out", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "test preference accuracy: base model" in proc.stdout, proc.stdout
    assert "leaderboard" in proc.stdout
    board = pq.read_table(tmp_path / "demo" / "leaderboard.parquet").to_pylist()
    base = next(r for r in board if r["trial_id"] == "base")
    best = next(r for r in board if r.get("rank") == 1)
    assert {r["status"] for r in board} >= {"completed", "baseline"}
    assert best["status"] == "completed"
    acc = "eval/test/logps/accuracies"
    assert best[acc] >= base[acc] + 0.1, board  # it really trains
    assert best["eval/test/rows"] > 100 and best["eval/valid/rows"] > 100  # ~10% of 2200 each
    # The answers are scored and the score printed with its interval, never samples alone.
    assert "test answers scored by parity: base model" in proc.stdout, proc.stdout
    assert best["gen/test/parity/n"] == base["gen/test/parity/n"] == best["eval/test/rows"]
    assert best["gen/test/parity/low"] <= best["gen/test/parity"] <= best["gen/test/parity/high"]
    # Issue 54: the answers visibly improve, on every test prompt, by the paired test.
    assert best["gen/test/parity/n"] >= 200
    assert best["gen/test/parity"] > base["gen/test/parity"] + 0.3, board
    assert best["vs_base/test/gen/parity/p"] < 0.05, board
    adapter = tmp_path / "demo" / "best-adapter"  # mlx-lm's format: it loads and it differs
    import mlx.core as mx

    tuned, _ = mlx_lm.load(str(tmp_path / "demo" / "model"), adapter_path=str(adapter))
    base_model, _ = mlx_lm.load(str(tmp_path / "demo" / "model"))
    tokens = mx.array([[1, 5, 9, 13, 17, 21, 25, 29]])
    assert float(mx.abs(tuned(tokens) - base_model(tokens)).max()) > 1e-4
