"""Compiled segments: a segment's forward and its vjp traced once by ``mx.compile`` and
replayed on every later step (issue 69: on an H100 compiling one layer's forward and vjp
saved 9–10 % of its time, elementwise kernels fused and the graph's building skipped).

A trace sees only its arguments, so every array a segment's layers read besides their
frozen weights goes in as an input: the boundary hidden state and imported donor states,
the trainable parameters (written into the layers for the trace, then put back), the
layout's mask arrays and positions, the ropes' offsets (engine/forward/prefix_patch.py)
and the family's side inputs (``Implicit``). What Python decides from them (the layout,
the ropes' mode, the segment, the side inputs' structure) keys the cache: one compiled
function per key, and MLX's own cache traces again only for new shapes (window routing
and whole-scores decisions follow shapes). Frozen weights are constants of the trace.

A stack compiles only once ``compile_segments`` marks it: LoRA dropout draws its masks
from a Python-side seed a replay would freeze, so a run with dropout stays uncompiled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

import mlx.core as mx

from engine.forward.prefix_patch import rope_state
from engine.model.arch.stack import Stack
from engine.model.masks import Masks

Traced = Callable[..., Any]


# Keys remembered as seen once (ragged data makes a new one per step) and functions kept.
SEEN, KEPT = 4096, 256


@dataclass
class SegmentCache:
    """A stack's compiled segment functions, by Python key and input shapes.

    A key is compiled the second time it comes: ragged batches give most steps shapes of
    their own, and a trace costs more than the uncompiled call it replaces, so a shape
    seen once runs uncompiled. ``traces`` counts traces, ``replays`` compiled calls and
    ``calls`` every call (engine/train logs the share replayed)."""

    functions: OrderedDict[Hashable, Traced] = field(default_factory=OrderedDict)
    seen: OrderedDict[Hashable, None] = field(default_factory=OrderedDict)
    traces: int = 0
    replays: int = 0
    calls: int = 0

    def call(self, key: Hashable, make: Callable[[], Traced], arrays: list[mx.array],
             plain: Callable[[], Any]) -> Any:
        """``make()``'s function, compiled for ``key`` and these shapes, on ``arrays``; or
        ``plain()`` (the uncompiled call) the first time they come."""
        self.calls += 1
        full = (key, tuple((a.shape, a.dtype) for a in arrays))
        fn = self.functions.get(full)
        if fn is None:
            if full not in self.seen:
                _remember(self.seen, full, None, SEEN)
                return plain()
            fn = mx.compile(self._counted(make()))
            _remember(self.functions, full, fn, KEPT)
        self.functions.move_to_end(full)
        self.replays += 1
        return fn(*arrays)

    def _counted(self, fn: Traced) -> Traced:
        """``fn``, counted, and let go of once traced: its closure holds the first call's
        segment (its masks, side inputs, donor states), which no replay reads. A key holds
        its shapes, so MLX never traces one function twice."""
        held: list[Traced | None] = [fn]

        def counted(*args: mx.array) -> Any:
            traced = held[0]
            if traced is None:
                raise RuntimeError("a compiled segment was traced twice for one key and "
                                   "its shapes (engine/backward/compiled.py)")
            self.traces += 1  # Python runs here only while MLX traces
            held[0] = None
            return traced(*args)
        return counted


def _remember(store: OrderedDict, key: Hashable, value: Any, most: int) -> None:
    store[key] = value
    while len(store) > most:  # the least recently used goes
        store.popitem(last=False)


_CACHES: WeakKeyDictionary[Stack, SegmentCache] = WeakKeyDictionary()


def compile_segments(stack: Stack, on: bool = True) -> None:
    """From now on ``stack``'s segments run compiled (``on``), or as traced Python."""
    if on:
        _CACHES.setdefault(stack, SegmentCache())
    else:
        _CACHES.pop(stack, None)


@contextmanager
def uncompiled(stack: Stack) -> Iterator[None]:
    """Inside: ``stack``'s segments run uncompiled; its compiled functions are kept."""
    cache = _CACHES.pop(stack, None)
    try:
        yield
    finally:
        if cache is not None:
            _CACHES[stack] = cache


def segment_cache(stack: Stack) -> SegmentCache | None:
    """The stack's compiled segments, or None where it runs uncompiled. Chunked MLPs
    (engine/model/recompute.py) run uncompiled: their recomputed pieces chain through
    state a replay cannot see (MLX refused it: an array without a primitive)."""
    if any(getattr(getattr(layer, "mlp", None), "mlp_chunk", 0) for layer in stack.layers):
        return None
    return _CACHES.get(stack)


def compiled_counts(stack: Stack) -> dict[str, int]:
    """{traces, replays, calls} of ``stack``'s compiled segments so far ({} uncompiled)."""
    cache = _CACHES.get(stack)
    return {} if cache is None else {"traces": cache.traces, "replays": cache.replays,
                                     "calls": cache.calls}


@dataclass(frozen=True)
class Implicit:
    """What layers [start, end) read besides their arguments: the layout's masks, the
    ropes' state and the side inputs, as one list of arrays and a key for the rest."""

    stack: Stack
    start: int
    end: int
    masks: Masks
    side: list[dict[str, Any]]

    def _side_items(self) -> list[tuple[int, str, Any]]:
        return [(i, k, v) for i in range(self.start, self.end)
                for k, v in sorted(self.side[i].items())]

    def arrays(self) -> list[mx.array]:
        rope = rope_state(self.stack.model)
        side = [v for _, _, v in self._side_items() if isinstance(v, mx.array)]
        return [*self.masks.arrays(), *(rope.arrays() if rope else []), *side]

    def key(self) -> tuple:
        rope = rope_state(self.stack.model)
        side = tuple((i, k, "array" if isinstance(v, mx.array) else v)
                     for i, k, v in self._side_items())
        return (self.masks.key(self.stack.windows), rope.key() if rope else None, side)

    @contextmanager
    def bound(self, arrays: list[mx.array]) -> Iterator[tuple[Masks, list[dict[str, Any]]]]:
        """Inside: the ropes read ``arrays``; yields the masks and side inputs over them."""
        rest = list(arrays)
        n_masks = len(self.masks.arrays())
        masks = self.masks.with_arrays(rest[:n_masks])
        rope = rope_state(self.stack.model)
        n_rope = len(rope.arrays()) if rope else 0
        rope_arrays, side_arrays = rest[n_masks : n_masks + n_rope], rest[n_masks + n_rope :]
        side: list[dict[str, Any]] = [{} for _ in self.side]
        for i, k, v in self._side_items():
            side[i][k] = side_arrays.pop(0) if isinstance(v, mx.array) else v
        if rope is None:
            yield masks, side
            return
        with rope.bound(rope_arrays):
            yield masks, side
