"""Steady-state step figures of training runs, read from their metrics, side by side.

``python benchmarks/step_times.py RUN.metrics.jsonl...``: for each run, the median
tokens/s and peak memory over its train records after the first two steps (the first
steps of a process pay for kernel compilation), and each run's step time relative to the
first file's (equal tokens a step: the ratio of tokens/s). Used by
benchmarks/h200_checkpoints.sh (section dpo) on runs with ``--report-every 1``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

WARM_STEPS = 2  # steps left out: compilation and first allocations


def steady(path: Path) -> dict[str, float]:
    """Median tokens/s and peak GB of ``path``'s train records past WARM_STEPS."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("split") == "train" and r["step"] > WARM_STEPS]
    if not train:
        raise SystemExit(f"{path}: no train records past step {WARM_STEPS}")
    return {"tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in train),
            "peak_memory_gb": max(r["peak_memory_gb"] for r in train), "steps": len(train)}


def main(paths: list[str]) -> None:
    figures = {p: steady(Path(p)) for p in paths}
    first = figures[paths[0]]["tokens_per_sec"]
    for p, f in figures.items():
        print(f"{Path(p).name}: {f['tokens_per_sec']:.0f} tok/s median over {f['steps']} "
              f"steps, peak {f['peak_memory_gb']:.2f} GB, step time "
              f"{first / f['tokens_per_sec']:.3f}x the first's")


if __name__ == "__main__":
    main(sys.argv[1:])
