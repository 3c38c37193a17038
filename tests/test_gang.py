"""A trial as a gang of ranks (``ranks_per_trial``) on a real local Ray: the ranks join one
MLX ring, train one adapter together, and a rank killed mid-trial retries the whole gang."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.host.command_queue import bounded_mb
from tasks.nodes.placement import Placement
from tasks.sweep.scheduler import run_trials
from tasks.sweep.trial_rules import TrialRules

pytestmark = [pytest.mark.slow, pytest.mark.long]  # conftest.py: scheduled first


def _trial(model: Path, data: Path, out: Path, name: str, **extra) -> tuple[str, dict]:
    return (name, {"model": str(model), "data": str(data), "out": str(out / name), "steps": 3,
                   "batch_size": 4, "lora_rank": 4, "learning_rate": 1e-3, "val_every": 0,
                   "report_every": 1, "seed": 0, **extra})


def test_a_gang_of_two_trains_one_adapter_as_one_process_would(ray_cluster, tiny_model,
                                                                tiny_data, tmp_path) -> None:
    """Two ranks in two Ray actors, one placement group: the trial completes once, rank 0's
    adapter equals a one-process run on the same batches (the ring really summed: a gang
    whose ranks trained alone would have half-batch gradients), and the summary says how
    many ranks and which processes. Catches a missing rank offset or hostfile."""
    events: list[tuple[str, dict]] = []
    # Under a memory limit (50 GiB: no number changes) every rank starts with MLX's queue
    # capped, as a one-actor trial does (engine/host/command_queue.py).
    gang = run_trials([_trial(tiny_model, tiny_data, tmp_path, "gang", memory_limit_gb=50.0)],
                      Placement(), TrialRules(ranks_per_trial=2),
                      on_event=lambda kind, s: events.append((kind, s)))
    one = run_trials([_trial(tiny_model, tiny_data, tmp_path, "one")], Placement())
    assert gang[0]["status"] == one[0]["status"] == "completed", gang[0].get("reason")
    assert gang[0]["world_size"] == 2 and gang[0]["rank"] == 0 and len(gang[0]["hosts"]) == 2
    running = [s for k, s in events if k == "running"]
    assert len(running) == 1 and len(set(running[0]["pids"])) == 2
    assert running[0]["mlx_queue_mb"] == str(bounded_mb())
    summary = json.loads((tmp_path / "gang" / "summary.json").read_text())
    assert summary["world_size"] == 2 and sum(summary["rank_pairs"]) == 3 * 4
    assert summary["rank_pairs"] == [6, 6]
    a = mx.load(str(tmp_path / "gang" / "adapters.safetensors"))
    b = mx.load(str(tmp_path / "one" / "adapters.safetensors"))
    for k in b:
        err = np.linalg.norm(np.array(a[k]) - np.array(b[k])) / np.linalg.norm(np.array(b[k]))
        assert err <= 1e-5, (k, err)


def test_a_rank_killed_mid_trial_retries_the_gang(ray_cluster, tiny_model, tiny_data,
                                                  tmp_path) -> None:
    """Rank 1's process is killed while the trial runs: rank 0 would wait in the ring
    forever, so the gang is killed and the trial retried, and the retry completes."""
    killed: list[int] = []
    metrics = tmp_path / "t" / "metrics.jsonl"

    def kill_once_training(pid: int) -> None:  # mid-trial: after rank 0's first report
        deadline = time.time() + 120
        while time.time() < deadline and not (metrics.exists() and metrics.read_text()):
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)

    def on_event(kind: str, s: dict) -> None:
        if kind == "running" and not killed:
            killed.append(s["pids"][1])
            threading.Thread(target=kill_once_training, args=(s["pids"][1],)).start()

    events: list[str] = []
    rows = run_trials([_trial(tiny_model, tiny_data, tmp_path, "t", steps=60)], Placement(),
                      TrialRules(ranks_per_trial=2, retry_delay_s=0.5),
                      on_event=lambda k, s: (events.append(k), on_event(k, s)))
    assert killed and rows[0]["status"] == "completed", rows[0].get("reason")
    assert rows[0]["attempts"] == 2 and "lost" in events and "retry" in events


@pytest.mark.unit  # a pure function: the fast tier runs it
def test_spec_refuses_a_batch_the_ranks_cannot_split() -> None:
    """Before any rank starts: every batch size a trial may get must split over the ranks,
    and the cluster must hold one gang."""
    from tasks.sweep.run import check_cluster
    from tasks.sweep.spec_file import parse_spec
    from tasks.sweep.sweep_spec import SpecError

    base = {"name": "g", "model": "m", "data": "d", "ranks_per_trial": 2}
    assert parse_spec({**base, "fixed": {"batch_size": 4}}).ranks_per_trial == 2
    for extra, where in (({"fixed": {"batch_size": 3}}, "fixed.batch_size=3"),
                         ({"grid": {"batch_size": [4, 6, 5]}}, "grid.batch_size=5"),
                         ({"space": {"batch_size": {"int": [2, 8]}}}, "space.batch_size"),
                         ({"ranks_per_trial": 3}, "batch_size (default)=4")):
        with pytest.raises(SpecError, match=f"{re.escape(where)}.*ranks_per_trial"):
            parse_spec({**base, **extra})
    with pytest.raises(RuntimeError, match=r"one trial needs 4 GPUs .* offers 2"):
        check_cluster(Placement(gpus=1), {"CPU": 8.0, "GPU": 2.0}, ranks=4)
    assert check_cluster(Placement(gpus=1), {"GPU": 8.0}, expected=2, ranks=4) == 2


@pytest.mark.unit
def test_gpu_gangs_meet_over_nccl_and_the_rest_over_the_ring() -> None:
    """Every rank on a CUDA GPU: NCCL's rendezvous at rank 0's address, as mlx.launch
    --backend nccl exports it (measured by hand on two H200s: docs/performance.md); CPU
    slots or any rank without CUDA: the ring hostfile, one entry per rank in rank order."""
    from tasks.sweep.gang import rank_environment, rendezvous

    places = [{"ip": "10.0.0.1", "port": 5001, "cuda": True},
              {"ip": "10.0.0.2", "port": 5002, "cuda": True}]
    nccl = rendezvous(places, gpus=True)
    assert rank_environment(nccl, 1, None) == {
        "MLX_RANK": "1", "MLX_WORLD_SIZE": "2", "NCCL_HOST_IP": "10.0.0.1", "NCCL_PORT": "5001"}
    for ring in (rendezvous(places, gpus=False),
                 rendezvous([places[0], {**places[1], "cuda": False}], gpus=True)):
        assert ring == {"backend": "ring", "hosts": [["10.0.0.1:5001"], ["10.0.0.2:5002"]]}
        assert rank_environment(ring, 0, "/tmp/h.json") == {"MLX_RANK": "0",
                                                           "MLX_HOSTFILE": "/tmp/h.json"}
