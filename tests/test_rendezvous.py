"""A ring rank whose peer never starts (issue 28, item 13): MLX's ring waited forever in
``accept()`` and printed nothing. Now every rank checks in with rank 0 first
(engine/host/rendezvous.py) and, past a time limit, fails with one line naming the missing rank.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.host.rendezvous import meet

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hosts(n: int) -> list[list[str]]:
    return [[f"127.0.0.1:{free_port()}"] for _ in range(n)]


def run_ranks(ring: list[list[str]], ranks: list[int], timeout: float) -> dict[int, str]:
    """``meet`` for each of ``ranks`` on its own thread: rank → "ok" or its error line."""
    out: dict[int, str] = {}

    def one(rank: int) -> None:
        try:
            meet(ring, rank, timeout)
            out[rank] = "ok"
        except ValueError as err:
            out[rank] = str(err)

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(timeout + 15)
    return out


@pytest.mark.unit
def test_ranks_that_all_start_meet() -> None:
    """Catches a check-in that refuses a complete ring (rank 0 starting last, too)."""
    ring = hosts(3)
    assert run_ranks(ring, [2, 1, 0], timeout=10) == {0: "ok", 1: "ok", 2: "ok"}


@pytest.mark.unit
def test_a_rank_that_never_starts_is_named_on_every_rank() -> None:
    """Catches a silent wait, or a line that does not say which rank is missing."""
    ring = hosts(3)
    started = time.monotonic()
    out = run_ranks(ring, [0, 1], timeout=1.0)
    assert time.monotonic() - started < 10
    for rank in (0, 1):
        assert out[rank].startswith(f"rank {rank}: rank 2 never started (no check-in at rank "
                                    f"0, {ring[0][0]}, within 1 s)"), out
    out = run_ranks(hosts(2), [1], timeout=0.5)
    assert out[1].startswith("rank 1: rank 0 never started (nothing listens at "), out


@pytest.mark.integration
def test_train_under_a_ring_without_its_peer_fails_in_one_line(tmp_path: Path) -> None:
    """`python -m engine train` as rank 0 of two, rank 1 never launched: it hung with no
    output before (this test then runs into its own time limit)."""
    hostfile = tmp_path / "hosts.json"
    ring = hosts(2)
    hostfile.write_text(json.dumps(ring))
    env = {**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile),
           "POMONA_RANK_WAIT_S": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "engine", "train", "--model", "m", "--data",
                           "d", "--out", str(tmp_path / "o")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)
    lines = [x for x in proc.stderr.splitlines() if x.strip() and "BLAS" not in x]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: rank 0: rank 1 never started"), lines
