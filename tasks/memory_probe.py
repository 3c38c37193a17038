"""``segment_size: auto``: probe each distinct model/shape once (cached), then pick per trial.

A probe is one Ray task on the trials' own placement (so it measures the machine the trial
will run on), in a fresh process, running real steps at every candidate segment size
(``engine/probe.py``). Results are cached in ``<sweep>/probes.json`` under a key of the
model, the data fingerprint and every setting that changes a step's memory; a trial then
takes the largest size whose peak, plus 10% headroom, fits ``memory_budget_gb``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from engine.adapters import atomic_write_text
from engine.probe import largest_fitting, probe_steps
from tasks.placement import Placement
from tasks.sweep_spec import SpecError

# Peaks measured with inflight 2 vary a few percent run to run (two stages overlap as the
# device's timing allows): a size must fit with this headroom.
AUTO_HEADROOM = 1.10
# TrainConfig fields that change what one step holds in memory.
MEMORY_FIELDS = ("batch_size", "lora_rank", "lora_keys", "lora_layers", "lora_dropout",
                 "head_chunk", "prefix_share", "prefix_attention", "inflight", "pad_multiple",
                 "nll_span", "loss", "seed")


def candidate_sizes(model: str) -> list[int]:
    """0 (plain) and powers of two below the model's layer count."""
    config = Path(model) / "config.json"
    layers = json.loads(config.read_text()).get("num_hidden_layers", 32) if config.exists() \
        else 32
    return [0] + [2**i for i in range(layers.bit_length()) if 2**i < layers]


def probe_key(config: dict[str, Any], fingerprint: str) -> str:
    body = {k: config.get(k) for k in MEMORY_FIELDS}
    body.update(model=config["model"], data=fingerprint)
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _run_probe(config: dict[str, Any], sizes: list[int]) -> dict[int, float]:
    from engine.config import TrainConfig

    cfg = TrainConfig().replace(**{**config, "segment_size": 0})
    rows = probe_steps(cfg, [{"segment_size": k} for k in sizes])
    # A size that failed (out of memory under the limit) fits no budget.
    return {int(r["segment_size"]): float(r.get("peak_gb", float("inf"))) for r in rows}


def per_rank(config: dict[str, Any], ranks: int) -> dict[str, Any]:
    """The config one rank of a ``ranks`` gang trains: its share of every batch."""
    if ranks == 1:
        return config
    from engine.config import TrainConfig

    return {**config, "batch_size": config.get("batch_size", TrainConfig().batch_size) // ranks}


def resolve_auto(trials: list[tuple[str, dict[str, Any]]], budget_gb: float,
                 placement: Placement, fingerprint: str, cache: Path, ranks: int = 1
                 ) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, str]]:
    """Trials with every ``segment_size: auto`` replaced by the size that fits the budget,
    and, per resolved trial, the probed peaks it was chosen from (JSON, for the results).
    With ``ranks`` > 1 each rank holds a 1/ranks share of the batch: probed at that."""
    import ray

    known: dict[str, dict[str, float]] = json.loads(cache.read_text()) if cache.exists() else {}
    todo = {key: per_rank(c, ranks) for _, c in trials if c.get("segment_size") == "auto"
            and (key := probe_key(per_rank(c, ranks), fingerprint)) not in known}
    if todo:
        probe = placement.fresh_task(_run_probe)
        refs = {key: probe.remote({k: v for k, v in c.items() if k != "out"},
                                  candidate_sizes(c["model"])) for key, c in todo.items()}
        for key, ref in refs.items():
            known[key] = {str(k): v for k, v in ray.get(ref).items()}
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cache, json.dumps(known, indent=2, sort_keys=True) + "\n")
    out, notes = [], {}
    for trial_id, config in trials:
        if config.get("segment_size") == "auto":
            peaks = {int(k): v for k, v in
                     known[probe_key(per_rank(config, ranks), fingerprint)].items()}
            size = largest_fitting({k: v * AUTO_HEADROOM for k, v in peaks.items()}, budget_gb)
            if size is None:
                raise SpecError(f"trial {trial_id}: no segment size fits memory_budget_gb="
                                f"{budget_gb:g} with {AUTO_HEADROOM:.0%} of the probed peak "
                                f"(probed peaks, GB: {peaks})")
            config = {**config, "segment_size": size}
            notes[trial_id] = json.dumps({str(k): round(v, 4) for k, v in sorted(peaks.items())})
        out.append((trial_id, config))
    return out, notes
