"""``bench prefix``: two forwards against the prefix-shared forward, per prompt:response
ratio, in one run.

    python -m benchmarks prefix --seq 1024 [--ratios 1:1,4:1,16:1] [--json]

Rows: one ORPO step on ``--pairs`` pairs, ``two_forward`` vs ``shared`` (one forward
over [prompt | chosen | rejected] with two fused causal attention calls per layer) vs
``shared_mask`` (the same with one block-sparse array mask), at each prompt:response
ratio (P + R = ``--seq``), each in a fresh process (benchmarks/row_runner.py).
"""

from __future__ import annotations

import argparse
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.row_runner import table


def prefix_step(path: str, ratio: str, model, stack, a: argparse.Namespace):
    """One ORPO step, shared or two-forward, at prompt:response ``ratio`` (seq = P + R)."""
    from engine.backward.segmented import value_and_grad
    from engine.data.batch import Pair, batch_norms, make_batch
    from engine.forward.layout_policy import resolve_pad_multiple
    from engine.forward.prefix import split_prefix_batch
    from engine.losses import LossSpec, pair_loss

    num, den = (int(x) for x in ratio.split(":"))
    p = a.seq * num // (num + den)
    r = a.seq - p + 1
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(10, a.vocab, n).tolist()  # noqa: E731
    pairs = [Pair(f"bench{i}", ids(p), ids(r), ids(r)) for i in range(a.pairs)]
    pad = resolve_pad_multiple(a.pad_multiple)
    two = make_batch(pairs, "full", pad)
    attention = "mask" if path == "shared_mask" else "split"
    batch = two if path == "two_forward" else split_prefix_batch(pairs, "full", pad,
                                                                 attention=attention, two=two)
    norms, spec = batch_norms([two]), LossSpec()
    resp, nll = mx.array(two.resp_mask), mx.array(two.nll_mask)
    fn = lambda: value_and_grad(model, stack, batch,  # noqa: E731
                                lambda lp: pair_loss(lp, resp, nll, spec, norms),
                                a.segment_size, a.head_chunk, a.inflight)
    return fn, {"ratio": ratio, "path": path, "pairs": a.pairs, "prompt_tokens": p,
                "response_tokens": 2 * r}


def make_step(name: str, model, stack, a: argparse.Namespace):
    path, ratio = name.split("@")
    return prefix_step(path, ratio, model, stack, a)


def _prefix_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per ratio: shared / two-forward step time, and the target it must stay under."""
    out: dict[str, float] = {}
    by = {(r["ratio"], r["path"]): r for r in rows}
    for ratio in dict.fromkeys(r["ratio"] for r in rows):
        two = by.get((ratio, "two_forward"))
        for path in ("shared", "shared_mask"):
            shared = by.get((ratio, path))
            if two and shared:
                p, resp = shared["prompt_tokens"], shared["response_tokens"]
                out[f"{ratio}_{path}_time_vs_two_forward"] = shared["step_s"] / two["step_s"]
                out[f"{ratio}_target"] = (p + resp) / (2 * p + resp) + 0.10
                out[f"{ratio}_{path}_peak_vs_two_forward"] = shared["peak_mb"] / two["peak_mb"]
    return out


def main(argv: list[str]) -> int:
    return table("prefix", argv, __doc__, make_step, lambda a: [
        f"{p}@{r}" for r in a.ratios.split(",") for p in ("two_forward", "shared", "shared_mask")],
        _prefix_ratios)
