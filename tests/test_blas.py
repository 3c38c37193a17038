"""Linux CPU without ./run: the entry points re-execute themselves with OpenBLAS
preloaded when it is installed, and warn once with the fix when it is not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.host.blas import openblas_library

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(sys.platform != "linux", reason="Linux only")]
ROOT = Path(__file__).resolve().parents[1]
PROBE = "from engine.host.blas import openblas_loaded; print('openblas', openblas_loaded())"


def bare_env(**extra: str) -> dict[str, str]:
    """As a user's shell starts a venv's python: no preload, no check done yet."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "POMONA_BLAS_CHECKED")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


@pytest.mark.skipif(openblas_library() is None, reason="OpenBLAS is not installed here")
def test_python_m_engine_reexecutes_with_openblas(tmp_path: Path) -> None:
    """``python -m engine`` and ``pomona`` from a bare shell end up with OpenBLAS loaded and
    their own arguments intact (the help each prints is its own). A missing call at either
    entry point, a lost argv or a preload that does not reach the new process fails."""
    check = subprocess.run(
        [sys.executable, "-c", "from engine.host.blas import ensure_fast_blas; ensure_fast_blas(); "
         + PROBE], capture_output=True, text=True, env=bare_env(), cwd=tmp_path, timeout=120)
    assert check.stdout.strip() == "openblas True", check.stderr
    for cmd, own in (([sys.executable, "-m", "engine", "--help"],
                      "usage: python -m engine"),
                     ([sys.executable, "-c", "from cli.main import main; main()", "--help"],
                      "Preference fine-tuning")):
        # The dynamic loader's own log shows the preloaded library being initialised.
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120,
                             env=bare_env(LD_DEBUG="libs"))
        assert run.returncode == 0 and own in run.stdout, run.stdout[:500] + run.stderr[-2000:]
        assert "openblas-pthread" in run.stderr, cmd


def test_without_openblas_it_warns_once_and_runs_on(tmp_path: Path) -> None:
    """No library where it looks (POMONA_OPENBLAS names a missing file): one warning naming
    the package to install, no re-execution, the command still runs."""
    run = subprocess.run(
        [sys.executable, "-c", "from engine.host.blas import ensure_fast_blas; ensure_fast_blas(); "
         "ensure_fast_blas(); " + PROBE], capture_output=True, text=True, cwd=tmp_path,
        env=bare_env(POMONA_OPENBLAS=str(tmp_path / "missing.so")), timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "openblas False"
    assert run.stderr.count("libopenblas0-pthread") == 1
