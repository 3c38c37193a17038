"""Value and LoRA gradients of one micro-batch: plain autograd, or segment by segment.

Plain (``segment_size`` 0, dense head): ``nn.value_and_grad`` over the whole model — the
reference every other path is tested against.

Segmented (``segment_size`` k): the forward keeps only the hidden state at each segment
boundary, evaluated (so it is a leaf: MLX frees a graph once it is evaluated); the head
runs as its own vjp (dense, or bounded by ``head_chunk``); then segments run in reverse,
each an ``mx.vjp`` with respect to (boundary input, that segment's LoRA parameters) with
the incoming cotangent, evaluated in one barrier before the next. Peak memory is one
segment's activations plus the boundaries, and the gradients are exactly the plain ones.

State a layer hands to later layers (Gemma 4's shared K/V: ``Stack.donor_of``) crosses
boundaries the same way: a donor's state leaves its segment as an extra output, kept as a
leaf; a later segment takes it as an extra input; in the backward each consumer segment
returns its cotangent, summed per donor until the donor's own segment takes the sum as the
cotangent of that output.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from engine.backward.compiled import Implicit, segment_cache
from engine.data.batch import PairBatch
from engine.forward.prefix import PrefixBatch, from_pair_layout, to_pair_layout
from engine.forward.prefix_patch import layout_masks
from engine.host.inflight import InFlight, phase_done
from engine.model.arch.stack import Stack, State
from engine.model.attention import whole_scores
from engine.model.head import bounded_head_grad, dense_logps, token_logps
from engine.model.masks import Masks

LossOfLogps = Callable[[mx.array], tuple[mx.array, dict[str, mx.array]]]
Grads = dict[str, mx.array]
Result = tuple[mx.array, dict[str, mx.array], Grads]
# (last hidden state, the backward's queue) → (loss, metrics, dL/d(last hidden state))
HeadGrad = Callable[[mx.array, InFlight], tuple[mx.array, dict[str, mx.array], mx.array]]


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


def _flat(states: dict[int, State], donors: list[int]) -> list[mx.array]:
    return [a for d in donors for a in states[d]]


def _unflat(arrays: list[mx.array], donors: list[int], arity: dict[int, int]
            ) -> dict[int, State]:
    out, i = {}, 0
    for d in donors:
        out[d] = tuple(arrays[i : i + arity[d]])
        i += arity[d]
    return out


class Segment:
    """One segment's forward as a function of its primals, and its vjp: traced Python, or
    compiled once per stack (engine/backward/compiled.py)."""

    def __init__(self, stack: Stack, start: int, end: int, masks: Masks, side: list,
                 states: dict[int, State]):
        self.stack, self.start, self.end = stack, start, end
        self.masks, self.side = masks, side
        self.imports, self.exports = stack.imports(start, end), stack.exports(start, end)
        self.arity = {d: len(states[d]) for d in self.imports}
        self.inputs = {d: states[d] for d in self.imports}
        self.params = _segment_params(stack, start, end)
        self.cache = segment_cache(stack)
        self.implicit = Implicit(stack, start, end, masks, side)

    def _write(self, values: list[mx.array]) -> None:
        by_layer: dict[int, list[tuple[str, mx.array]]] = {}
        for (i, path, _), v in zip(self.params, values, strict=True):
            by_layer.setdefault(i, []).append((path, v))
        for i, items in by_layer.items():
            self.stack.layers[i].update(tree_unflatten(items))

    def _read(self) -> list[mx.array]:
        """The params the layers hold now (a later trace must not restore a past step's)."""
        held = {i: dict(tree_flatten(self.stack.layers[i].trainable_parameters()))
                for i in {i for i, _, _ in self.params}}
        return [held[i][path] for i, path, _ in self.params]

    def _outputs(self, h: mx.array, flat_state: list[mx.array], values: list[mx.array] | None,
                 masks: Masks, side: list, held: list[mx.array] | None = None
                 ) -> tuple[mx.array, list[State]]:
        """(output, exported states) of the layers holding ``values`` (None: their own),
        then holding ``held`` again (default: what they hold now)."""
        states = _unflat(flat_state, self.imports, self.arity)
        if values is not None:
            held = self._read() if held is None else held
            self._write(values)
        try:
            with whole_scores(self.end - self.start):  # its graph is evaluated alone
                h = self.stack.run(self.start, self.end, h, masks, side, states)
        finally:
            if values is not None:  # the layers hold the real params again
                self._write(held)
        return h, [tuple(states[d]) for d in self.exports]

    def _key(self, kind: str, *more: Hashable) -> tuple:
        paths = tuple((i, path) for i, path, _ in self.params)
        return (kind, self.start, self.end, paths, tuple(self.arity.items()),
                self.implicit.key(), *more)

    def _split(self, arrays: list[mx.array], n_state: int) -> tuple:
        """(h, states, params, implicit arrays, the rest) of a compiled call's inputs."""
        p = 1 + n_state + len(self.params)
        n_implicit = len(self.implicit.arrays())
        return (arrays[0], arrays[1 : 1 + n_state], arrays[1 + n_state : p],
                arrays[p : p + n_implicit], arrays[p + n_implicit :])

    def forward(self, h: mx.array, inputs: dict[int, State]
                ) -> tuple[mx.array, dict[int, State]]:
        """The segment's output and the donor states it exports."""
        flat_in = _flat(inputs, self.imports)
        plain = lambda: self._outputs(h, flat_in, None, self.masks, self.side)  # noqa: E731
        if self.cache is None:
            outs = plain()
        else:
            def make():
                def traced(*arrays: mx.array) -> list[mx.array]:
                    h, state, values, implicit, _ = self._split(list(arrays), len(flat_in))
                    with self.implicit.bound(implicit) as (masks, side):
                        return self._outputs(h, state, values, masks, side)
                return traced

            outs = self.cache.call(self._key("forward"), make,
                                   [h, *flat_in, *[p[2] for p in self.params],
                                    *self.implicit.arrays()], plain)
        out, exported = outs
        return out, dict(zip(self.exports, exported, strict=True))

    def vjp(self, h_in: mx.array, cotangent: mx.array, state_cots: dict[int, State],
            input_grad: bool) -> tuple[mx.array | None, dict[int, State], Grads]:
        """dL/dh_in and dL/d(imported states) (None / {} without ``input_grad``) and the
        segment's LoRA grads, unevaluated. Params go in as primals, then are restored."""
        n_state = sum(self.arity.values())
        flat_in = _flat(self.inputs, self.imports)
        primals = [p[2] for p in self.params]
        cots = [cotangent, *[c for d in self.exports for c in state_cots[d]]]

        def grads_of(h: mx.array, state: list[mx.array], values: list[mx.array],
                     masks: Masks, side: list, cots: list[mx.array],
                     held: list[mx.array] | None = None) -> list[mx.array]:
            def fn(*primals: mx.array) -> list[mx.array]:
                if input_grad:
                    out, exported = self._outputs(primals[0], list(primals[1 : 1 + n_state]),
                                                  list(primals[1 + n_state :]), masks, side,
                                                  held)
                else:
                    out, exported = self._outputs(h, state, list(primals), masks, side, held)
                return [out, *[a for st in exported for a in st]]

            _, vjps = mx.vjp(fn, [h, *state, *values] if input_grad else values, cots)
            return vjps

        plain = lambda: grads_of(h_in, flat_in, primals, self.masks, self.side,  # noqa: E731
                                 cots, primals)
        if self.cache is None:
            vjps = plain()
        else:
            def make():
                def traced(*arrays: mx.array) -> list[mx.array]:
                    h, state, values, implicit, cots = self._split(list(arrays), n_state)
                    with self.implicit.bound(implicit) as (masks, side):
                        return grads_of(h, state, values, masks, side, cots)
                return traced

            vjps = self.cache.call(self._key("vjp", input_grad, len(cots)), make,
                                   [h_in, *flat_in, *primals, *self.implicit.arrays(), *cots],
                                   plain)
        if input_grad:
            h_grad, d_state = vjps[0], _unflat(vjps[1 : 1 + n_state], self.imports, self.arity)
            param_grads = vjps[1 + n_state :]
        else:
            h_grad, d_state, param_grads = None, {}, vjps
        grads = {f"{self.stack.layers_prefix}.{i}.{path}": g
                 for (i, path, _), g in zip(self.params, param_grads, strict=True)}
        return h_grad, d_state, grads


def _add_state(acc: dict[int, State], more: dict[int, State]) -> None:
    """Sum consumers' cotangents per donor (a donor may feed several segments)."""
    for d, cot in more.items():
        acc[d] = cot if d not in acc else tuple(a + b for a, b in zip(acc[d], cot, strict=True))


def segmented_value_and_grad(model: nn.Module, stack: Stack, batch: PairBatch | PrefixBatch,
                             loss_of_logps: LossOfLogps, segment_size: int,
                             head_chunk: int = 0, inflight: int = 2) -> Result:
    """Loss, metrics and LoRA grads via the segmented backward (module docstring).

    A PrefixBatch runs one forward over [prompt | chosen | rejected] (engine/forward/prefix.py);
    its last hidden state is gathered into the two-forward layout before the head.
    ``inflight``: segments (and head chunks) being evaluated at once (engine/host/inflight.py).
    """
    prefix = batch if isinstance(batch, PrefixBatch) else None
    pairs = prefix.pairs if prefix else batch

    def head(h_last: mx.array, flight: InFlight) -> tuple[mx.array, dict, mx.array]:
        return _head_grad(stack, pairs, prefix, h_last, loss_of_logps, head_chunk, inflight,
                          flight)

    with layout_masks(model, batch) as masks:
        tokens = mx.array(prefix.inputs if prefix else pairs.inputs)
        return staged_value_and_grad(stack, tokens, masks, head, segment_size, inflight)


def staged_value_and_grad(stack: Stack, tokens: mx.array, masks: Masks, head: HeadGrad,
                          segment_size: int, inflight: int = 2) -> Result:
    """The segmented backward over ``tokens`` under ``masks`` (the caller holds them for
    the whole call: each segment's vjp recomputes its forward), ``head`` turning the last
    hidden state into (loss, metrics, its cotangent): the pairs' head or a group loss's."""
    ranges = segment_ranges(len(stack.layers), segment_size or len(stack.layers))
    h = stack.embed(tokens)
    side = stack.side(tokens, h, masks)
    flight = InFlight(inflight)
    flight.push(h, side)
    phase_done("embed")
    boundaries, states, segments = [h], {}, []
    for s, e in ranges:  # forward: keep only boundary states, each evaluated
        segments.append(Segment(stack, s, e, masks, side, states))
        h, exported = segments[-1].forward(h, segments[-1].inputs)
        states.update(exported)
        # Bounded in-flight evaluation: one eval for the whole forward, or async_eval
        # alone, kept every intermediate alive on CUDA (H200: 3.7x the peak).
        flight.push(h, exported)
        boundaries.append(h)
        phase_done(f"forward {s}-{e}")

    # One queue from the embedding to the last segment's backward: no stage waits for
    # the one before it to finish, and still at most ``inflight`` are queued.
    loss, metrics, cot = head(boundaries.pop(), flight)
    phase_done("head")

    grads: Grads = {}
    state_cots: dict[int, State] = {}
    # Segments below the lowest LoRA layer train nothing: the backward stops there.
    first = next(j for j, seg in enumerate(segments) if seg.params)
    for j in range(len(ranges) - 1, first - 1, -1):  # backward: one segment at a time
        seg = segments[j]
        cot, d_state, seg_grads = seg.vjp(boundaries.pop(), cot,
                                          {d: state_cots.pop(d) for d in seg.exports},
                                          input_grad=j > first)
        _add_state(state_cots, d_state)
        flight.push(*([cot] if cot is not None else []), seg_grads, d_state)
        grads.update(seg_grads)
        phase_done(f"backward {seg.start}-{seg.end}")
    # Not drained: the last stages are queued (async_eval), and the trainer queues its
    # update behind them before it waits; a caller that reads the grads waits there.
    return loss, metrics, grads


def _head_grad(stack: Stack, pairs: PairBatch, prefix: PrefixBatch | None, h_last: mx.array,
               loss_of_logps: LossOfLogps, head_chunk: int, inflight: int, flight: InFlight
               ) -> tuple[mx.array, dict[str, mx.array], mx.array]:
    """Loss, metrics and dL/d(last hidden state), dense or bounded, queued on ``flight``."""
    if head_chunk <= 0:
        targets = mx.array(pairs.targets)

        def fn(x: mx.array):
            return loss_of_logps(dense_logps(stack, to_pair_layout(x, prefix) if prefix else x,
                                             targets))

        (loss, metrics), cot = mx.value_and_grad(fn)(h_last)
        flight.push(loss, metrics, cot)
        return loss, metrics, cot
    active = (pairs.resp_mask > 0) | (pairs.nll_mask > 0)
    h_pairs = to_pair_layout(h_last, prefix) if prefix else h_last
    loss, metrics, cot = bounded_head_grad(stack.head, h_pairs, pairs.targets, active,
                                           loss_of_logps, head_chunk, inflight, flight)
    if prefix:  # the gather's vjp: prompt positions collect both branches' gradients
        cot = from_pair_layout(cot, prefix)
        flight.push(cot)
    return loss, metrics, cot


def shared_plain_value_and_grad(model: nn.Module, stack: Stack, batch: PrefixBatch,
                                loss_of_logps: LossOfLogps) -> Result:
    """``nn.value_and_grad`` over the shared forward with the dense head (no segments)."""
    targets = mx.array(batch.pairs.targets)
    with layout_masks(model, batch) as masks:
        def fn(tokens: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
            h = to_pair_layout(stack.hidden(tokens, masks), batch)
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
