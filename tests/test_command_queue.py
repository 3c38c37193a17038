"""MLX's queue capped in every process that trains under a memory limit, and only there
(engine/command_queue.py): the CLI re-runs itself with the cap. A sweep's actors start with
it (tests/test_sweep_search.py, tests/test_gang.py); a library caller is told it is
missing (tests/test_trainer.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.command_queue import BOUNDED_MB, QUEUE_MB, queue_env

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def test_the_cap_goes_with_a_limit_and_a_set_value_is_kept() -> None:
    assert queue_env(0.0, {}) == {}
    assert queue_env(9.3, {}) == {QUEUE_MB: str(BOUNDED_MB)}
    assert queue_env(9.3, {QUEUE_MB: "16"}) == {QUEUE_MB: "16"}  # the user's own


@pytest.mark.parametrize("limit", ["0", "50"])
def test_the_cli_reruns_itself_capped_under_a_limit(limit: str, tiny_model: Path,
                                                    tiny_data: Path, tmp_path: Path) -> None:
    """``python -m engine train --memory-limit-gb`` started without the cap trains with it
    (MLX read its default at import: only a new process takes it); without a limit, not."""
    env = {k: v for k, v in os.environ.items() if k != QUEUE_MB}
    proc = subprocess.run([sys.executable, "-m", "engine", "train", "--model", str(tiny_model),
                           "--data", str(tiny_data), "--out", str(tmp_path / "run"),
                           "--steps", "1", "--batch-size", "2", "--val-every", "0",
                           "--memory-limit-gb", limit],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    capped = f"capped at {BOUNDED_MB} MB ({QUEUE_MB})" in proc.stderr
    assert capped == (limit != "0"), proc.stderr
    assert "default command buffers" not in proc.stderr
