"""``pack: auto``: how many trials each pack holds, measured within ``memory_budget_gb``.

The trials to run are grouped into the classes that can pack together (tasks/sweep/packs.py
``group_packs``). Each class of two or more is probed once (cached in ``<sweep>/probes.json``,
beside the segment sizes' probes): one Ray task on the trials' own placement, in a fresh
process started as its packs are (MLX's queue capped), trains packs of 1, 2, ... copies
of a trial made to hold at least what any of the class's adapters holds (``heaviest``: a
KL-reading member's loss, the class's largest LoRA rank and dropout) under its memory
limit, as its packs will train (engine/train/pack_probe.py). Each adapter adds its own
share to a step, so k of the class hold no more than k such copies. The class then
packs in order, up to the largest k whose peak stayed within the budget
(tasks/sweep/packs.py ``group_packs`` with the limits: never across classes).
Unlike ``segment_size: auto``'s probe (run without a limit, so its pick keeps 10 %
headroom), this one ran under the limit its packs train under: the peak it saw is the one
a pack holds. Where even one went over, they train alone, under that limit, as
``pack: 1`` would.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from engine.host.atomic import atomic_write_text
from engine.host.command_queue import queue_env
from engine.settings.config import TrainConfig
from engine.train.pack_probe import PACK_AUTO_MAX, largest_pack, probe_packs
from engine.train.pack_steps import SHARED
from tasks.nodes.placement import Placement
from tasks.nodes.trial_inputs import InputServer, fetched
from tasks.sweep.memory_probe import probe_key
from tasks.sweep.packs import group_packs
from tasks.sweep.sweep_spec import SpecError
from tasks.sweep.trial_plan import TrialPlan

log = logging.getLogger("pomona.sweep")


def heaviest(plans: list[TrialPlan]) -> TrainConfig:
    """A trial of ``plans`` made to hold at least what any of their adapters holds: the
    loss of one that reads KL partners (a pack runs that pass for every adapter once one
    needs it), the largest LoRA rank and dropout (a masked copy of each adapted
    projection's input)."""
    base = next((p for p in plans if p.config.loss.needs_kl), plans[0]).config
    return base.replace(lora_rank=max(p.config.lora_rank for p in plans),
                        lora_dropout=max(p.config.lora_dropout for p in plans))


def pack_key(cfg: TrainConfig, fingerprint: str) -> str:
    """The probe cache's key of packs of ``cfg``'s copies: its settings that change a
    step's memory (``probe_key``), what a pack shares (``SHARED``: the segment size too)
    and the limit it is measured under."""
    shared = {name: str(getattr(cfg, name)) for name in SHARED}
    body = ["pack", cfg.memory_limit_gb, shared, probe_key(cfg.to_dict(), fingerprint)]
    return "pack-" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def covers(rows: list[dict[str, Any]] | None, size: int, budget_gb: float) -> bool:
    """Whether cached probe ``rows`` answer for packs of up to ``size`` under ``budget_gb``:
    every size measured, or the last one over this budget too (a probe under a smaller
    budget stopped before the sizes a larger one may fit)."""
    if not rows:
        return False
    last = rows[-1]
    return len(rows) >= size or last.get("peak_gb", 0.0) > budget_gb


def _run_pack_probe(config: dict[str, Any], size: int, inputs: dict[str, Any] | None,
                    budget_gb: float) -> list[dict[str, Any]]:
    """In the probe's fresh process: the pack probe's rows over up to ``size`` copies of
    the trial's config as ``TrainConfig.to_dict`` sent it (each its own folder, which the
    probe never writes), on this node's copies of its inputs."""
    cfg = TrainConfig.from_dict({**config, **fetched(inputs)})
    return probe_packs([cfg.replace(out=f"{cfg.out}.probe-{i}") for i in range(size)],
                       budget_gb)


def size_packs(plans: list[TrialPlan], budget_gb: float, placement: Placement,
               fingerprint: str, cache: Path) -> tuple[dict[str, int], dict[str, str]]:
    """Each trial's largest pack (by id), and the probed peaks (GiB by pack size, JSON) it
    was chosen from; a trial that packs with no other is left out of both. A probe that
    failed short of the budget is said in a warning and not cached: the next run probes
    again. Classes whose probes are one (the same memory) share it, sized to the largest."""
    known: dict[str, list[dict[str, Any]]] = (json.loads(cache.read_text())
                                              if cache.exists() else {})
    classes = [c for c in group_packs(plans, len(plans)) if len(c) > 1]
    keyed = [(pack_key(heaviest(c), fingerprint), c) for c in classes]
    todo: dict[str, list[list[TrialPlan]]] = {}
    for key, members in keyed:
        todo.setdefault(key, []).append(members)
    todo = {key: cs for key, cs in todo.items() if not covers(
        known.get(key), min(max(len(c) for c in cs), PACK_AUTO_MAX), budget_gb)}
    _probe(todo, known, budget_gb, placement, cache)
    limits, notes = {}, {}
    for key, members in keyed:
        rows = known[key]
        alone = rows[0] if rows and rows[0].get("pack") == 1 else {}
        real = all(pack_key(p.config, fingerprint) == key for p in members)
        if alone.get("peak_gb", 0.0) > budget_gb and real:  # as segment_size: auto stops
            raise SpecError(f"trials {', '.join(p.id for p in members)}: even alone a trial "
                            f"peaks at {alone['peak_gb']:.3g} GB in the pack probe, over "
                            f"memory_budget_gb={budget_gb:g}; raise it, or leave pack: auto "
                            "out")
        if alone.get("peak_gb", 0.0) > budget_gb:
            log.warning(f"warning: pack: auto: trials {', '.join(p.id for p in members)} "
                        f"train alone: their probe (the class's largest rank, dropout and "
                        f"loss at once) peaked at {alone['peak_gb']:.3g} GB alone, over "
                        f"memory_budget_gb={budget_gb:g}")
        size = max(1, largest_pack(rows, budget_gb))  # a failed probe, a blend over: alone
        peaks = json.dumps({str(r["pack"]): round(r["peak_gb"], 4) if "peak_gb" in r
                            else r.get("error", "") for r in rows})
        for plan in members:
            limits[plan.id], notes[plan.id] = size, peaks
    return limits, notes


def _probe(todo: dict[str, list[list[TrialPlan]]], known: dict[str, list[dict[str, Any]]],
           budget_gb: float, placement: Placement, cache: Path) -> None:
    """Each key of ``todo`` (its classes) probed on the placement, one fresh task each, at
    once: its rows into ``known`` and, unless a pack failed, into ``cache`` as they come."""
    import ray

    files = InputServer()
    refs = {}
    for key, cs in todo.items():
        cfg = heaviest([p for c in cs for p in c])
        refs[key] = placement.fresh_task(_run_pack_probe, queue_env(cfg.memory_limit_gb)).remote(
            cfg.to_dict(), min(max(len(c) for c in cs), PACK_AUTO_MAX),
            files.for_config(cfg), budget_gb)
    for key, ref in refs.items():
        try:
            known[key] = rows = ray.get(ref)
        except ray.exceptions.RayError as err:  # its process failed outside the probe
            known[key] = rows = [{"pack": 1, "error": str(err).splitlines()[0][:300]}]
        if "error" in rows[-1]:
            ids = ", ".join(p.id for c in todo[key] for p in c)
            log.warning(f"warning: pack: auto: a pack of {rows[-1]['pack']} of trials {ids} "
                        f"failed in its probe ({rows[-1]['error']}); they pack up to "
                        f"{max(1, largest_pack(rows, budget_gb))}")
            continue
        cache.parent.mkdir(parents=True, exist_ok=True)
        saved = json.loads(cache.read_text()) if cache.exists() else {}
        atomic_write_text(cache, json.dumps({**saved, key: rows}, indent=2, sort_keys=True)
                          + "\n")
