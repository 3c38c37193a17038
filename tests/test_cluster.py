"""Two simulated nodes (ray.cluster_utils.Cluster), one slot each: trials spread over both,
and a node removed mid-trial costs that trial a retry on the other node, nothing else."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import pytest

from tasks.nodes.placement import Placement
from tasks.sweep.scheduler import run_trials
from tasks.sweep.trial_plan import TrialPlan
from tasks.sweep.trial_rules import TrialRules

pytestmark = [pytest.mark.slow, pytest.mark.long]  # conftest.py: scheduled first


@pytest.fixture()
def two_nodes(monkeypatch):
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # the shared local Ray of conftest.py's ray_cluster
        ray.shutdown()
    tmp = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # AF_UNIX socket paths: 107 bytes at most
    monkeypatch.setenv("RAY_TMPDIR", tmp)  # restored after the cluster is shut down
    os.makedirs(f"{tmp}/ray")
    if "RAY_AUTH_MODE" not in os.environ:
        monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # Faster node-death detection than production's ~20 s, so the test takes seconds.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3}})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    root = str(Path(__file__).resolve().parents[1])
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": root}},
             log_to_driver=False)
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


def test_node_removed_mid_trial_is_retried_on_the_other(two_nodes, tiny_model, tiny_data,
                                                        tmp_path) -> None:
    cluster, nodes = two_nodes
    trials = [TrialPlan.make(f"t{i}", {"model": str(tiny_model), "data": str(tiny_data),
                                       "out": str(tmp_path / f"t{i}"), "steps": 150,
                                       "batch_size": 2, "lora_rank": 4, "val_every": 0,
                                       "seed": i})
              for i in range(2)]
    running: list[dict] = []
    removed: list[str] = []
    lock = threading.Lock()

    def on_event(kind: str, summary: dict) -> None:
        if kind != "running":
            return
        with lock:
            running.append(summary)
            if len(running) == 2:  # one trial on each node: take the second node away
                victim = next(n for n in nodes if n.node_id == summary["node_id"])
                removed.append(victim.node_id)
                threading.Timer(3.0, cluster.remove_node, (victim,),
                                {"allow_graceful": False}).start()

    rows = run_trials(trials, Placement(),
                      TrialRules(max_concurrent=2, retries=3, retry_delay_s=1.0),
                      on_event=on_event)
    assert [r["status"] for r in rows] == ["completed", "completed"], rows
    first_nodes = {r["node_id"] for r in running[:2]}
    assert first_nodes == {n.node_id for n in nodes}  # spread over both
    [lost] = [r for r in rows if r["attempts"] == 2]
    assert lost["node_id"] != removed[0]  # finished on the surviving node
    assert [r["attempts"] for r in rows].count(1) == 1
    assert all((tmp_path / t.id / "adapters.safetensors").exists() for t in trials)
