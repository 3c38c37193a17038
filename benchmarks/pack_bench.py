"""``pomona bench train --pack 1,2,4``: the same k trials (k = the largest pack size; their
learning rates differ, as a sweep's do) trained in packs of each size, one pack after
another, each pack as ``train_pack`` runs it (engine/train/pack_trainer.py) and a pack of
one as ``train`` does: its wall time for all k trials (set-up included: a sweep's trial
loads its model too), the tokens its first pack trains a second in its steady steps (every
adapter's: k copies of a batch are k batches trained), and the peak its steady steps
report. The ratios
are each size's time over the time of one trial after another; each packed size's
``adapter_rel_diff`` and ``loss_rel_diff`` say how far its trials ended from the same
trials alone (``parity``). One short lone run goes first, untimed, so that no row pays
for the process's first compiles. ``--mlp-chunk`` and ``--memory-limit-gb`` apply to
every trial, alone or packed.

``--pack auto --memory-limit-gb G`` runs what a sweep's ``pack: auto`` runs: the pack probe
(engine/train/pack_probe.py) over up to 8 such trials under that limit, its pick (the
largest pack whose peak stayed within G GiB), then that pack trained as ``train_pack``
trains it, its peak beside the probe's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def pack_sizes(text: str) -> list[int]:
    """``1,2,4`` as sizes (ValueError naming the flag for anything else); ``auto``: the
    sizes its probe may try."""
    if text == "auto":
        from engine.train.pack_probe import PACK_AUTO_MAX

        return list(range(1, PACK_AUTO_MAX + 1))
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--pack {text}: expected sizes such as 1,2,4") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--pack {text}: sizes are at least 1")
    return sorted(set(sizes))


def trials(a: argparse.Namespace, model: Path, data: Path, out: Path) -> list[Any]:
    """The k trials: the benchmark's config (benchmarks/trainer_timing.py) with the memory
    levers, at k learning rates."""
    from benchmarks.trainer_timing import bench_config

    # the memory levers a lab's Mac trains under (--mlp-chunk, --memory-limit-gb), shared
    # by a pack as by its trials alone
    base = bench_config(a, model, data, out).replace(mlp_chunk=a.mlp_chunk,
                                                     memory_limit_gb=a.memory_limit_gb)
    k = max(pack_sizes(a.pack))
    return [base.replace(out=str(out / f"t{i}"), learning_rate=1e-5 * (i + 1))
            for i in range(k)]


def pack_row(size: int, cfgs: list[Any], warmup: int) -> dict[str, Any]:
    """The k trials in packs of ``size``: wall time, the first pack's steady step, peak."""
    from engine.train.pack_trainer import train_pack
    from engine.train.trainer import train

    steps: list[float] = []
    peaks: list[float] = [0.0]

    class Collect:  # one adapter's records: its tokens over the pack's step time
        def on_metrics(self, record: dict[str, Any]) -> None:
            if record["split"] == "train" and record["step"] > warmup:
                steps.append(record["tokens_per_sec"] * size)
                peaks.append(record["peak_memory_gb"])  # the process's, this window

    t0 = time.perf_counter()
    for first in range(0, len(cfgs), size):
        group = cfgs[first:first + size]
        hear = [Collect()] if first == 0 else []
        if size == 1:
            train(group[0], hear)
        else:
            train_pack(group, [hear] + [[] for _ in group[1:]])
    wall = time.perf_counter() - t0
    return {"name": f"pack {size}", "pack": size, "trials": len(cfgs), "wall_s": wall,
            "tokens_per_s": statistics.median(steps) if steps else 0.0,
            "peak_gb": max(peaks)}


def parity(alone: Path, packed: Path, k: int) -> dict[str, float]:
    """How far each packed trial ended from the same trial alone: the largest relative
    difference, over its LoRA modules, of the update each makes to its weight
    (||ΔW_pack − ΔW_alone|| / ||ΔW_alone||, ΔW = A·B: B starts at zero, so its entries
    alone are no scale), and of a training loss line. Float32 on CPU: exact to 1e-5
    (tests/test_pack_trainer.py); in bf16 stacked matmuls may round otherwise."""
    import mlx.core as mx

    weights, losses = 0.0, 0.0
    for i in range(k):
        a = mx.load(str(alone / f"t{i}" / "adapters.safetensors"))
        b = mx.load(str(packed / f"t{i}" / "adapters.safetensors"))
        for name in (n for n in a if n.endswith(".lora_a")):
            other = name[:-len("lora_a")] + "lora_b"
            w, v = [(x[name].astype(mx.float32) @ x[other].astype(mx.float32))
                    for x in (a, b)]
            weights = max(weights, float(mx.linalg.norm((v - w).flatten()))
                          / max(float(mx.linalg.norm(w.flatten())), 1e-30))
        lines = [[json.loads(x) for x in (f / f"t{i}" / "metrics.jsonl").read_text().splitlines()
                  if x] for f in (alone, packed)]
        for x, y in zip(*lines, strict=False):  # the lines both have (one stopped early)
            if x["split"] == "train":
                losses = max(losses, abs(y["loss"] - x["loss"]) / max(abs(x["loss"]), 1e-30))
    return {"adapter_rel_diff": weights, "loss_rel_diff": losses}


def run(a: argparse.Namespace, model: Path, data: Path, work: Path) -> int:
    """Every size's row, side by side, and its time over one trial after another."""
    from engine.train.trainer import train

    first = trials(a, model, data, work / "warm")[0]
    train(first.replace(steps=1))  # untimed: the process's first compiles
    rows = []
    for size in pack_sizes(a.pack):
        cfgs = trials(a, model, data, work / f"pack{size}")
        rows.append(pack_row(size, cfgs, a.warmup))
    for r in rows:  # each packed adapter against the same trial alone
        if r["pack"] != 1 and 1 in pack_sizes(a.pack):
            r.update(parity(work / "pack1", work / f"pack{r['pack']}", max(pack_sizes(a.pack))))
    alone = next((r["wall_s"] for r in rows if r["pack"] == 1), None)
    ratios = {f"pack{r['pack']}_vs_alone": r["wall_s"] / alone
              for r in rows if alone and r["pack"] != 1}
    if a.json:
        print(json.dumps({"config": vars(a), "rows": rows, "ratios": ratios}))
        return 0
    for r in rows:
        drift = (f"  vs alone: adapter {r['adapter_rel_diff']:.1e}, loss "
                 f"{r['loss_rel_diff']:.1e}" if "adapter_rel_diff" in r else "")
        print(f"{r['name']:>8}  {r['trials']} trials {r['wall_s']:7.2f} s  steady "
              f"{r['tokens_per_s'] / 1e3:7.1f}k tok/s (every adapter's)  "
              f"peak {r['peak_gb']:6.2f} GB{drift}")
    for k, v in ratios.items():
        print(f"{k:>16}  {v:.2f}x")
    return 0


def run_auto(a: argparse.Namespace, model: Path, data: Path, work: Path) -> int:
    """``--pack auto``: the probe's rows and pick under ``--memory-limit-gb``, then the
    picked pack trained, its peak (GiB, as the probe's) beside the probe's."""
    from engine.train.pack_probe import largest_pack, probe_packs

    cfgs = trials(a, model, data, work / "auto")
    probed = probe_packs(cfgs, a.memory_limit_gb)
    pick = max(1, largest_pack(probed, a.memory_limit_gb))
    trained = pack_row(pick, cfgs[:pick], a.warmup)
    trained["peak_gib"] = trained["peak_gb"] * 1e9 / 2**30
    if a.json:
        print(json.dumps({"config": vars(a), "probe": probed, "pick": pick, "trained": trained}))
        return 0
    for r in probed:
        said = f"peak {r['peak_gb']:7.3f} GiB" if "peak_gb" in r else r["error"]
        print(f"probe pack {r['pack']}  {said}")
    print(f"pick {pick} within {a.memory_limit_gb:g} GiB; trained: peak "
          f"{trained['peak_gib']:.3f} GiB, {trained['wall_s']:.1f} s, steady "
          f"{trained['tokens_per_s'] / 1e3:.1f}k tok/s (every adapter's)")
    return 0
