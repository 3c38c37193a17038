"""``segment_size: auto``: probe each distinct model/shape once (cached), then pick per trial.

A probe is one Ray task on the trials' own placement (so it measures the machine the trial
will run on), in a fresh process, running real steps at every candidate segment size
(``engine/train/probe.py``). Results are cached in ``<sweep>/probes.json`` under a key of the
model, the data fingerprint and every setting that changes a step's memory; a trial then
takes the largest size whose peak, plus 10% headroom, fits ``memory_budget_gb``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from engine.host.atomic import atomic_write_text
from engine.host.command_queue import QUEUE_MB, queue_env
from engine.model.source import layer_count
from engine.train.probe import largest_fitting, probe_steps
from tasks.eval.rewards import reward_sources
from tasks.nodes.placement import Placement
from tasks.nodes.trial_inputs import InputServer, fetched, importable
from tasks.sweep.sweep_spec import SpecError
from tasks.sweep.trial_plan import TrialPlan

# Peaks measured with inflight 2 vary a few percent run to run (two stages overlap as the
# device's timing allows): a size must fit with this headroom.
AUTO_HEADROOM = 1.10
# TrainConfig fields that change what one step holds in memory.
MEMORY_FIELDS = ("batch_size", "lora_rank", "lora_keys", "lora_layers", "lora_dropout",
                 "head_chunk", "prefix_share", "prefix_attention", "inflight", "pad_multiple",
                 "nll_span", "loss", "seed", "mlp_chunk")
# A group loss's: its rollouts' KV cache and the group forward (a pair loss has none: its
# keys are as they were).
GROUP_MEMORY_FIELDS = ("num_generations", "max_completion_length", "grpo_beta")


def candidate_sizes(model: str) -> list[int]:
    """0 (plain) and powers of two below the model's layer count (``layer_count``; 32
    where its files cannot say before the probe loads them)."""
    layers = layer_count(model) or 32
    return [0] + [2**i for i in range(layers.bit_length()) if 2**i < layers]


def probe_key(fields: dict[str, Any], fingerprint: str) -> str:
    """The probe cache's key of a trial's settings (its config's values that one rank
    trains: ``per_rank``)."""
    body = {k: fields.get(k) for k in MEMORY_FIELDS}
    body.update({k: fields[k] for k in GROUP_MEMORY_FIELDS if k in fields})
    body.update(model=fields["model"], data=fingerprint)
    queue = queue_env(fields.get("memory_limit_gb") or 0.0).get(QUEUE_MB)
    if queue:  # the process's queue cap changes its peak (engine/host/command_queue.py)
        body["queue_mb"] = queue
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _run_probe(config: dict[str, Any], sizes: list[int], inputs: dict[str, Any] | None = None
               ) -> dict[int, float]:
    """In the probe's fresh process: the peak of each segment size, from the trial's
    config as ``TrainConfig.to_dict`` sent it (its one rebuild here), on this node's
    copies of its ``inputs`` (tasks/nodes/trial_inputs.py)."""
    from engine.settings.config import TrainConfig

    config = {**config, **fetched(inputs)}
    importable(inputs)  # a python: reward's module: the probe rewards its rollouts
    rows = probe_steps(TrainConfig.from_dict(config), [{"segment_size": k} for k in sizes])
    # A size that failed (out of memory under the limit) fits no budget.
    return {int(r["segment_size"]): float(r.get("peak_gb", float("inf"))) for r in rows}


def per_rank(plan: TrialPlan, ranks: int) -> dict[str, Any]:
    """The settings one rank of a ``ranks`` gang trains (the plan's config, plain): its
    share of every batch."""
    return {**plan.config.to_dict(), "batch_size": plan.config.batch_size // ranks}


def resolve_auto(plans: list[TrialPlan], budget_gb: float, placement: Placement,
                 fingerprint: str, cache: Path, ranks: int = 1) -> list[TrialPlan]:
    """The plans with every ``segment_size`` still auto resolved to the size that fits the
    budget, each resolved one holding the probed peaks it was chosen from (JSON, for the
    results: ``TrialPlan.probed``). With ``ranks`` > 1 each rank holds a 1/ranks share of
    the batch: probed at that. A plan's config holds an auto key at its default (0: the
    plain path), which is what the probe starts from."""
    import ray

    known: dict[str, dict[str, float]] = json.loads(cache.read_text()) if cache.exists() else {}
    todo = {key: p for p in plans if "segment_size" in p.auto
            and (key := probe_key(per_rank(p, ranks), fingerprint)) not in known}
    if todo:
        files = InputServer()
        refs = {key: placement.fresh_task(_run_probe, queue_env(p.config.memory_limit_gb))
                .remote(per_rank(p, ranks),
                        candidate_sizes(p.config.model),
                        files.for_config(p.config, reward_sources(p.config.loss)))
                for key, p in todo.items()}
        for key, ref in refs.items():
            known[key] = {str(k): v for k, v in ray.get(ref).items()}
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cache, json.dumps(known, indent=2, sort_keys=True) + "\n")
    out = []
    for plan in plans:
        if "segment_size" in plan.auto:
            peaks = {int(k): v for k, v in
                     known[probe_key(per_rank(plan, ranks), fingerprint)].items()}
            size = largest_fitting({k: v * AUTO_HEADROOM for k, v in peaks.items()}, budget_gb)
            if size is None:
                raise SpecError(f"trial {plan.id}: no segment size fits memory_budget_gb="
                                f"{budget_gb:g} with {AUTO_HEADROOM:.0%} of the probed peak "
                                f"(probed peaks, GB: {peaks})")
            plan = plan.resolve({"segment_size": size}, json.dumps(
                {str(k): round(v, 4) for k, v in sorted(peaks.items())}))
        out.append(plan)
    return out
