"""``bench profile``: where one segmented step's time goes, in one process.

    python -m benchmarks profile --seq 2048 --segment-size 1 [--prefix] [--json]

Every phase (embed, forward per segment, head, backward per segment) timed with its
stages run one at a time (so the sum exceeds an overlapped step; the split is the
point), then one layer's attention and MLP blocks alone, forward and forward + backward
(``mx.vjp``). ``--prefix`` profiles the pair's split prefix-shared layout instead of two
forwards. Llama blocks only; the trainer's stages on any shape: ``bench train --profile``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import mlx.core as mx

from benchmarks.bench_args import parse
from benchmarks.bench_model import build_model, pair_batch
from benchmarks.memory_bench import step_fn


def profile(a: argparse.Namespace) -> dict[str, Any]:
    """Phase times of one step, then one layer's blocks alone (module docstring)."""
    from engine.host.inflight import observe_phases

    model, stack = build_model(a)
    k = a.segment_size or 1
    batch = pair_batch(a, shared=a.prefix)
    step = step_fn(f"seg{k}", model, stack, batch, a.head_chunk, a.inflight)
    mx.eval(step())  # warm-up
    marks: list[tuple[str, float]] = []
    with observe_phases(lambda phase: marks.append((phase, time.perf_counter()))):
        t0 = time.perf_counter()
        mx.eval(step())
    starts = [t0] + [t for _, t in marks[:-1]]
    phases = [{"phase": name, "ms": (t - s) * 1e3}
              for (name, t), s in zip(marks, starts, strict=True)]
    return {"phases": phases, "blocks": _block_times(stack, a)}


def _block_times(stack, a: argparse.Namespace) -> list[dict[str, Any]]:
    """One layer's attention and MLP (each with its norm), forward and forward+backward."""
    layer = stack.layers[0]
    x = mx.random.normal((2, a.seq, a.hidden), key=mx.random.key(1)).astype(getattr(mx, a.dtype))
    blocks = {"attention": lambda h: layer.self_attn(layer.input_layernorm(h), "causal", None),
              "mlp": lambda h: layer.mlp(layer.post_attention_layernorm(h)),
              "layer": lambda h: layer(h, "causal", None)}
    rows = []
    for name, fn in blocks.items():
        def both(h, fn=fn):
            return mx.vjp(fn, [h], [mx.ones_like(h)])
        for kind, run in (("fwd", fn), ("fwd+bwd", both)):
            mx.eval(run(x))
            t0 = time.perf_counter()
            for _ in range(a.repeats):
                mx.eval(run(x))
            rows.append({"block": name, "pass": kind,
                         "ms": (time.perf_counter() - t0) / a.repeats * 1e3})
    return rows


def _print_profile(result: dict[str, Any]) -> None:
    total = sum(p["ms"] for p in result["phases"])
    for p in result["phases"]:
        print(f"{p['phase']:>16}  {p['ms']:9.2f} ms  {100 * p['ms'] / total:5.1f}%")
    print(f"{'sum':>16}  {total:9.2f} ms")
    for b in result["blocks"]:
        print(f"{b['block'] + ' ' + b['pass']:>20}  {b['ms']:9.3f} ms")


def main(argv: list[str]) -> int:
    a = parse(argv, "profile", __doc__)
    result = profile(a)
    if a.json:
        print(json.dumps({"config": vars(a), "device": str(mx.default_device()), **result}))
    else:
        _print_profile(result)
    return 0
