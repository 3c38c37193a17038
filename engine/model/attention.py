"""Attention the engine routes through mlx-lm's own attention code: split and windowed.

mlx-lm's attention modules call their module's ``scaled_dot_product_attention``;
``install_routing`` wraps it once per module (no model code is forked), so a layer called
with one of the engine's mask objects gets:

- ``SplitAttention`` (a one-row prefix-shared forward, engine/forward/prefix.py): two causal
  calls, chosen branch then rejected branch, no [L, L] array;
- ``Window`` (a sliding layer past its window): query blocks of ``size`` rows, each over
  the ≤ 2·size keys it can see, so memory and work grow with L·size, not L² (mlx-lm's
  own forward builds an [L, L] mask and, unfused, [B, H, L, L] scores: 4.3 GB per layer
  at 8k tokens on Gemma 4 E4B);
- ``Window(None)`` (a full layer): one causal call, or on a GPU with heads wider than the
  fused kernels take, query blocks, each recomputed in the backward (``full_block``).

Inside a segment (``whole_scores``) either runs as one call where its scores fit the
segment's share of ``WHOLE_SCORES_BYTES``: there blocks only add kernels the host must queue.

Any other mask passes through unchanged.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask

from engine.model.recompute import after, recomputed


@dataclass(frozen=True)
class Window:
    """Causal attention over the last ``size`` keys, or all (None); queries bottom-right."""

    size: int | None


@dataclass(frozen=True)
class SplitAttention:
    """A one-row shared forward's attention, as two fused causal calls.

    Layout: [prompt[:shared] | prompt[shared:] chosen, pads | prompt[shared:] rejected,
    pads], the second branch starting at ``first``. Queries [0, first) attend causally over
    keys [0, first); queries [first, L) over keys [0, shared) ++ [first, L) (causal, aligned
    bottom-right). With ``pad_multiple`` m, ``shared`` and ``first`` are multiples of m and
    so is L: on CUDA every call keeps MLX's fused attention, forward and backward (a
    prompt tail of < m tokens runs in both branches instead). Pads only precede other pads,
    so they never reach a real token. No array mask is built. A sliding layer's
    ``window`` counts in each branch's own (contiguous) positions.
    """

    shared: int
    first: int
    chosen: int  # fed tokens of each branch after the shared prefix (pads excluded)
    rejected: int
    window: int | None = None


@functools.cache
def partition(cuts: tuple[int, ...]):
    """x [B, H, L, D] → its consecutive pieces along L, cut at ``cuts``.

    A slice's vjp is a zero-fill plus an update of the whole array, per slice; pieces
    that tile the array have one concatenation as their vjp. Per layer and stage that is
    a few kernels instead of dozens (docs/performance.md, the 2k prefix rows).
    """
    bounds = [0, *cuts, None]

    @mx.custom_function
    def pieces(x: mx.array) -> tuple[mx.array, ...]:
        return tuple(x[:, :, lo:hi] for lo, hi in itertools.pairwise(bounds))

    @pieces.vjp
    def pieces_vjp(primals, cotangents, outputs):
        return mx.concatenate(list(cotangents), axis=2)

    return pieces


# Full (non-sliding) layers whose head is too wide for MLX's fused kernels (cuDNN: head
# dim ≤ 128) would materialise [B, H, L, L] scores; they attend in query blocks of this
# many rows instead, each recomputed in the backward (Gemma 4's 512-wide global heads).
FUSED_HEAD_DIM, FULL_BLOCK = 128, 512
# Sliding layers attend in blocks of at most this many query rows (a 4096-token window in
# one block would hold 4096 × 8192 scores per head).
SLIDING_BLOCK = 512
# A segment's attention calls whose [B, H, Lq, Lk] scores (counted as float32) fit this
# budget, split over its layers, run unblocked: there blocks and their recompute only add
# kernels, and a segmented step at short lengths is bound by the host queueing them (Gemma
# 4 E4B, one 2k pair on an H200: docs/performance.md). Unfused attention (Metal and CPU in
# training, CUDA past head dim 128) keeps a call's scores for the backward, so the budget
# holds only inside a segment, whose graph is evaluated alone (``whole_scores``); a graph
# over the whole model (plain autograd) blocks as before. At 8k a layer's are 2 GiB.
WHOLE_SCORES_BYTES = 256 * 2**20
_budget: ContextVar[int] = ContextVar("whole_scores_budget", default=0)


@contextmanager
def whole_scores(layers: int) -> Iterator[None]:
    """Inside: calls whose scores fit ``WHOLE_SCORES_BYTES / layers`` run unblocked (the
    segmented engine, around one segment of ``layers`` layers)."""
    token = _budget.set(WHOLE_SCORES_BYTES // max(layers, 1))
    try:
        yield
    finally:
        _budget.reset(token)


def whole(queries: mx.array, n_keys: int) -> bool:
    """Whether one call of ``queries`` over ``n_keys`` keys runs unblocked here."""
    b, h, lq, _ = queries.shape
    return b * h * lq * n_keys * 4 <= _budget.get()


def full_block(queries: mx.array) -> int:
    """Query rows per block for a full causal layer here; 0 = one fused call."""
    wide = queries.shape[-1] > FUSED_HEAD_DIM and mx.default_device() == mx.gpu
    return FULL_BLOCK if wide and queries.shape[2] > FULL_BLOCK else 0


def attend(sdpa, queries: mx.array, keys: mx.array, values: mx.array, cache, scale: float,
           window: int | None, *args, **kwargs) -> mx.array:
    """Causal attention of the last Lq of Lk positions (keys within ``window``, if any)."""
    lq, lk = queries.shape[2], keys.shape[2]
    if window is not None and lk > window:
        lo = max(0, lk - lq - window + 1)  # keys before any query's window
        if not whole(queries, lk - lo):
            return blockwise_attention(sdpa, queries, keys, values, cache, scale, window,
                                       min(window, SLIDING_BLOCK), *args, recompute=True,
                                       **kwargs)
        if lo:
            keys, values = keys[:, :, lo:], values[:, :, lo:]
        mask = create_causal_mask(lq, offset=lk - lo - lq, window_size=window)
        return sdpa(queries, keys, values, cache, scale, mask, *args, **kwargs)
    block = 0 if whole(queries, lk) else full_block(queries)
    if window is None and block:
        return blockwise_attention(sdpa, queries, keys, values, cache, scale, None, block,
                                   *args, recompute=True, **kwargs)
    return sdpa(queries, keys, values, cache, scale, "causal", *args, **kwargs)


def blockwise_attention(sdpa, queries: mx.array, keys: mx.array, values: mx.array, cache,
                        scale: float, window: int | None, block: int, *args,
                        recompute: bool, **kwargs) -> mx.array:
    """Causal attention (within ``window`` keys, or all) in query blocks of ``block`` rows.

    Keys and values are cut once into tiles on one grid (``partition``): at the query
    blocks' starts, and every ``block`` keys back before them (one tile there without a
    window). Query block [a, b) (off = Lk − Lq) reads the tiles from the one holding key
    off + a − window + 1 (or the first) up to its own, so every tile's gradient sums its
    readers'. ``recompute``: each block's scores are recomputed in the backward
    (``recomputed``), and blocks run one after another (``after``). Exactly mlx-lm's
    masks, block by block.
    """
    lq, lk = queries.shape[2], keys.shape[2]
    off = lk - lq
    starts = list(range(0, lq, block))
    before = range(off, 0, -block) if window is not None else [off]
    key_cuts = sorted({*(off + a for a in starts[1:]), *before} - {0, lk})
    tile_starts = [0, *key_cuts]
    k_tiles, v_tiles = partition(tuple(key_cuts))(keys), partition(tuple(key_cuts))(values)
    q_blocks = partition(tuple(starts[1:]))(queries)

    def one(q: mx.array, *tiles: mx.array) -> mx.array:
        ks = mx.concatenate(tiles[: len(tiles) // 2], axis=2)
        vs = mx.concatenate(tiles[len(tiles) // 2 :], axis=2)
        n = ks.shape[2]
        mask = ("causal" if window is None or n <= window else
                create_causal_mask(q.shape[2], offset=n - q.shape[2], window_size=window))
        return sdpa(q, ks, vs, cache, scale, mask, *args, **kwargs)

    fn = recomputed(one) if recompute else one
    outs: list[mx.array] = []
    for a, q in zip(starts, q_blocks, strict=True):
        own = tile_starts.index(off + a)  # the block's own keys
        lo = 0 if window is None else max(0, off + a - window + 1)
        seen = range(bisect.bisect_right(tile_starts, lo) - 1, own + 1)
        q = after(q, outs[-1] if outs else None)  # one block's scores alive at a time
        outs.append(fn(q, *[k_tiles[i] for i in seen], *[v_tiles[i] for i in seen]))
    return mx.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]


def split_attention(sdpa, queries: mx.array, keys: mx.array, values: mx.array, cache,
                    scale: float, mask: SplitAttention, *args, **kwargs) -> mx.array:
    """``scaled_dot_product_attention`` for a SplitAttention mask ([1, H, L, D] inputs).

    Each branch's keys run over contiguous logical positions (the second branch's are
    the shared prefix then its own tokens), so a window is the usual windowed attention.
    """
    s, a, w = mask.shared, mask.first, mask.window
    if a == queries.shape[2]:  # a one-token rejected response: nothing of it is fed
        return attend(sdpa, queries, keys, values, cache, scale, w, *args, **kwargs)
    q1, q2 = partition((a,))(queries)
    cuts = (s, a) if s else (a,)
    *k1, k2 = partition(cuts)(keys)
    *v1, v2 = partition(cuts)(values)
    first = attend(sdpa, q1, mx.concatenate(k1, axis=2), mx.concatenate(v1, axis=2), cache,
                   scale, w, *args, **kwargs)
    if s:  # the second branch attends to the shared prefix and to itself
        k2, v2 = mx.concatenate([k1[0], k2], axis=2), mx.concatenate([v1[0], v2], axis=2)
    second = attend(sdpa, q2, k2, v2, cache, scale, w, *args, **kwargs)
    return mx.concatenate([first, second], axis=2)


def install_routing(model: nn.Module) -> None:
    """Route SplitAttention and Window masks in the model's attention code, once; raise
    ValueError if its attention calls no module-level ``scaled_dot_product_attention``."""
    routed_any = False
    for _, m in model.named_modules():
        module = sys.modules.get(type(m).__module__)
        sdpa = getattr(module, "scaled_dot_product_attention", None)
        routed_any |= sdpa is not None
        if sdpa is None or getattr(sdpa, "_pomona_routed", False):
            continue

        def routed(queries, keys, values, cache, scale, mask, *args, _sdpa=sdpa, **kwargs):
            if cache is not None:  # generation: mlx-lm's masks and caches, untouched
                return _sdpa(queries, keys, values, cache, scale, mask, *args, **kwargs)
            if isinstance(mask, SplitAttention):
                return split_attention(_sdpa, queries, keys, values, cache, scale, mask,
                                       *args, **kwargs)
            if isinstance(mask, Window):
                return attend(_sdpa, queries, keys, values, cache, scale, mask.size, *args,
                              **kwargs)
            return _sdpa(queries, keys, values, cache, scale, mask, *args, **kwargs)

        routed._pomona_routed = True
        module.scaled_dot_product_attention = routed
    if not routed_any:
        raise ValueError(f"{type(model).__module__}: its attention does not call mlx-lm's "
                         "scaled_dot_product_attention; the engine cannot give it masks")
