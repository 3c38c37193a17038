"""A sweep: spec → trials on Ray → ``runs/<sweep>/results.parquet``; re-runs skip done work.

Trials are cached on (trial parameters, data fingerprint, code version): a re-run skips
every trial whose completed result is on disk with the same key and re-runs exactly the
ones whose data or parameters changed. Before anything starts, the cluster is checked for
the GPUs or slots the placement needs (``address="auto"`` silently starts a private
cluster when the real one is unreachable: a sweep that expects GPUs refuses to run on
none).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from tasks.sweep_spec import SpecError, SweepSpec
from tasks.trials import Placement, run_trials, write_results

CODE_VERSION = "0.1.0"  # bump when training semantics change: invalidates cached trials


def data_fingerprint(data: str) -> str:
    """The dataset manifest's fingerprint, or a hash of the data file."""
    path = Path(data)
    manifest = path / "manifest.json"
    if manifest.exists():
        return json.loads(manifest.read_text())["fingerprint"]
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    raise FileNotFoundError(f"sweep data not found: {data}")


def plan(spec: SweepSpec, out: Path) -> list[tuple[str, dict[str, Any], str]]:
    """(trial id, TrainConfig fields, cache key) for every trial of ``spec``."""
    fingerprint = data_fingerprint(spec.data)
    trials = []
    for t in spec.trials():
        if t.params.get("segment_size") == "auto":
            raise SpecError(f"trial {t.id}: segment_size: auto needs the memory probe, which "
                            "is not built yet; give sizes explicitly")
        config = {**t.params, "model": spec.model, "data": spec.data, "out": str(out / t.id)}
        key = hashlib.sha256(f"{t.id}|{fingerprint}|{CODE_VERSION}".encode()).hexdigest()[:16]
        trials.append((t.id, config, key))
    return trials


def check_cluster(placement: Placement, resources: dict[str, float]) -> int:
    """Slots the cluster offers for ``placement``; raise when it offers none."""
    if placement.resource:
        have, what = resources.get(placement.resource, 0), f"'{placement.resource}' resources"
    elif placement.gpus:
        have, what = resources.get("GPU", 0), "GPUs"
    else:
        have, what = resources.get("CPU", 0) // max(placement.cpus, 1e-9), "CPU slots"
    if have < 1:
        raise RuntimeError(f"the Ray cluster offers no {what} (it has {resources}); is this the "
                           "cluster you meant? address='auto' starts a private one when the "
                           "real head is unreachable")
    return int(have)


def previous_results(out: Path) -> dict[str, dict[str, Any]]:
    path = out / "results.parquet"
    if not path.exists():
        return {}
    return {r["trial_id"]: r for r in pq.read_table(path).to_pylist()}


def run_sweep(spec: SweepSpec, out: Path, placement: Placement | None = None,
              progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run ``spec``'s trials on the connected Ray cluster into ``out``."""
    import ray

    placement = placement or Placement()
    out = Path(out)
    trials = plan(spec, out)
    slots = check_cluster(placement, ray.cluster_resources())
    before = previous_results(out)
    done, todo = [], []
    for trial_id, config, key in trials:
        old = before.get(trial_id)
        if (old and old.get("status") == "completed" and old.get("cache_key") == key
                and (out / trial_id / "adapters.safetensors").exists()):
            done.append({**old, "skipped": True})
        else:
            todo.append((trial_id, config, key))
    if progress:
        progress(f"{len(trials)} trials: {len(done)} cached, {len(todo)} to run on "
                 f"{min(slots, spec.max_concurrent)} slot(s)")
    fresh = run_trials([(t, c) for t, c, _ in todo], placement,
                       min(slots, spec.max_concurrent),
                       time_limit_s=spec.time_limit_s) if todo else []
    keys = {t: k for t, _, k in todo}
    rows = {r["trial_id"]: r for r in done}
    rows.update({r["trial_id"]: {**r, "cache_key": keys[r["trial_id"]], "skipped": False}
                 for r in fresh})
    ordered = [rows[t] for t, _, _ in trials]
    for r, (_, config, _) in zip(ordered, trials, strict=True):
        r.update({f"param/{k}": v for k, v in config.items()
                  if k not in ("model", "data", "out")})
    write_results(ordered, out / "results.parquet")
    return ordered
