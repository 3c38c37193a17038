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


def _trials(model: Path, data: Path, out: Path, **more) -> list[tuple[str, dict]]:
    base = {"model": str(model), "data": str(data), "steps": 3, "batch_size": 2,
            "lora_rank": 4, "val_every": 0, "report_every": 1, "seed": 1}
    return [(name, {**base, "out": str(out / name), **extra})
            for name, extra in [("t0", {}), ("t1", {"learning_rate": 1e30, "grad_clip": 0.0}),
                                ("t2", {"batch_size": 4}), *more.items()]]


def test_a_sweep_runs_its_trials_in_packs(ray_cluster, tiny_model: Path, tiny_data: Path,
                                          tmp_path: Path) -> None:
    """`TrialRules(pack=2)`: t0 and t1 share their steps and train as one pack (one
    process), t2 (another batch size) alone, as a lone trial; t1 diverges and fails alone; each
    trial is wrapped once (its own Prefect task run in a flow), its outputs and metrics
    pulled into its own folder. Would catch: a pack's trials reported as one, a wrap
    that ends before its pack, or a pack-mate's failure spreading."""
    from tasks.nodes.placement import Placement
    from tasks.sweep.scheduler import run_trials
    from tasks.sweep.trial_rules import TrialRules

    wrapped: list[str] = []

    def wrap(trial, run):
        wrapped.append(trial.id)
        return run()

    rows = run_trials(_trials(tiny_model, tiny_data, tmp_path), Placement(),
                      TrialRules(pack=2, max_concurrent=1), wrap=wrap)
    t0, t1, t2 = rows
    assert (t0["status"], t1["status"], t2["status"]) == ("completed", "failed", "completed")
    assert t1["reason"].startswith("non_finite: step ")
    assert t0["pack"] == t1["pack"] and "pack" not in t2 and t0["pid"] == t1["pid"] != t2["pid"]
    assert t0["pack_size"] == 2 and sorted(wrapped) == ["t0", "t1", "t2"]
    for name in ("t0", "t2"):
        assert (tmp_path / name / "adapters.safetensors").exists()
        assert (tmp_path / name / "metrics.jsonl").read_text().count('"split": "train"') == 3


def test_a_lost_pack_is_retried_as_a_pack(ray_cluster, tiny_model: Path, tiny_data: Path,
                                          tmp_path: Path) -> None:
    """The pack's process killed as it starts: both of its trials retried together in a
    fresh one, each completed on attempt 2 with its metrics once. Would catch: a lost
    pack failing its trials, or a retry that duplicates a trial's metric lines."""
    import os
    import signal

    from tasks.nodes.placement import Placement
    from tasks.sweep.scheduler import run_trials
    from tasks.sweep.trial_rules import TrialRules

    killed: list[int] = []

    def on_event(kind: str, summary: dict) -> None:
        if kind == "running" and summary["attempt"] == 0 and not killed:
            killed.append(summary["pid"])
            os.kill(summary["pid"], signal.SIGKILL)

    trials = [t for t in _trials(tiny_model, tiny_data, tmp_path) if t[0] != "t1"][:1]
    trials.append(("t3", {**trials[0][1], "out": str(tmp_path / "t3"), "learning_rate": 3e-4}))
    rows = run_trials(trials, Placement(), TrialRules(pack=2, retry_delay_s=0.5),
                      on_event=on_event)
    assert killed and [r["status"] for r in rows] == ["completed", "completed"], rows
    assert [r["attempts"] for r in rows] == [2, 2] and rows[0]["pack"] == rows[1]["pack"]
    for name in ("t0", "t3"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == len(set(lines))  # each record once: none from the lost attempt
        assert sum('"split": "train"' in line for line in lines) == 3


def test_a_packed_sweep_packs_only_its_uncached_trials(ray_cluster, tiny_model: Path,
                                                       tiny_data: Path, tmp_path: Path) -> None:
    """`pack: 3` over two learning rates trains them as one pack; the grid widened to three
    trains only the new one (alone), the two cached trials untouched. Would catch:
    a cached trial re-trained for its pack-mates, or the spec's pack never reaching the
    scheduler."""
    from tasks.sweep.run import run_sweep
    from tasks.sweep.spec_file import parse_spec

    spec = {"name": "packed", "model": str(tiny_model), "data": str(tiny_data), "pack": 3,
            "fixed": {"steps": 2, "batch_size": 2, "lora_rank": 4, "val_every": 0},
            "grid": {"learning_rate": [1e-3, 2e-3]}}
    out = tmp_path / "sweep"
    first = run_sweep(parse_spec(spec), out)
    assert [r["status"] for r in first] == ["completed"] * 2
    assert first[0]["pack"] == first[1]["pack"] and first[0]["pack_size"] == 2
    stamps = {r["trial_id"]: (out / r["trial_id"] / "adapters.safetensors").stat().st_mtime_ns
              for r in first}
    again = run_sweep(parse_spec({**spec, "grid": {"learning_rate": [1e-3, 2e-3, 3e-3]}}),
                      out)
    trained = [r for r in again if not r.get("skipped")]
    assert len(again) == 3 and len(trained) == 1 and "pack" not in trained[0]  # alone
    assert {t: (out / t / "adapters.safetensors").stat().st_mtime_ns for t in stamps} == stamps
