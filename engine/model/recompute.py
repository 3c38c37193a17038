"""Recomputation inside a layer: pieces whose activations are rebuilt in the backward.

The segmented backward bounds memory to one segment's activations; at long sequences one
layer alone is large (Gemma 4 E4B at 10k tokens: ~7 GB for one layer's backward, most of
it the 20480-wide MLP's [T, 20480] activations and the full attention's scores). Two
pieces cut that further, both exact:

- ``recomputed(fn)``: a function whose backward recomputes it and returns all input
  gradients as views of one array (so each piece's intermediates free at once, instead of
  MLX keeping every piece's for a later gradient);
- ``chunk_mlps(stack, tokens)``: each block's MLP (position-wise in every family) runs on
  ``tokens``-row chunks, each ``recomputed``; its LoRA parameters go in as inputs, so
  their gradients flow. The MLP's forward then runs once more per step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten


def after(x: mx.array, previous: mx.array | None) -> mx.array:
    """``x``, evaluated only once ``previous`` is: MLX otherwise evaluates independent
    pieces breadth-first, every piece's intermediates alive at once (CPU, Gemma 4 E4B's
    MLP at 2048 tokens in 256-row pieces: 1148 MB unchained, 500 MB chained)."""
    return x if previous is None else mx.depends(x, previous)


def recomputed(fn: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """``fn(*arrays) → array`` whose backward recomputes ``fn`` and returns every input's
    gradient as a view of ONE array: evaluating any of them computes all, so a piece's
    intermediates and their gradients are freed together. (Separate gradients let MLX
    compute every attention block's dQ first and keep all blocks' score gradients alive
    for the dK/dV pass: O(L²) again.) Each piece's backward also waits for the previous
    one's (``after``), so one piece's backward is alive at a time."""
    f = mx.custom_function(fn)
    last: list[mx.array | None] = [None]

    @f.vjp
    def f_vjp(primals, cotangent, output):
        # One input or one output comes as a bare array, several as a tuple.
        cot = cotangent[0] if isinstance(cotangent, (list, tuple)) else cotangent
        primals = list(primals) if isinstance(primals, (list, tuple)) else [primals]
        if last[0] is not None:
            primals = list(mx.depends(primals, [last[0]]))
        _, grads = mx.vjp(fn, primals, [cot])
        # One dtype for the pack: float32 if any gradient is (LoRA factors under bf16).
        kind = mx.float32 if any(g.dtype == mx.float32 for g in grads) else grads[0].dtype
        flat = mx.concatenate([g.astype(kind).reshape(-1) for g in grads])
        last[0] = flat
        out, at = [], 0
        for g in grads:
            out.append(flat[at : at + g.size].reshape(g.shape).astype(g.dtype))
            at += g.size
        return tuple(out) if len(out) > 1 else out[0]

    return f


class ChunkedMLP:
    """Mixin swapped into an MLP instance's class (its parameter tree stays as it is)."""

    mlp_chunk = 0

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        t = x.shape[-2]
        if not self.mlp_chunk or t <= self.mlp_chunk or x.ndim != 3:
            return super().__call__(x, *args, **kwargs)
        flat = tree_flatten(self.trainable_parameters())  # once: this runs every step
        names, values = [k for k, _ in flat], [v for _, v in flat]
        base = super().__call__

        def piece(h: mx.array, *params: mx.array) -> mx.array:
            self.update(tree_unflatten(list(zip(names, params, strict=True))))
            try:
                return base(h, *args, **kwargs)
            finally:
                self.update(tree_unflatten(list(zip(names, values, strict=True))))

        run = recomputed(piece)
        outs: list[mx.array] = []
        for s in range(0, t, self.mlp_chunk):  # each chunk after the one before
            piece_in = after(x[:, s : s + self.mlp_chunk], outs[-1] if outs else None)
            outs.append(run(piece_in, *values))
        return mx.concatenate(outs, axis=1)


@contextmanager
def mlp_chunks(layers: list[nn.Module], tokens: int) -> Iterator[None]:
    """Inside: the layers' MLPs chunked at ``tokens`` (0: whole); the setting is put back
    after (``--verify`` compares a chunked run with whole MLPs)."""
    before = [getattr(getattr(layer, "mlp", None), "mlp_chunk", 0) for layer in layers]
    chunk_mlps(layers, tokens)
    try:
        yield
    finally:
        for layer, value in zip(layers, before, strict=True):
            if isinstance(getattr(layer, "mlp", None), ChunkedMLP):
                layer.mlp.mlp_chunk = value


def chunk_mlps(layers: list[nn.Module], tokens: int) -> None:
    """Run every layer's ``mlp`` on ``tokens``-row chunks, recomputed (0: whole, as built)."""
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            continue
        if not isinstance(mlp, ChunkedMLP):
            mlp.__class__ = _chunked_class(type(mlp))
        mlp.mlp_chunk = tokens


@functools.cache
def _chunked_class(cls: type) -> type:
    return type(f"Chunked{cls.__name__}", (ChunkedMLP, cls), {})
