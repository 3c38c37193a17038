"""``pack: auto``: how many trials each pack holds, measured within ``memory_budget_gb``.

The trials to run are grouped into the classes that can pack together (tasks/sweep/packs.py
``group_packs``). Each class of two or more is probed once (cached in ``<sweep>/probes.json``,
beside the segment sizes' probes): one Ray task on the trials' own placement, in a fresh
process started as its packs are (MLX's queue capped), trains packs of its first 1, 2, ...
trials (engine/train/pack_probe.py) under the budget as MLX's memory limit, as its packs
will train, heaviest first (largest LoRA rank, dropout's masks, KTO's KL pass), so any k of
the class hold no more than the k it measured. Its trials then pack up to the largest k
whose peak stayed within the budget. Unlike ``segment_size: auto``'s probe (run without a
limit, so its pick keeps 10 % headroom), this one ran under the limit its pack trains
under: the peak it saw is the one the pack holds. Where even one went over, they train
alone, under that limit, as ``pack: 1`` would.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from engine.host.atomic import atomic_write_text
from engine.host.command_queue import queue_env
from engine.train.pack_probe import PACK_AUTO_MAX, largest_pack, probe_packs
from tasks.nodes.placement import Placement
from tasks.nodes.trial_inputs import SweepFiles, fetched
from tasks.sweep.memory_probe import probe_key
from tasks.sweep.packs import group_packs
from tasks.sweep.trial_plan import TrialPlan


def heaviest_first(plans: list[TrialPlan]) -> list[TrialPlan]:
    """``plans`` with those that hold the most memory first: any k of them hold at most
    what the first k do."""
    return sorted(plans, key=lambda p: (-p.config.lora_rank, -(p.config.lora_dropout > 0),
                                        -p.config.loss.needs_kl))


def pack_key(plans: list[TrialPlan], fingerprint: str) -> str:
    """The probe cache's key of a pack of ``plans`` in this order: each one's settings
    that change a step's memory (``probe_key``), and the limit it is measured under."""
    body = ["pack", plans[0].config.memory_limit_gb,
            *(probe_key(p.config.to_dict(), fingerprint) for p in plans)]
    return "pack-" + hashlib.sha256(json.dumps(body).encode()).hexdigest()[:16]


def covers(rows: list[dict[str, Any]] | None, size: int, budget_gb: float) -> bool:
    """Whether cached probe ``rows`` of a pack of up to ``size`` answer for ``budget_gb``:
    every size measured, or the last one over this budget too (a probe under a smaller
    budget stopped before the sizes a larger one may fit)."""
    if not rows:
        return False
    last = rows[-1]
    return len(rows) >= size or "error" in last or last["peak_gb"] > budget_gb


def _run_pack_probe(configs: list[dict[str, Any]], inputs: list[dict[str, Any] | None],
                    budget_gb: float) -> list[dict[str, Any]]:
    """In the probe's fresh process: the pack probe's rows, from the trials' configs as
    ``TrainConfig.to_dict`` sent them, on this node's copies of their inputs."""
    from engine.settings.config import TrainConfig

    cfgs = [TrainConfig.from_dict({**c, **fetched(i)}) for c, i in zip(configs, inputs,
                                                                      strict=True)]
    return probe_packs(cfgs, budget_gb)


def size_packs(plans: list[TrialPlan], budget_gb: float, placement: Placement,
               fingerprint: str, cache: Path) -> tuple[dict[str, int], dict[str, str]]:
    """Each trial's largest pack (by id), and the probed peaks (GB by pack size, JSON) it
    was chosen from; a trial that packs with no other is left out of both."""
    import ray

    known: dict[str, list[dict[str, Any]]] = (json.loads(cache.read_text())
                                              if cache.exists() else {})
    classes = [heaviest_first(c) for c in group_packs(plans, len(plans)) if len(c) > 1]
    keyed = [(pack_key(c[:PACK_AUTO_MAX], fingerprint), c) for c in classes]
    todo = {key: c[:PACK_AUTO_MAX] for key, c in keyed
            if not covers(known.get(key), len(c[:PACK_AUTO_MAX]), budget_gb)}
    if todo:
        files = SweepFiles()
        refs = {key: placement.fresh_task(_run_pack_probe, queue_env(budget_gb)).remote(
            [p.config.to_dict() for p in probed],
            [files.for_config(p.config) for p in probed], budget_gb)
            for key, probed in todo.items()}
        for key, ref in refs.items():
            known[key] = ray.get(ref)
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cache, json.dumps(known, indent=2, sort_keys=True) + "\n")
    limits, notes = {}, {}
    for key, members in keyed:
        rows = known[key]
        size = max(1, largest_pack(rows, budget_gb))  # none fits: alone
        peaks = json.dumps({str(r["pack"]): round(r["peak_gb"], 4) if "peak_gb" in r
                            else r.get("error", "") for r in rows})
        for plan in members:
            limits[plan.id], notes[plan.id] = size, peaks
    return limits, notes
