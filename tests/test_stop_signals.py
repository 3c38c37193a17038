"""A sweep stops within seconds of SIGINT or SIGTERM, the way a script or scheduler sends
them (issue 36, item 17): running trials cancelled, results written, exit 130.

Before: ``pomona sweep`` started by a script's ``&`` inherits SIGINT ignored, so ``kill
-INT`` did nothing for minutes; SIGTERM met Ray's driver handler (``sys.exit``) and the
scheduler waited for every running trial to end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytestmark = [pytest.mark.slow]


def _trial_processes(ray_tmp: str) -> list[int]:
    """Pids of trial actors of the Ray whose session lives under ``ray_tmp``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if (b"TrialActor" in (proc / "cmdline").read_bytes()
                    and f"RAY_TMPDIR={ray_tmp}".encode() in (proc / "environ").read_bytes()):
                found.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc for leftover trials")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["int", "term"])
def test_a_huge_sweep_stops_within_seconds_of_a_signal(sig: signal.Signals, tiny_model: Path,
                                                       tiny_data: Path, tmp_path: Path) -> None:
    spec = tmp_path / "huge.yaml"
    seeds = ", ".join(str(i) for i in range(100))
    rates = ", ".join(f"{(i + 1) * 1e-5:.6g}" for i in range(100))
    spec.write_text(f"name: huge\nmodel: {tiny_model}\ndata: {tiny_data}\nmax_concurrent: 2\n"
                    "fixed: {steps: 100000, batch_size: 2, lora_rank: 4, val_every: 0, "
                    "report_every: 1}\n"
                    f"grid: {{seed: [{seeds}], learning_rate: [{rates}]}}\n")
    ray_tmp = tempfile.mkdtemp(prefix="ps", dir="/tmp")  # AF_UNIX paths: 107 bytes at most
    out = tmp_path / "out"
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled"}
    # What a shell script's `pomona sweep … &` does: the child starts with SIGINT ignored.
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "sweep", str(spec), "--out",
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.time() + 240
        while not any(p.stat().st_size for p in out.glob("*/metrics.jsonl")):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
            time.sleep(0.5)
        sent = time.time()
        proc.send_signal(sig)
        text = proc.communicate(timeout=60)[0]
        took = time.time() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, text
    assert took < 20, f"{took:.1f} s to stop\n{text}"
    assert "10,000 trials planned" in text and "interrupted" in text, text
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert rows and all(r["status"] == "cancelled" for r in rows), rows
    assert len(rows) <= 2, [r["trial_id"] for r in rows]  # no other trial was started
    assert _trial_processes(ray_tmp) == []
