"""The engine benchmarks' one row runner: each row measured in a fresh process (MLX's peak
and the process RSS are per process; mlx-lm's checkpointing patches the layer class), a
row that dies reported as such while the table goes on, and one row's measurement."""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.bench_model import build_model

# (row name, model, stack, args) → (the step to time, the row's extra fields)
MakeStep = Callable[[str, Any, Any, argparse.Namespace], tuple[Callable[[], Any], dict]]


def table(kind: str, argv: list[str], doc: str | None, make_step: MakeStep,
          default_rows: Callable[[argparse.Namespace], list[str]],
          ratios: Callable[[list[dict[str, Any]]], dict[str, float]]) -> int:
    """A kind's whole run: one ``--row`` measured here, or every row (``--rows``, else
    ``default_rows``) in its own process, then the table's ratios over the rows that ran."""
    from benchmarks.bench_args import parse

    a = parse(argv, kind, doc)
    if a.row:
        print(json.dumps(measure(a.row, a, make_step)))
        return 0
    names = a.rows.split(",") if a.rows else default_rows(a)
    rows = run_rows(kind, argv, names, a, step_line)
    report(a, rows, ratios([r for r in rows if "error" not in r]))
    return 0


def run_rows(kind: str, argv: list[str], names: list[str], a: argparse.Namespace,
             line: Callable[[dict[str, Any]], str]) -> list[dict[str, Any]]:
    """Every row of ``names`` in its own ``python -m benchmarks KIND ... --row NAME``;
    each printed by ``line`` as it lands (unless ``--json``)."""
    rows = []
    for name in names:
        proc = subprocess.run([sys.executable, "-m", "benchmarks", kind, *argv,
                               "--row", name], capture_output=True, text=True)
        if proc.returncode != 0:  # out of memory, say: the row says so, the table goes on
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
            print(f"row {name} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            rows.append({"name": name, "error": f"exit {proc.returncode}: {last}"})
        else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        if not a.json:
            print(f"{name:>13}  " + (rows[-1].get("error") or line(rows[-1])), flush=True)
    return rows


def report(a: argparse.Namespace, rows: list[dict[str, Any]], ratios: dict[str, float]
           ) -> None:
    """The rows and ratios as one JSON object (``--json``), else the ratios' lines."""
    if a.json:
        print(json.dumps({"config": {k: v for k, v in vars(a).items() if k != "row"},
                          "device": str(mx.default_device()), "rows": rows, "ratios": ratios}))
    else:
        for k, v in ratios.items():
            print(f"{k:>32}  {v:.3f}")


def step_line(r: dict[str, Any]) -> str:
    return (f"peak {r['peak_mb']:9.1f} MB  act {r['act_mb']:9.1f} MB  "
            f"rss {r['rss_mb']:9.1f} MB  step {r['step_s']:7.3f} s")


def measure(row: str, a: argparse.Namespace, make_step: MakeStep) -> dict[str, Any]:
    """Row ``row`` in this process: its model built, its step timed over ``--repeats``
    after a warm-up; peak, RSS, weights and ``act_mb`` (peak − memory held before)."""
    name, depth = row, ""
    if "@" not in row:  # "seg1:1": this row at inflight 1 (prefix rows are "path@P:R")
        name, _, depth = row.partition(":")
    if depth:
        a = argparse.Namespace(**{**vars(a), "inflight": int(depth)})
    if a.memory_limit_gb:
        mx.set_memory_limit(int(a.memory_limit_gb * 2**30))  # as TrainConfig's
    model, stack = build_model(a)
    if a.mlp_chunk and name.startswith("seg"):  # the engine's lever; baselines stay mlx-lm's
        from engine.model.recompute import chunk_mlps

        chunk_mlps(stack.layers, a.mlp_chunk)
    weights = mx.get_active_memory()
    fn, extra = make_step(name, model, stack, a)
    base = mx.get_active_memory()  # weights and inputs: what the step itself does not add
    mx.eval(fn())  # warm-up (kernel compilation, allocator)
    mx.reset_peak_memory()
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    peak = mx.get_peak_memory()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_mb = rss / 2**20 if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB here
    return {"name": row, "peak_mb": peak / 2**20, "rss_mb": rss_mb,
            "weights_mb": weights / 2**20, "act_mb": (peak - base) / 2**20,
            "step_s": float(np.median(times)), **extra}
