"""Prefix-shared ORPO: one forward over [prompt | chosen | rejected] instead of two.

Layout of row i (right-padded to the batch's longest): P_i prompt tokens, Rc_i chosen
tokens, Rr_i rejected tokens. The block-sparse mask lets the prompt attend causally, chosen
tokens attend to the prompt and earlier chosen tokens, rejected tokens to the prompt and
earlier rejected tokens (never chosen ones); a pad attends only to itself (a fully masked
row would make NaNs that reach the gradient through 0 × NaN). Rotary positions: rejected
tokens take P_i … P_i+Rr_i−1 as if they followed the prompt — each attention's rope runs
twice, at offset 0 and at offset −Rc_i (MLX's rope takes per-row offsets), and a select
keeps the right one per token. No model code is forked.

After the last layer the concatenation's hidden states are gathered into the two-forward
layout ([2B, T], ``engine/batch.py``): the first response token of both branches is
predicted from the last prompt position, so the loss and head code are shared and exact.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.batch import Pair, PairBatch, make_batch, round_up


@dataclass(frozen=True)
class PrefixBatch:
    """One micro-batch laid out for the shared forward.

    inputs: [B, L] int32 concatenations; mask: [B, 1, L, L] bool (True = may attend);
    rejected: [B, L] bool marks rejected tokens; shift: [B] int32 = −Rc_i (their rope
    offset); gather: [2B, T] int32 indices into the flattened [B·L] hidden states giving
    the two-forward layout of ``pairs`` (its targets and masks apply unchanged);
    fed: real tokens through the model (each prompt once).
    """

    pairs: PairBatch
    inputs: np.ndarray
    mask: np.ndarray | None  # None when split attention needs no array mask
    rejected: np.ndarray
    shift: np.ndarray
    gather: np.ndarray
    fed: int
    spans: tuple[tuple[int, int, int], ...] = ()  # (P, Rc, Rr) per row
    attention: str = "auto"  # mask | split | auto (split for one row): shared_positions

    @property
    def ids(self) -> list[str]:
        return self.pairs.ids


def _uses_split(attention: str, rows: int) -> bool:
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
    batch when the caller has built it already.
    """
    if prompts is not None and any(list(a) != list(b) for a, b in prompts):
        return None
    if any(len(p.prompt) == 0 for p in pairs):
        return None
    two = two or make_batch(pairs, nll_span, pad_multiple, pad_id)
    lengths = [len(p.prompt) + len(p.chosen) + len(p.rejected) for p in pairs]
    width = round_up(max(lengths), pad_multiple)
    b, t = len(pairs), two.inputs.shape[1]
    tokens = np.full((b, width), pad_id, np.int32)
    # The [B, 1, L, L] array mask is only built when attention will read it.
    mask = None if _uses_split(attention, b) else np.zeros((b, 1, width, width), bool)
    rejected = np.zeros((b, width), bool)
    gather = np.zeros((2 * b, t), np.int32)
    for i, pr in enumerate(pairs):
        p, rc, rr = len(pr.prompt), len(pr.chosen), len(pr.rejected)
        tokens[i, : p + rc + rr] = [*pr.prompt, *pr.chosen, *pr.rejected]
        if mask is not None:
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
    spans = tuple((len(p.prompt), len(p.chosen), len(p.rejected)) for p in pairs)
    return PrefixBatch(two, tokens, mask, rejected, shift, gather, fed=sum(lengths),
                       spans=spans, attention=attention)


@dataclass(frozen=True)
class SplitAttention:
    """The mask for a one-row shared forward, as two fused causal attention calls.

    Queries [P|Rc] over keys [P|Rc], and queries [Rr] over keys [P|Rr] (causal, aligned
    bottom-right); trailing pads attend to themselves. No masked block is computed and
    no array mask is passed, so MLX's fused attention stays on.
    """

    p: int
    rc: int
    rr: int


def split_attention(sdpa, queries: mx.array, keys: mx.array, values: mx.array, cache,
                    scale: float, mask: SplitAttention, *args, **kwargs) -> mx.array:
    """``scaled_dot_product_attention`` for a SplitAttention mask ([1, H, L, D] inputs)."""
    p, rc, rr = mask.p, mask.rc, mask.rr
    a, b = p + rc, p + rc + rr
    first = sdpa(queries[:, :, :a], keys[:, :, :a], values[:, :, :a], cache, scale,
                 "causal", *args, **kwargs)
    k2 = mx.concatenate([keys[:, :, :p], keys[:, :, a:b]], axis=2)
    v2 = mx.concatenate([values[:, :, :p], values[:, :, a:b]], axis=2)
    second = sdpa(queries[:, :, a:b], k2, v2, cache, scale, "causal", *args, **kwargs)
    if values.shape[2] == b:
        return mx.concatenate([first, second], axis=2)
    pads = values[:, :, b:]  # a pad attends to itself only: its output is its value
    if values.shape[1] != queries.shape[1]:  # GQA: each query head reads its kv head
        pads = mx.repeat(pads, queries.shape[1] // values.shape[1], axis=1)
    return mx.concatenate([first, second, pads.astype(first.dtype)], axis=2)


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
        # x: [B, H, L, D]; rejected tokens at concat index j take position j − Rc.
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


@contextmanager
def shared_positions(state: _RopeState, batch: PrefixBatch
                     ) -> Iterator[mx.array | SplitAttention]:
    """Inside: ropes give rejected tokens prompt-relative positions; yields the mask.

    ``batch.attention``: "mask" (block-sparse array), "split" (two fused calls, one row
    only) or "auto" (split for a single row, else the mask).
    """
    state.shift = mx.array(batch.shift)
    state.select = mx.array(batch.rejected)[:, None, :, None]
    use_split = _uses_split(batch.attention, len(batch.spans))
    if use_split and len(batch.spans) != 1:
        raise ValueError("split attention needs a one-row micro-batch (batch_size 1)")
    try:
        yield SplitAttention(*batch.spans[0]) if use_split else mx.array(batch.mask)
    finally:
        state.shift = state.select = None


def to_pair_layout(h: mx.array, batch: PrefixBatch) -> mx.array:
    """Hidden states [B, L, H] of the concatenation → the two-forward layout [2B, T, H]."""
    b, length, width = h.shape
    return h.reshape(b * length, width)[mx.array(batch.gather)]
