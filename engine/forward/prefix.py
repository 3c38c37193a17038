"""Prefix-shared ORPO: one forward over [prompt | chosen | rejected] instead of two.

Layout of row i (right-padded to the batch's longest): P_i prompt tokens, Rc_i chosen
tokens, Rr_i rejected tokens. The block-sparse mask lets the prompt attend causally, chosen
tokens attend to the prompt and earlier chosen tokens, rejected tokens to the prompt and
earlier rejected tokens (never chosen ones); a pad attends only to itself (a fully masked
row would make NaNs that reach the gradient through 0 × NaN). Rotary positions: rejected
tokens take P_i … P_i+Rr_i−1 as if they followed the prompt — each attention's rope runs
twice, at offset 0 and at offset −Rc_i (MLX's rope takes per-row offsets), and a select
keeps the right one per token. No model code is forked.

A micro-batch can instead use split attention (``SplitAttention``): two fused causal
calls per layer and no array mask, in a layout whose lengths are all multiples of
``pad_multiple`` — what MLX's fused attention on CUDA needs, forward and backward. Its
rows share one geometry: prompt tails past the shortest prompt run in both branches.

After the last layer the concatenation's hidden states are gathered into the two-forward
layout ([2B, T], ``engine/data/batch.py``): the first response token of both branches is
predicted from the last prompt position, so the loss and head code are shared and exact.
What the model needs to run a layout (its ropes and attention patched, the masks per
sliding window) lives in engine/forward/prefix_patch.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.data.batch import Pair, PairBatch, make_batch, repeat_rows, round_up
from engine.model.attention import SplitAttention


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
    copies: int = 1  # a pack's batch: its rows repeated, copy after copy (repeat_layout)

    @property
    def ids(self) -> list[str]:
        return self.pairs.ids


def pair_batch(batch: PairBatch | PrefixBatch) -> PairBatch:
    """The two-forward layout behind either layout (its targets, masks and token count)."""
    return batch.pairs if isinstance(batch, PrefixBatch) else batch


def repeat_layout(batch: PairBatch | PrefixBatch, k: int) -> PairBatch | PrefixBatch:
    """``batch`` with its rows repeated ``k`` times, copy after copy, in either layout: the
    batch of a pack of ``k`` adapters (engine/model/packed_lora.py). A shared layout's
    geometry is the batch's, so each copy keeps it; copy c's gather reads copy c's rows."""
    if isinstance(batch, PairBatch):
        return repeat_rows(batch, k)
    rows, width = batch.inputs.shape

    def repeated(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.concatenate([a] * k)

    gather = np.concatenate([batch.gather + c * rows * width for c in range(k)])
    return dataclasses.replace(batch, pairs=repeat_rows(batch.pairs, k),
                               inputs=repeated(batch.inputs), mask=repeated(batch.mask),
                               rejected=repeated(batch.rejected), shift=repeated(batch.shift),
                               gather=gather.astype(batch.gather.dtype), fed=batch.fed * k,
                               copies=batch.copies * k)


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
                       attention: str = "split", two: PairBatch | None = None
                       ) -> PrefixBatch | None:
    """The shared layout of ``pairs``, or None when any row's two prompts differ.

    ``prompts`` optionally gives each row's (chosen-branch, rejected-branch) prompt tokens
    when they were tokenized apart; Pomona's datasets share ``prompt_ids`` by
    construction, so only foreign data can fall back. ``two``: the pairs' two-forward
    batch when the caller has built it already. ``attention``: "split"
    (SplitAttention) or "mask" (a block-sparse array).
    """
    if prompts is not None and any(list(a) != list(b) for a, b in prompts):
        return None
    if any(len(p.prompt) == 0 for p in pairs):
        return None
    two = two or make_batch(pairs, nll_span, pad_multiple, pad_id)
    if attention == "mask":
        return _mask_layout(pairs, two, pad_multiple, pad_id)
    if attention != "split":
        raise ValueError(f"attention={attention!r}: split or mask")
    return _split_layout(pairs, two, pad_multiple, pad_id)


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


def _split_layout(pairs: Sequence[Pair], two: PairBatch, pad_multiple: int, pad_id: int
                  ) -> PrefixBatch:
    """Rows in SplitAttention's layout (its docstring), one geometry for all of them.

    ``shared`` is the shortest prompt rounded down to ``pad_multiple``; the rest of each
    prompt runs in both branches, and each branch is right-padded to the batch's longest,
    so every row cuts at the same places and attention stays two batched fused calls.
    Each branch's last token is only ever a target, so it is not fed: at 8k tokens that
    keeps the chosen branch at 8192 rather than one token into another 128-block.
    """
    m = max(pad_multiple, 1)
    shared = min(len(p.prompt) for p in pairs) // m * m
    branches = [([*p.prompt[shared:], *p.chosen][:-1], [*p.prompt[shared:], *p.rejected][:-1])
                for p in pairs]
    c = max(len(ch) for ch, _ in branches)
    r = max(len(rj) for _, rj in branches)
    first = round_up(shared + c, pad_multiple)
    width = first + round_up(r, pad_multiple)
    b = len(pairs)
    tokens = np.full((b, width), pad_id, np.int32)
    rejected = np.zeros((b, width), bool)
    gather = np.zeros((2 * b, two.inputs.shape[1]), np.int32)
    for i, (pr, (ch, rj)) in enumerate(zip(pairs, branches, strict=True)):
        base = i * width
        tokens[i, : shared + len(ch)] = [*pr.prompt[:shared], *ch]
        tokens[i, first : first + len(rj)] = rj
        rejected[i, first : first + len(rj)] = True
        gather[i, : shared + len(ch)] = base + np.arange(shared + len(ch))
        gather[b + i, :shared] = base + np.arange(shared)
        gather[b + i, shared : shared + len(rj)] = base + first + np.arange(len(rj))
    # The rejected branch's token at concat j sits at position j − first + shared.
    shift = np.full(b, shared - first, np.int32)
    fed = sum(shared + len(ch) + len(rj) for ch, rj in branches)
    return PrefixBatch(two, tokens, None, rejected, shift, gather, fed=fed,
                       split=SplitAttention(shared, first, c, r))


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
    pairs = mx.concatenate([mx.pad(chosen, [(0, 0), (0, t - s - c), (0, 0)]),
                            mx.pad(rejected, [(0, 0), (0, t - s - r), (0, 0)])], axis=0)
    return _regroup(pairs, (2, batch.copies))


def _regroup(rows: mx.array, groups: tuple[int, int]) -> mx.array:
    """A pack's pair rows between the two orders: chosen rows of every copy, then their
    rejected rows (``groups`` (2, k): the split layout's) ↔ copy after copy, each its
    chosen then rejected rows (``groups`` (k, 2): its pairs' order, repeat_rows)."""
    if 1 in groups:
        return rows
    return rows.reshape(*groups, -1, *rows.shape[1:]).swapaxes(0, 1).reshape(rows.shape)


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
    cot = _regroup(cot, (batch.copies, 2))
    parts = [cot[:b, :s] + cot[b:, :s], cot[:b, s : s + c],
             mx.zeros((b, a - s - c, width), cot.dtype), cot[b:, s : s + r],
             mx.zeros((b, length - a - r, width), cot.dtype)]
    return mx.concatenate(parts, axis=1)


def _spans(batch: PrefixBatch) -> tuple[int, int, int, int]:
    """A split layout's (shared, chosen-branch, rejected-branch, pair-layout) lengths."""
    sp = batch.split
    return sp.shared, sp.chosen, sp.rejected, batch.pairs.inputs.shape[1]
