"""Value and LoRA gradients of one micro-batch: plain autograd, or segment by segment.

Plain (``segment_size`` 0, dense head): ``nn.value_and_grad`` over the whole model — the
reference every other path is tested against.

Segmented (``segment_size`` k): the forward keeps only the hidden state at each segment
boundary, evaluated (so it is a leaf: MLX frees a graph once it is evaluated); the head
runs as its own vjp (dense, or bounded by ``head_chunk``); then segments run in reverse,
each an ``mx.vjp`` with respect to (boundary input, that segment's LoRA parameters) with
the incoming cotangent, evaluated in one barrier before the next. Peak memory is one
segment's activations plus the boundaries, and the gradients are exactly the plain ones.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from engine.batch import PairBatch
from engine.head import bounded_head_grad, dense_logps, token_logps
from engine.inflight import InFlight, phase_done
from engine.model import Stack
from engine.prefix import (
    PrefixBatch,
    from_pair_layout,
    install_prefix_rope,
    shared_positions,
    to_pair_layout,
)

LossOfLogps = Callable[[mx.array], tuple[mx.array, dict[str, mx.array]]]
Grads = dict[str, mx.array]
Result = tuple[mx.array, dict[str, mx.array], Grads]


def segment_ranges(n_layers: int, k: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) layer ranges of at most ``k`` layers (the last may be short)."""
    if k <= 0:
        raise ValueError(f"segment_size must be positive here, got {k}")
    return [(s, min(s + k, n_layers)) for s in range(0, n_layers, k)]


def plain_value_and_grad(model: nn.Module, stack: Stack, batch: PairBatch,
                         loss_of_logps: LossOfLogps) -> Result:
    """One ``nn.value_and_grad`` over the model's own forward with the dense head."""
    inputs, targets = mx.array(batch.inputs), mx.array(batch.targets)

    def fn(tokens: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        return loss_of_logps(token_logps(model(tokens), targets))

    (loss, metrics), grads = nn.value_and_grad(model, fn)(inputs)
    return loss, metrics, dict(tree_flatten(grads))


def _segment_params(stack: Stack, start: int, end: int) -> list[tuple[int, str, mx.array]]:
    """(layer index, path inside the layer, array) of the trainable params in a segment."""
    return [(i, path, value) for i in range(start, end)
            for path, value in tree_flatten(stack.layers[i].trainable_parameters())]


def _run_segment(stack: Stack, start: int, end: int, h: mx.array,
                 mask: str | mx.array = "causal") -> mx.array:
    for layer in stack.layers[start:end]:
        h = layer(h, mask, None)
    return h


def _segment_vjp(stack: Stack, start: int, end: int, h_in: mx.array, cotangent: mx.array,
                 mask: str | mx.array = "causal", input_grad: bool = True
                 ) -> tuple[mx.array | None, Grads]:
    """dL/dh_in (None without ``input_grad``) and the segment's LoRA grads, unevaluated.

    Params go in as primals, then are restored. The first segment's input is the
    embedding output, which trains nothing: skipping its gradient saves its matmuls.
    """
    params = _segment_params(stack, start, end)

    def write(values: list[mx.array]) -> None:
        by_layer: dict[int, list[tuple[str, mx.array]]] = {}
        for (i, path, _), v in zip(params, values, strict=True):
            by_layer.setdefault(i, []).append((path, v))
        for i, items in by_layer.items():
            stack.layers[i].update(tree_unflatten(items))

    def fn(*primals: mx.array) -> mx.array:
        h, values = (primals[0], primals[1:]) if input_grad else (h_in, primals)
        write(list(values))
        return _run_segment(stack, start, end, h, mask)

    primals = [p[2] for p in params]
    try:
        _, vjps = mx.vjp(fn, [h_in, *primals] if input_grad else primals, [cotangent])
    finally:
        write(primals)  # the layers hold the real params again
    h_grad, param_grads = (vjps[0], vjps[1:]) if input_grad else (None, vjps)
    grads = {f"{stack.layers_prefix}.{i}.{path}": g
             for (i, path, _), g in zip(params, param_grads, strict=True)}
    return h_grad, grads


def segmented_value_and_grad(model: nn.Module, stack: Stack, batch: PairBatch | PrefixBatch,
                             loss_of_logps: LossOfLogps, segment_size: int,
                             head_chunk: int = 0, inflight: int = 2) -> Result:
    """Loss, metrics and LoRA grads via the segmented backward (module docstring).

    A PrefixBatch runs one forward over [prompt | chosen | rejected] (engine/prefix.py);
    its last hidden state is gathered into the two-forward layout before the head.
    ``inflight``: segments (and head chunks) being evaluated at once (engine/inflight.py).
    """
    prefix = batch if isinstance(batch, PrefixBatch) else None
    pairs = prefix.pairs if prefix else batch
    ctx = (shared_positions(install_prefix_rope(model), prefix) if prefix
           else nullcontext("causal"))
    with ctx as mask:
        ranges = segment_ranges(len(stack.layers), segment_size or len(stack.layers))
        h = stack.embed(mx.array(prefix.inputs if prefix else pairs.inputs))
        flight = InFlight(inflight)
        flight.push(h)
        phase_done("embed")
        boundaries = [h]
        for s, e in ranges:  # forward: keep only boundary states, each evaluated
            h = _run_segment(stack, s, e, h, mask)
            # Bounded in-flight evaluation: one eval for the whole forward, or async_eval
            # alone, kept every intermediate alive on CUDA (H200: 3.7x the peak).
            flight.push(h)
            boundaries.append(h)
            phase_done(f"forward {s}-{e}")
        flight.drain()

        h_last = boundaries.pop()
        loss, metrics, cot = _head_grad(stack, pairs, prefix, h_last, loss_of_logps, head_chunk,
                                        inflight)
        del h_last
        phase_done("head")

        grads: Grads = {}
        # Segments below the lowest LoRA layer train nothing: the backward stops there.
        first = next(j for j, (s, e) in enumerate(ranges) if _segment_params(stack, s, e))
        for j in range(len(ranges) - 1, first - 1, -1):  # backward: one segment at a time
            s, e = ranges[j]
            cot, seg_grads = _segment_vjp(stack, s, e, boundaries.pop(), cot, mask,
                                          input_grad=j > first)
            flight.push(*([cot] if cot is not None else []), seg_grads)
            grads.update(seg_grads)
            phase_done(f"backward {s}-{e}")
        flight.drain()
    return loss, metrics, grads


def _head_grad(stack: Stack, pairs: PairBatch, prefix: PrefixBatch | None, h_last: mx.array,
               loss_of_logps: LossOfLogps, head_chunk: int, inflight: int
               ) -> tuple[mx.array, dict[str, mx.array], mx.array]:
    """Loss, metrics and dL/d(last hidden state), dense or bounded."""
    if head_chunk <= 0:
        targets = mx.array(pairs.targets)

        def fn(x: mx.array):
            return loss_of_logps(dense_logps(stack, to_pair_layout(x, prefix) if prefix else x,
                                             targets))

        (loss, metrics), cot = mx.value_and_grad(fn)(h_last)
        mx.eval(loss, metrics, cot)
        return loss, metrics, cot
    active = (pairs.resp_mask > 0) | (pairs.nll_mask > 0)
    h_pairs = to_pair_layout(h_last, prefix) if prefix else h_last
    loss, metrics, cot = bounded_head_grad(stack, h_pairs, pairs.targets, active,
                                           loss_of_logps, head_chunk, inflight)
    if prefix:  # the gather's vjp: prompt positions collect both branches' gradients
        cot = from_pair_layout(cot, prefix)
        mx.eval(cot)
    return loss, metrics, cot


def shared_plain_value_and_grad(model: nn.Module, stack: Stack, batch: PrefixBatch,
                                loss_of_logps: LossOfLogps) -> Result:
    """``nn.value_and_grad`` over the shared forward with the dense head (no segments)."""
    targets = mx.array(batch.pairs.targets)
    with shared_positions(install_prefix_rope(model), batch) as mask:
        def fn(tokens: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
            h = to_pair_layout(stack.hidden(tokens, mask), batch)
            return loss_of_logps(dense_logps(stack, h, targets))

        (loss, metrics), grads = nn.value_and_grad(model, fn)(mx.array(batch.inputs))
        mx.eval(loss, metrics, grads)
    return loss, metrics, dict(tree_flatten(grads))


def value_and_grad(model: nn.Module, stack: Stack, batch: PairBatch | PrefixBatch,
                   loss_of_logps: LossOfLogps, segment_size: int = 0,
                   head_chunk: int = 0, inflight: int = 2) -> Result:
    """Dispatch: plain autograd when both levers are off, else the staged path.

    ``head_chunk`` > 0 with ``segment_size`` 0 runs all layers as one segment, since the
    bounded head needs its own stage. A PrefixBatch takes the shared forward either way.
    """
    if segment_size <= 0 and head_chunk <= 0:
        if isinstance(batch, PrefixBatch):
            return shared_plain_value_and_grad(model, stack, batch, loss_of_logps)
        return plain_value_and_grad(model, stack, batch, loss_of_logps)
    return segmented_value_and_grad(model, stack, batch, loss_of_logps, segment_size,
                                    head_chunk, inflight)


def grads_to_tree(grads: Grads) -> dict:
    """Flat name → array dict as the nested tree optimizers expect."""
    return tree_unflatten(list(grads.items()))
