"""MLX's queue capped in every process that trains under a memory limit, and only there
(engine/host/command_queue.py): the CLI re-runs itself with the cap. A sweep's actors start with
it (tests/test_sweep_search.py, tests/test_gang.py); a library caller is told it is
missing (tests/test_trainer.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.host.command_queue import QUEUE_MB, bounded_mb, queue_env

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def test_the_cap_goes_with_a_limit_and_a_set_value_is_kept() -> None:
    assert queue_env(0.0, {}) == {}
    assert queue_env(9.3, {}) == {QUEUE_MB: str(bounded_mb())}
    # Metal keeps MLX's own base-Mac default; CUDA gets the H200's measured 100 MB
    assert (bounded_mb("darwin"), bounded_mb("linux")) == (40, 100)
    assert queue_env(9.3, {QUEUE_MB: "16"}) == {QUEUE_MB: "16"}  # the user's own


# Loaded by every interpreter started with this folder on PYTHONPATH: the value each one
# started with (what MLX reads at import), one line per process.
SITECUSTOMIZE = """import os
with open(os.environ["QUEUE_LOG"], "a") as f:
    f.write(repr(os.environ.get("MLX_MAX_MB_PER_BUFFER")) + "\\n")
"""


@pytest.mark.parametrize(("cli", "config"), [("engine", None), ("cli.main", None),
                                           ("engine", "pipe")])
def test_the_cli_reruns_itself_capped_under_a_limit(cli: str, config: str | None,
                                                    tiny_model: Path, tiny_data: Path,
                                                    tmp_path: Path) -> None:
    """``python -m engine train`` and ``pomona train`` under ``--memory-limit-gb``, started
    without the cap, train in a new process started with it (MLX read its default at
    import: setting the variable in-process would do nothing). A config from a pipe cannot
    be read twice: no second process, a warning. (No limit, no cap: the bench test.)"""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "starts.txt"
    env = {k: v for k, v in os.environ.items() if k != QUEUE_MB}
    env.update(QUEUE_LOG=str(log), PYTHONPATH=os.pathsep.join(
        [str(tmp_path / "site"), str(ROOT), env.get("PYTHONPATH", "")]))
    args = ["--model", str(tiny_model), "--data", str(tiny_data), "--out",
            str(tmp_path / "run"), "--steps", "1", "--batch-size", "2", "--val-every", "0"]
    stdin = None
    if config == "pipe":  # --config /dev/stdin: the limit arrives through a pipe
        args, stdin = [*args, "--config", "/dev/stdin"], "memory_limit_gb: 50\n"
    else:
        args += ["--memory-limit-gb", "50"]
    proc = subprocess.run([sys.executable, "-m", cli, "train", *args], input=stdin,
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    starts = log.read_text().split()
    # (Without OpenBLAS preloaded a Linux CPU process re-runs itself once more first.)
    if config == "pipe":
        assert set(starts) == {"None"} and "capped at" not in proc.stderr, starts
        assert "default command buffers" in proc.stderr, proc.stderr
    else:  # the first process, then the one that trained, started with the cap
        assert starts[0] == "None" and starts[-1] == repr(str(bounded_mb())), starts
        assert f"capped at {bounded_mb()} MB ({QUEUE_MB})" in proc.stderr, proc.stderr
