"""The real trainer under named configurations, side by side in one process and run.

    pomona bench train --preset e4b --seq 2048 --row plain --row levers [--profile]
    pomona bench train --preset e4b --quantize 4 --seq 8192 --mlp-chunk 1024 \\
        --row levers --row levers,memory_limit_gb=9.3

A row is a base and TrainConfig overrides: ``plain`` (levers off: segment_size 0,
head_chunk 0, mlp_chunk 0, prefix_share off: mlx-lm's two forwards, dense logits, one
``nn.value_and_grad``) or ``levers`` (this command's --segment-size, --head-chunk,
--mlp-chunk, --prefix-share, --memory-limit-gb), then ``,field=value`` for any TrainConfig
field. Each row is ``engine.train.trainer.train`` on the same model and pairs (``--preset``: a
published shape with random weights, benchmarks/shapes.py), every check on; step time is
the median over the steps after ``--warmup``, peak MLX's over those steps. Ratios: each
row's step time and peak against the first row's. ``--profile`` adds each row's stage
split (benchmarks/phase_profile.py).

``,env.NAME=VALUE`` sets an environment variable for the row: MLX reads some once per
process (``MLX_MAX_MB_PER_BUFFER``, ``MLX_MAX_OPS_PER_BUFFER``: how far the host may queue
ahead of the device), so when any row sets one, every row runs in its own process
(``python -m benchmarks train ... --row SPEC --one-row``), the model and pairs shared. A
row with ``memory_limit_gb`` starts as ``pomona train`` re-runs itself under a limit, with
MLX's queue capped (engine/host/command_queue.py), so it has its own process too.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

PLAIN = {"segment_size": 0, "head_chunk": 0, "mlp_chunk": 0, "prefix_share": "off",
         "memory_limit_gb": 0.0}


def row_fields(spec: str, a: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig fields row ``spec`` sets (module docstring), or ValueError naming
    it: checked for every row before any model is built."""
    from engine.settings.config import TrainConfig, coerce

    base, *changes = spec.split(",")
    if base not in ("plain", "levers"):
        raise ValueError(f"--row {spec}: starts with plain or levers, got {base!r}")
    fields = dict(PLAIN) if base == "plain" else {
        "mlp_chunk": a.mlp_chunk, "memory_limit_gb": a.memory_limit_gb}
    for change in changes:
        if change.startswith("env."):  # the row's process environment (row_env)
            continue
        name, eq, value = change.partition("=")
        if not eq or name not in TrainConfig.__dataclass_fields__:
            raise ValueError(f"--row {spec}: {change!r} is not FIELD=VALUE of a TrainConfig "
                             "field")
        fields[name] = coerce(name, yaml.safe_load(value))  # as a spec reads it: false, 2
    return fields


def row_env(spec: str) -> dict[str, str]:
    """The environment variables row ``spec`` sets (``env.NAME=VALUE`` items)."""
    items = [c[len("env."):].partition("=") for c in spec.split(",")[1:] if c.startswith("env.")]
    bad = [name for name, eq, _ in items if not eq or not name]
    if bad:
        raise ValueError(f"--row {spec}: env.NAME=VALUE, got env.{bad[0]}")
    return {name: value for name, _, value in items}


def process_env(spec: str, a: argparse.Namespace) -> dict[str, str]:
    """What row ``spec``'s process starts with: the queue cap a run under its memory limit
    gets from the CLIs (engine/host/command_queue.py), then its ``env.`` items."""
    from engine.host.command_queue import queue_env

    return {**queue_env(row_fields(spec, a)["memory_limit_gb"]), **row_env(spec)}


def run_rows(a: argparse.Namespace, argv: list[str], model: Path, data: Path, work: Path
             ) -> list[dict[str, Any]]:
    """Every row, here in turn, or each in its own process when any starts with its own
    environment (``process_env``)."""
    specs = a.row or ["plain", "levers"]
    if a.one_row or not any(process_env(s, a) for s in specs):
        return [run_row(spec, a, model, data, work) for spec in specs]
    return [child_row(spec, argv, work, process_env(spec, a)) for spec in specs]


def child_row(spec: str, argv: list[str], work: Path, env: dict[str, str]) -> dict[str, Any]:
    """Row ``spec`` in a fresh ``python -m benchmarks train`` with ``env`` added; a row
    that dies is a row saying so."""
    kept, skip = [], False
    for arg in argv:  # the command's own rows, folder and output form are the parent's
        if skip:
            skip = False
        elif arg in ("--row", "--work"):
            skip = True
        elif arg not in ("--json", "--one-row") and not arg.startswith(("--row=", "--work=")):
            kept.append(arg)
    cmd = [sys.executable, "-m", "benchmarks", "train", *kept, "--row", spec, "--work",
           str(work), "--json", "--one-row"]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, **env})
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
        return {"name": spec, "error": f"exit {proc.returncode}: {last}"}
    [row] = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    return row


def row_config(spec: str, a: argparse.Namespace, model: Path, data: Path, work: Path):
    """Row ``spec``'s TrainConfig on the benchmark's model and pairs, validated."""
    from benchmarks.trainer_timing import bench_config

    slug = spec.replace(",", "_").replace("=", "-")
    cfg = bench_config(a, model, data, work).replace(out=str(work / "runs" / slug),
                                                     **row_fields(spec, a))
    cfg.validate()
    return cfg


def run_row(spec: str, a: argparse.Namespace, model: Path, data: Path, work: Path
            ) -> dict[str, Any]:
    """One trainer run of row ``spec``: its steady step, tokens/s and peak."""
    import mlx.core as mx

    from benchmarks.phase_profile import profile
    from benchmarks.trainer_timing import timed_train

    cfg = row_config(spec, a, model, data, work)
    t = timed_train(cfg, a.warmup, 2 * (a.seq + 1) * a.pairs)
    row = {"name": spec, **t, "tokens_per_s": 2 * a.seq * a.pairs / t["step_s"],
           "pid": os.getpid(), "env": process_env(spec, a)}
    gc.collect()
    mx.clear_cache()
    if a.profile:
        row["profile"] = profile(cfg, a.profile_repeats)
        gc.collect()
        mx.clear_cache()
    return row


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each row's step time and peak over the first row's (rows that ran)."""
    ran = [r for r in rows if "error" not in r]
    if not ran:
        return {}
    first = ran[0]
    return {r["name"]: {"step": r["step_s"] / first["step_s"],
                        "peak": r["peak_gb"] / first["peak_gb"]} for r in ran}


def against_first(row: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, float]:
    """``row``'s step time and peak over the first row that ran."""
    first = next(r for r in rows if "error" not in r)
    return {"step": row["step_s"] / first["step_s"], "peak": row["peak_gb"] / first["peak_gb"]}


def host() -> dict[str, Any]:
    """The machine the rows ran on: a segmented step is built and queued by the host, so
    a slower or busier CPU slows it where plain autograd's one graph does not notice."""
    import os
    import platform

    import mlx.core as mx

    cpu = platform.processor()
    try:
        names = [ln.split(":", 1)[1].strip()
                 for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return {"cpu": cpu, "cpus": os.cpu_count(), "load_avg": list(os.getloadavg()),
            "device": str(info.get("device_name", mx.default_device()))}


def report(a: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Print the rows (one JSON object with ``--json``)."""
    against = ratios(rows)
    if a.json:
        print(json.dumps({"config": vars(a), "host": host(), "rows": rows,
                          "vs_first": against}))
        return
    for r in rows:
        if "error" in r:
            print(f"{r['name']:>28}  {r['error']}")
            continue
        rel = against_first(r, rows)  # by the row itself: a name may come twice
        print(f"{r['name']:>28}  {r['step_s'] * 1e3:8.1f} ms/step  "
              f"{r['tokens_per_s'] / 1e3:6.2f}k tok/s  peak {r['peak_gb']:6.2f} GB  "
              f"step {rel['step']:.3f}x  peak {rel['peak']:.3f}x the first")
        print(" " * 30 + "  ".join(f"{k} {v:.1f} ms" for k, v in r["phases_ms"].items()))
        if "profile" in r:
            print(" " * 30 + "profile: " + "  ".join(
                f"{k} {v:.1f} ms" for k, v in r["profile"]["ms"].items()))
            for label, key, unit in (("host", "host_ms", "ms"), ("peaks", "peak_gb", "GB")):
                if r["profile"][key]:  # plain autograd has no stages to split
                    print(" " * 30 + f"{label}: " + "  ".join(
                        f"{k} {v:.2f} {unit}" for k, v in r["profile"][key].items()))


def model_dir(a: argparse.Namespace, work: Path) -> Path:
    """The preset's model in ``work`` (written once; shapes.write_shape)."""
    from benchmarks.shapes import write_shape

    model = work / "model"
    if not (model / "config.json").exists():
        write_shape(a.preset, model, a.dtype, a.quantize or None, a.preset_layers)
    return model
