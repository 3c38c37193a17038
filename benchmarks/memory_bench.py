"""``bench memory``: peak and step time of each lever beside the plain path, in one run.

    python -m benchmarks memory --layers 16 --hidden 512 --seq 2048 [--json]

Each row runs in a fresh process (benchmarks/row_runner.py) on a random-init llama (or
``--preset e4b``) with LoRA r=16 on q/k/v/o, one ORPO pair per step (prompt:response 4:1,
both sequences ``--seq`` tokens). Rows: ``plain`` (nn.value_and_grad), ``checkpoint``
(mlx-lm's per-layer mx.checkpoint), ``segK`` (segment_size K with the bounded head,
``--head-chunk``; ``segKd``, via ``--rows``, with the dense head; ``segKp`` the pair's
split prefix-shared layout; a suffix ``:N``, as in ``seg1:1``, sets that row's
``inflight``), and ``head_dense``/``head_bounded`` (the LM head alone: loss and dL/dh over
all tokens at ``--vocab``). ``act_mb`` = peak − memory held before the step (weights,
inputs).
"""

from __future__ import annotations

import argparse
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.bench_model import pair_batch
from benchmarks.row_runner import table


def step_fn(name: str, model, stack, batch, head_chunk: int, inflight: int):
    from engine.backward.segmented import value_and_grad
    from engine.data.batch import batch_norms
    from engine.forward.prefix import pair_batch
    from engine.losses import LossSpec, pair_loss

    pairs = pair_batch(batch)
    norms, spec = batch_norms([pairs]), LossSpec()
    resp, nll = mx.array(pairs.resp_mask), mx.array(pairs.nll_mask)

    def loss_fn(lp):
        return pair_loss(lp, resp, nll, spec, norms)

    if name == "checkpoint":
        from mlx_lm.tuner.trainer import grad_checkpoint

        grad_checkpoint(stack.layers[0])
    k = int(name[3:].rstrip("dp")) if name.startswith("seg") else 0
    # Segmented rows bound the head too (its dense logits would otherwise set their peak);
    # "segKd" keeps the dense head, to tell the two levers' costs apart.
    chunk = head_chunk if k and not name.endswith("d") else 0
    return lambda: value_and_grad(model, stack, batch, loss_fn, k, chunk, inflight)


def _head_fn(name: str, stack, a: argparse.Namespace):
    from engine.model.head import bounded_head_grad, dense_logps

    n, t = 2, a.seq
    h = mx.random.normal((n, t, a.hidden), key=mx.random.key(0)).astype(getattr(mx, a.dtype))
    targets = np.random.default_rng(1).integers(0, a.vocab, (n, t)).astype(np.int32)
    mx.eval(h)

    def loss_fn(lp):
        return -lp.mean(), {}

    if name == "head_dense":
        tg = mx.array(targets)
        return lambda: mx.value_and_grad(lambda x: loss_fn(dense_logps(stack, x, tg)))(h)
    active = np.ones((n, t), bool)
    return lambda: bounded_head_grad(stack.head, h, targets, active, loss_fn, a.head_chunk,
                                     a.inflight)


def make_step(name: str, model, stack, a: argparse.Namespace):
    """A memory row's step: the LM head alone, or one ORPO step on the pair."""
    if name.startswith("head_"):
        return _head_fn(name, stack, a), {}
    shared = name.startswith("seg") and name.endswith("p")  # segKp: prefix-shared
    return step_fn(name, model, stack, pair_batch(a, shared), a.head_chunk, a.inflight), {}


def _ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    by = {r["name"]: r for r in rows}
    out: dict[str, float] = {}
    if "plain" in by:
        for r in rows:
            if r["name"] != "plain" and not r["name"].startswith("head_"):
                out[f"{r['name']}_act_vs_plain"] = r["act_mb"] / by["plain"]["act_mb"]
                out[f"{r['name']}_time_vs_plain"] = r["step_s"] / by["plain"]["step_s"]
    if "head_dense" in by and "head_bounded" in by:
        out["head_bounded_act_vs_dense"] = by["head_bounded"]["act_mb"] / by["head_dense"]["act_mb"]
    return out


def main(argv: list[str]) -> int:
    return table("memory", argv, __doc__, make_step, lambda a: [
        "plain", "checkpoint", *[f"seg{k}" for k in a.segments.split(",") if k],
        "head_dense", "head_bounded"], _ratios)
