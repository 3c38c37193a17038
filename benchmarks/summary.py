"""Markdown tables from ``benchmarks/h200.sh``'s JSON files: Pomona and TRL side by side.

    python3 benchmarks/summary.py OUT_DIR

Peaks in GB (10^9 bytes): MLX's get_peak_memory, torch's max_memory_allocated.
tokens/s counts both sequences of the pair (2 × seq), for every row alike: the shared
(prefix) rows train the same pairs on fewer fed tokens, so their tokens/s is the pair
throughput a user sees, comparable with the two-forward rows and TRL's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _rows(out: Path) -> list[dict]:
    rows = []
    for f in sorted(out.glob("memory_*.json")) + sorted(out.glob("q4_[0-9]*.json")):
        doc = json.loads(f.read_text())
        seq = doc["config"]["seq"]
        for r in doc["rows"]:
            if r["name"].startswith("head_"):
                continue
            rows.append({"seq": seq, "base": _base(doc), "config": _name(r), **r})
    for f in sorted(out.glob("prefix_*.json")) + sorted(out.glob("q4_prefix_*.json")):
        doc = json.loads(f.read_text())
        seq, k = doc["config"]["seq"], doc["config"]["segment_size"]
        for r in doc["rows"]:
            path = "prefix shared (split)" if r["path"] == "shared" else "two forwards"
            rows.append({"seq": seq, "base": _base(doc),
                         "config": f"{path}, seg {k or 'off'}", **r})
    return rows


def _gb(mib: float) -> float:
    """GB (10^9 bytes), as the GPU issue's table: MLX's and torch's peaks come in MiB."""
    return mib * 2**20 / 1e9


def _base(doc: dict) -> str:
    q = doc["config"].get("quantize", 0)
    names = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    return f"{q}-bit" if q else names.get(doc["config"]["dtype"], doc["config"]["dtype"])


def _name(r: dict) -> str:
    n = r["name"]
    if n == "plain":
        return "plain value_and_grad"
    if n == "checkpoint":
        return "mlx-lm per-layer checkpoint"
    head = "dense head" if n.endswith("d") else "bounded head"
    return f"seg {n[3:].rstrip('d')}, {head}"


def _trl(out: Path) -> list[dict]:
    f = out / "trl.jsonl"
    if not f.exists():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.startswith('{"')]


def tables(out: Path) -> str:
    lines = ["| seq | system | base | step ms | tokens/s | peak GB |", "|---|---|---|---|---|---|"]
    rows = _rows(out)
    for t in _trl(out):
        name = "TRL ORPOTrainer + PEFT" + (", grad. checkpointing" if t["name"] == "trl_gc" else "")
        lines.append(f"| {t['seq']} | {name} | bf16 | {t['step_s'] * 1e3:.1f} | "
                     f"{t['tokens_per_s'] / 1e3:.1f}k | {_gb(t['peak_mb']):.2f} |")
    for r in sorted(rows, key=lambda r: (r["seq"], r["base"], r["step_s"])):
        tok = 2 * r["seq"] / r["step_s"]
        lines.append(f"| {r['seq']} | Pomona: {r['config']} | {r['base']} | "
                     f"{r['step_s'] * 1e3:.1f} | {tok / 1e3:.1f}k | {_gb(r['peak_mb']):.2f} |")
    for f in sorted(out.glob("ops_*.json")):
        doc = json.loads(f.read_text())
        lines += ["", f"ops at seq {doc['config']['seq']} (batch 2):", "",
                  "| op | fwd ms | fwd+bwd ms |", "|---|---|---|"]
        lines += [f"| {r['op']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} |"
                  for r in doc["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks summary", description=__doc__)
    p.add_argument("out", type=Path, help="A benchmarks/h200.sh results folder.")
    out = p.parse_args(argv).out
    if not out.is_dir() or not any(out.glob("*.json*")):
        p.error(f"{out}: not a folder of benchmarks/h200.sh results (no JSON files)")
    print(tables(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
