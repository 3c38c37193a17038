"""Prefix-shared ORPO: one forward over [prompt | chosen | rejected] instead of two.

Layout of row i (right-padded to the batch's longest): P_i prompt tokens, Rc_i chosen
tokens, Rr_i rejected tokens. The block-sparse mask lets the prompt attend causally, chosen
tokens attend to the prompt and earlier chosen tokens, rejected tokens to the prompt and
earlier rejected tokens (never chosen ones); a pad attends only to itself (a fully masked
row would make NaNs that reach the gradient through 0 × NaN). Rotary positions: rejected
tokens take P_i … P_i+Rr_i−1 as if they followed the prompt — each attention's rope runs
twice, at offset 0 and at offset −Rc_i (MLX's rope takes per-row offsets), and a select
keeps the right one per token. No model code is forked.

A one-row micro-batch can instead use split attention (``SplitAttention``): two fused
causal calls per layer and no array mask, in a layout whose lengths are all multiples of
``pad_multiple`` — what MLX's fused attention on CUDA needs, forward and backward.

After the last layer the concatenation's hidden states are gathered into the two-forward
layout ([2B, T], ``engine/batch.py``): the first response token of both branches is
predicted from the last prompt position, so the loss and head code are shared and exact.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_causal_mask

from engine.batch import Pair, PairBatch, make_batch, round_up
from engine.masks import BlockMasks, Masks


@dataclass(frozen=True)
class SplitAttention:
    """A one-row shared forward's attention, as two fused causal calls.

    Layout: [prompt[:shared] | prompt[shared:] chosen, pads | prompt[shared:] rejected,
    pads], the second branch starting at ``first``. Queries [0, first) attend causally over
    keys [0, first); queries [first, L) over keys [0, shared) ++ [first, L) (causal, aligned
    bottom-right). With ``pad_multiple`` m, ``shared`` and ``first`` are multiples of m and
    so is L: on CUDA every call keeps MLX's fused attention, forward and backward (a
    prompt tail of < m tokens runs in both branches instead). Pads only precede other pads,
    so they never reach a real token. No array mask is built.
    """

    shared: int
    first: int
    chosen: int  # fed tokens of each branch after the shared prefix (pads excluded)
    rejected: int
    window: int | None = None  # a sliding layer's window, in each branch's own positions


@dataclass(frozen=True)
class PrefixBatch:
    """One micro-batch laid out for the shared forward.

    inputs: [B, L] int32 concatenations; mask: [B, 1, L, L] bool (True = may attend) or
    None for split attention; rejected: [B, L] bool marks rejected tokens; shift: [B] int32,
    their rope offset; gather: [2B, T] int32 indices into the flattened [B·L] hidden
    states giving the two-forward layout of ``pairs`` (its targets and masks apply
    unchanged); fed: real tokens through the model.
    """

    pairs: PairBatch
    inputs: np.ndarray
    mask: np.ndarray | None
    rejected: np.ndarray
    shift: np.ndarray
    gather: np.ndarray
    fed: int
    split: SplitAttention | None = None

    @property
    def ids(self) -> list[str]:
        return self.pairs.ids


def pair_batch(batch: PairBatch | PrefixBatch) -> PairBatch:
    """The two-forward layout behind either layout (its targets, masks and token count)."""
    return batch.pairs if isinstance(batch, PrefixBatch) else batch


def uses_split(attention: str, rows: int) -> bool:
    """Whether ``attention`` (mask | split | auto) lays ``rows`` pairs out for split."""
    return attention == "split" or (attention == "auto" and rows == 1)


def _row_mask(p: int, rc: int, rr: int, width: int) -> np.ndarray:
    m = np.zeros((width, width), bool)
    n = p + rc + rr
    causal = np.tril(np.ones((n, n), bool))
    m[:n, :n] = causal
    m[p + rc : n, p : p + rc] = False  # rejected never sees chosen
    idx = np.arange(n, width)
    m[idx, idx] = True  # pads see themselves only
    return m


def split_prefix_batch(pairs: Sequence[Pair], nll_span: str = "full",
                       pad_multiple: int = 0, pad_id: int = 0,
                       prompts: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
                       attention: str = "auto", two: PairBatch | None = None
                       ) -> PrefixBatch | None:
    """The shared layout of ``pairs``, or None when any row's two prompts differ.

    ``prompts`` optionally gives each row's (chosen-branch, rejected-branch) prompt tokens
    when they were tokenized apart; Pomona's datasets share ``prompt_ids`` by
    construction, so only foreign data can fall back. ``two``: the pairs' two-forward
    batch when the caller has built it already. ``attention``: "mask" (block-sparse
    array, any rows), "split" (SplitAttention, one row) or "auto" (split for one row).
    """
    if prompts is not None and any(list(a) != list(b) for a, b in prompts):
        return None
    if any(len(p.prompt) == 0 for p in pairs):
        return None
    two = two or make_batch(pairs, nll_span, pad_multiple, pad_id)
    if uses_split(attention, len(pairs)):
        if len(pairs) != 1:
            raise ValueError("split attention needs a one-row micro-batch (batch_size 1)")
        return _split_layout(pairs[0], two, pad_multiple, pad_id)
    return _mask_layout(pairs, two, pad_multiple, pad_id)


def _mask_layout(pairs: Sequence[Pair], two: PairBatch, pad_multiple: int, pad_id: int
                 ) -> PrefixBatch:
    """Rows [prompt | chosen | rejected | pads] under one block-sparse array mask."""
    lengths = [len(p.prompt) + len(p.chosen) + len(p.rejected) for p in pairs]
    width = round_up(max(lengths), pad_multiple)
    b, t = len(pairs), two.inputs.shape[1]
    tokens = np.full((b, width), pad_id, np.int32)
    mask = np.zeros((b, 1, width, width), bool)
    rejected = np.zeros((b, width), bool)
    gather = np.zeros((2 * b, t), np.int32)
    for i, pr in enumerate(pairs):
        p, rc, rr = len(pr.prompt), len(pr.chosen), len(pr.rejected)
        tokens[i, : p + rc + rr] = [*pr.prompt, *pr.chosen, *pr.rejected]
        mask[i, 0] = _row_mask(p, rc, rr, width)
        rejected[i, p + rc : p + rc + rr] = True
        base = i * width
        # chosen branch: input j of prompt+chosen is concat position j
        gather[i, : p + rc - 1] = base + np.arange(p + rc - 1)
        # rejected branch: prompt positions, then the rejected span (input p−1 is the
        # last prompt token, shared by both branches)
        gather[b + i, :p] = base + np.arange(p)
        gather[b + i, p : p + rr - 1] = base + p + rc + np.arange(rr - 1)
    shift = np.array([-len(pr.chosen) for pr in pairs], np.int32)
    return PrefixBatch(two, tokens, mask, rejected, shift, gather, fed=sum(lengths))


def _split_layout(pr: Pair, two: PairBatch, pad_multiple: int, pad_id: int) -> PrefixBatch:
    """One row in SplitAttention's layout (its docstring), aligned to ``pad_multiple``.

    Each branch's last token is only ever a target, so it is not fed: at 8k tokens that
    keeps the chosen branch at 8192 rather than one token into another 128-block.
    """
    p = len(pr.prompt)
    shared = p if pad_multiple <= 1 else p // pad_multiple * pad_multiple
    tail = list(pr.prompt[shared:])  # runs in both branches (< pad_multiple tokens)
    chosen, rejected_ = [*tail, *pr.chosen][:-1], [*tail, *pr.rejected][:-1]
    c, r = len(chosen), len(rejected_)
    first = round_up(shared + c, pad_multiple)
    width = first + round_up(r, pad_multiple)
    tokens = np.full((1, width), pad_id, np.int32)
    tokens[0, : shared + c] = [*pr.prompt[:shared], *chosen]
    tokens[0, first : first + r] = rejected_
    rejected = np.zeros((1, width), bool)
    rejected[0, first : first + r] = True
    gather = np.zeros((2, two.inputs.shape[1]), np.int32)
    gather[0, : shared + c] = np.arange(shared + c)
    gather[1, :shared] = np.arange(shared)
    gather[1, shared : shared + r] = first + np.arange(r)
    # The rejected branch's token at concat j sits at position j − first + shared.
    shift = np.array([shared - first], np.int32)
    return PrefixBatch(two, tokens, None, rejected, shift, gather, fed=shared + c + r,
                       split=SplitAttention(shared, first, c, r))


@functools.cache
def _partition(cuts: tuple[int, ...]):
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


def _causal(queries: int, keys: int, window: int | None) -> str | mx.array:
    """A causal mask aligned bottom-right (the queries are the last keys), cut to
    ``window`` keys where that excludes any: "causal" keeps the fused kernel otherwise."""
    if window is None or keys <= window:
        return "causal"
    return create_causal_mask(queries, offset=keys - queries, window_size=window)


def split_attention(sdpa, queries: mx.array, keys: mx.array, values: mx.array, cache,
                    scale: float, mask: SplitAttention, *args, **kwargs) -> mx.array:
    """``scaled_dot_product_attention`` for a SplitAttention mask ([1, H, L, D] inputs).

    Each branch's keys run over contiguous logical positions (the second branch's are
    the shared prefix then its own tokens), so a window is the usual windowed causal mask.
    """
    s, a, w = mask.shared, mask.first, mask.window
    if a == queries.shape[2]:  # a one-token rejected response: nothing of it is fed
        return sdpa(queries, keys, values, cache, scale, _causal(a, a, w), *args, **kwargs)
    q1, q2 = _partition((a,))(queries)
    cuts = (s, a) if s else (a,)
    *k1, k2 = _partition(cuts)(keys)
    *v1, v2 = _partition(cuts)(values)
    first = sdpa(q1, mx.concatenate(k1, axis=2), mx.concatenate(v1, axis=2), cache, scale,
                 _causal(a, a, w), *args, **kwargs)
    if s:  # the second branch attends to the shared prefix and to itself
        k2, v2 = mx.concatenate([k1[0], k2], axis=2), mx.concatenate([v1[0], v2], axis=2)
    second = sdpa(q2, k2, v2, cache, scale, _causal(q2.shape[2], k2.shape[2], w), *args,
                  **kwargs)
    return mx.concatenate([first, second], axis=2)


def install_split_attention(model: nn.Module) -> None:
    """Route SplitAttention masks in the model's attention code (others pass through).

    mlx-lm's attention modules call their module's ``scaled_dot_product_attention``; it
    is wrapped once per module, so no model code is forked.
    """
    for _, m in model.named_modules():
        module = sys.modules.get(type(m).__module__)
        sdpa = getattr(module, "scaled_dot_product_attention", None)
        if sdpa is None or getattr(sdpa, "_pomona_split", False):
            continue

        def routed(queries, keys, values, cache, scale, mask, *args, _sdpa=sdpa, **kwargs):
            if isinstance(mask, SplitAttention):
                return split_attention(_sdpa, queries, keys, values, cache, scale, mask,
                                       *args, **kwargs)
            return _sdpa(queries, keys, values, cache, scale, mask, *args, **kwargs)

        routed._pomona_split = True
        module.scaled_dot_product_attention = routed


class _RopeState:
    shift: mx.array | None = None  # [B] offsets for rejected tokens
    select: mx.array | None = None  # [B, 1, L, 1] True where the token is rejected
    split: SplitAttention | None = None  # one row: the rejected branch is a suffix


class PrefixRope(nn.Module):
    """Wraps an attention's rope: unchanged unless a shared forward is running."""

    def __init__(self, rope: nn.Module, state: _RopeState):
        super().__init__()
        self.inner = rope
        self._state = state

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        st = self._state
        if st.shift is None:
            return self.inner(x, offset=offset)
        if st.split is not None:  # the suffix from `first` continues from `shared`
            a = st.split.first
            if a == x.shape[2]:
                return self.inner(x, offset=0)
            lo, hi = _partition((a,))(x)
            return mx.concatenate([self.inner(lo, offset=0),
                                   self.inner(hi, offset=st.split.shared)], axis=2)
        # x: [B, H, L, D]; rejected tokens at concat index j take position j + shift.
        return mx.where(st.select, self.inner(x, offset=st.shift), self.inner(x, offset=0))


def install_prefix_rope(model: nn.Module) -> _RopeState:
    """Wrap every attention's rope once; returns the state the shared forward sets."""
    existing = getattr(model, "_pomona_rope_state", None)
    if existing is not None:
        return existing
    state = _RopeState()
    wrapped = 0
    for _, m in model.named_modules():
        rope = getattr(m, "rope", None)
        if isinstance(rope, nn.Module) and not isinstance(rope, PrefixRope):
            m.rope = PrefixRope(rope, state)
            wrapped += 1
    if not wrapped:
        raise ValueError(f"{type(model).__module__}: no attention `rope` module to wrap; "
                         "prefix sharing is not supported for this architecture")
    install_split_attention(model)
    model._pomona_rope_state = state
    return state


class SplitMasks:
    """The split layout's masks: its SplitAttention, carrying a sliding layer's window."""

    def __init__(self, split: SplitAttention, positions: np.ndarray):
        self.split = split
        self.positions = mx.array(positions)

    def __call__(self, window: int | None) -> SplitAttention:
        return self.split if window is None else dataclasses.replace(self.split, window=window)


def logical_positions(batch: PrefixBatch) -> np.ndarray:
    """[B, L] int32: each concatenation token's position as the two forwards see it."""
    b, length = batch.inputs.shape
    pos = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length))
    return (pos + batch.rejected * batch.shift[:, None]).astype(np.int32)


@contextmanager
def shared_positions(state: _RopeState, batch: PrefixBatch) -> Iterator[Masks]:
    """Inside: ropes give rejected tokens prompt-relative positions; yields the layout's
    masks (SplitMasks, or the block-sparse BlockMasks), per sliding window."""
    state.shift = mx.array(batch.shift)
    state.split = batch.split
    if batch.split is None:  # the split layout's ropes slice instead of selecting
        state.select = mx.array(batch.rejected)[:, None, :, None]
    positions = logical_positions(batch)
    try:
        yield (SplitMasks(batch.split, positions) if batch.split is not None
               else BlockMasks(batch.mask, positions))
    finally:
        state.shift = state.select = state.split = None


def to_pair_layout(h: mx.array, batch: PrefixBatch) -> mx.array:
    """Hidden states [B, L, H] of the concatenation → the two-forward layout [2B, T, H].

    A split layout's branches are contiguous spans: slices and pads, whose vjp is slices
    too. The mask layout gathers rows by index (its vjp a scatter-add).
    """
    b, length, width = h.shape
    if batch.split is None:
        return h.reshape(b * length, width)[mx.array(batch.gather)]
    s, c, r, t = _spans(batch)
    a = batch.split.first
    chosen = h[:, : s + c]
    rejected = mx.concatenate([h[:, :s], h[:, a : a + r]], axis=1)
    return mx.concatenate([mx.pad(chosen, [(0, 0), (0, t - s - c), (0, 0)]),
                           mx.pad(rejected, [(0, 0), (0, t - s - r), (0, 0)])], axis=0)


def from_pair_layout(cot: mx.array, batch: PrefixBatch) -> mx.array:
    """The vjp of ``to_pair_layout``: dL/d(pair layout) [2B, T, H] → [B, L, H].

    Prompt positions used by both branches collect both gradients. Positions the loss
    never reads carry zero cotangent, so the gather's padding entries add nothing.
    """
    b, length = batch.inputs.shape
    width = cot.shape[-1]
    if batch.split is None:
        flat = mx.zeros((b * length, width), cot.dtype)
        flat = flat.at[mx.array(batch.gather.reshape(-1))].add(cot.reshape(-1, width))
        return flat.reshape(b, length, width)
    s, c, r, _ = _spans(batch)
    a = batch.split.first
    parts = [cot[:1, :s] + cot[1:, :s], cot[:1, s : s + c],
             mx.zeros((1, a - s - c, width), cot.dtype), cot[1:, s : s + r],
             mx.zeros((1, length - a - r, width), cot.dtype)]
    return mx.concatenate(parts, axis=1)


def _spans(batch: PrefixBatch) -> tuple[int, int, int, int]:
    """A split layout's (shared, chosen-branch, rejected-branch, pair-layout) lengths."""
    sp = batch.split
    return sp.shared, sp.chosen, sp.rejected, batch.pairs.inputs.shape[1]
