"""``bench attention``: MLX's fused attention at query:key shapes, a process per shape.

    python -m benchmarks attention --shapes 2048:2048,2047:2047 [--json]

One causal ``mx.fast.scaled_dot_product_attention`` call at query:key lengths
``--shapes``, forward alone and forward + backward — where MLX's fused kernels apply on
this device (what ``pad_multiple`` is chosen by). A shape that crashes is reported as
such: the shapes that abort the process are the finding.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import mlx.core as mx

from benchmarks.bench_args import parse
from benchmarks.row_runner import report, run_rows


def attention_row(shape: str, a: argparse.Namespace) -> dict[str, Any]:
    """Forward and forward+backward time of one causal attention call, q:k = ``shape``."""
    lq, lk = (int(x) for x in shape.split(":"))
    dtype, d = getattr(mx, a.dtype), a.hidden // a.heads
    key = mx.random.key(0)
    q = mx.random.normal((1, a.heads, lq, d), key=key).astype(dtype)
    k, v = (mx.random.normal((1, a.kv_heads, lk, d), key=key).astype(dtype) for _ in "kv")

    def attend(q, k, v):
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask="causal")
        return out.astype(mx.float32).sum()

    out: dict[str, Any] = {"name": shape, "q": lq, "k": lk}
    for label, fn in (("fwd", attend), ("fwd_bwd", mx.grad(attend, argnums=(0, 1, 2)))):
        mx.eval(fn(q, k, v))
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        for _ in range(a.repeats):
            mx.eval(fn(q, k, v))
        out[f"{label}_ms"] = (time.perf_counter() - t0) / a.repeats * 1e3
        out[f"{label}_peak_mb"] = mx.get_peak_memory() / 2**20
    return out


def main(argv: list[str]) -> int:
    a = parse(argv, "attention", __doc__)
    if a.row:
        print(json.dumps(attention_row(a.row, a)))
        return 0
    shapes = (a.shapes or "2048:2048,2047:2047,1920:2048,2048:2125").split(",")
    rows = run_rows("attention", argv, shapes, a, lambda r: (
        f"fwd {r['fwd_ms']:7.2f} ms  fwd+bwd {r['fwd_bwd_ms']:7.2f} ms  "
        f"peak {r['fwd_bwd_peak_mb']:8.1f} MB"))
    report(a, rows, {})
    return 0
