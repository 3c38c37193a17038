"""A pack's trials in one Ray actor (tasks/sweep/trial.py ``TrialActor.run_pack``): one
process trains them as a pack (engine/train/pack_trainer.py), each trial's summary and
outputs apart, pulled and cleaned up by trial id; a trial that diverges fails alone."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_a_pack_actor_serves_each_trials_outputs(ray_cluster, tiny_model: Path,
                                                 tiny_data: Path, tmp_path: Path) -> None:
    """Would catch: the pack's outputs listed as one, a read or cleanup of another trial's
    files, or one diverging trial failing its pack-mate."""
    import ray

    from tasks.nodes.node_files import Bundle, pull
    from tasks.sweep.trial import TrialActor
    from tasks.sweep.trial_plan import TrialPlan

    base = {"model": str(tiny_model), "data": str(tiny_data), "steps": 3, "batch_size": 2,
            "lora_rank": 4, "val_every": 0, "report_every": 1, "seed": 1}
    plans = [TrialPlan.make("a", {**base, "out": str(tmp_path / "a")}),
             TrialPlan.make("b", {**base, "out": str(tmp_path / "b"), "learning_rate": 1e30,
                                  "grad_clip": 0.0})]
    actor = ray.remote(num_cpus=1)(TrialActor).remote()
    try:
        a, b = ray.get(actor.run_pack.remote([p.to_dict() for p in plans], [None, None]))
        assert a["status"] == "completed" and a["steps"] == 3, a.get("reason")
        assert b["status"] == "failed" and b["reason"].startswith("non_finite: step ")
        assert a["pack"] == b["pack"] and a["pack_size"] == b["pack_size"] == 2
        assert a["pid"] == b["pid"] and "outputs" not in b
        bundle = Bundle.from_dict(a["outputs"])
        pull(bundle, lambda rel, off, n: ray.get(actor.read.remote(rel, off, n, "a")),
             tmp_path / "pulled")
        assert (tmp_path / "pulled" / "adapters.safetensors").exists()
        assert Path(bundle.path).exists()
        ray.get(actor.cleanup.remote("a"))
        assert not Path(bundle.path).exists()  # its scratch folder, once pulled
    finally:
        ray.kill(actor)
