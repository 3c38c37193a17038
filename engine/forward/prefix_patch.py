"""Patching mlx-lm's model for the prefix-shared layouts (engine/forward/prefix.py): no model code
is forked.

- Rope: every attention's ``rope`` is wrapped once (``PrefixRope``). Outside a shared
  forward it is the model's own. Inside, rejected tokens take positions P … P+Rr−1 as if
  they followed the prompt: the mask layout runs each rope at offset 0 and at offset
  −Rc per row (MLX's rope takes per-row offsets) and a select keeps the right one per
  token; the split layout ropes its two branches apart (the second continues from the
  shared prefix). The group layout (engine/forward/group_layout.py) runs it once per
  completion, each at its own offset, and selects each completion's tokens.
- Attention: mlx-lm's ``scaled_dot_product_attention`` is routed (engine/model/attention.py) so
  a layer given a ``SplitAttention`` or ``Window`` mask runs the engine's attention.
- Masks: ``layout_masks`` yields a layout's masks per sliding window, with each token's
  logical position (what a windowed layer or a position-dependent query scale reads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.data.batch import PairBatch
from engine.forward.group_layout import GroupLayout
from engine.forward.prefix import PrefixBatch
from engine.model.attention import SplitAttention, install_routing, partition
from engine.model.masks import BlockMasks, CausalMasks, Masks


class _RopeState:
    shift: mx.array | None = None  # [B] offsets for rejected tokens
    select: mx.array | None = None  # [B, 1, L, 1] True where the token is rejected
    split: SplitAttention | None = None  # split layout: the rejected branch is a suffix
    # group layout: per completion, its [B] offsets and [B, 1, L, 1] tokens
    branches: list[tuple[mx.array, mx.array]] | None = None

    def arrays(self) -> list[mx.array]:
        """The arrays every rope reads now (a compiled segment takes them as inputs)."""
        pairs = [a for branch in self.branches or [] for a in branch]
        return [a for a in (self.shift, self.select) if a is not None] + pairs

    def key(self) -> tuple:
        """What the ropes decide in Python: which arrays are set, the split, the branches."""
        split = None if self.split is None else (self.split.shared, self.split.first)
        return (self.shift is not None, self.select is not None, split,
                None if self.branches is None else len(self.branches))

    @contextmanager
    def bound(self, arrays: list[mx.array]) -> Iterator[None]:
        """Inside: the ropes read ``arrays`` (``arrays()``'s order) in place of their own."""
        before = (self.shift, self.select, self.branches)
        rest = list(arrays)
        self.shift = rest.pop(0) if self.shift is not None else None
        self.select = rest.pop(0) if self.select is not None else None
        if self.branches is not None:
            self.branches = [(rest[i], rest[i + 1]) for i in range(0, len(rest), 2)]
        try:
            yield
        finally:
            self.shift, self.select, self.branches = before


class PrefixRope(nn.Module):
    """Wraps an attention's rope: unchanged unless a shared forward is running."""

    def __init__(self, rope: nn.Module, state: _RopeState):
        super().__init__()
        self.inner = rope
        self._state = state

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        st = self._state
        if st.branches is not None:  # x: [B, H, L, D]; each completion at its own offset
            out = self.inner(x, offset=0)
            for shift, select in st.branches:
                out = mx.where(select, self.inner(x, offset=shift), out)
            return out
        if st.shift is None:
            return self.inner(x, offset=offset)
        if st.split is not None:  # the suffix from `first` continues from `shared`
            a = st.split.first
            if a == x.shape[2]:
                return self.inner(x, offset=0)
            lo, hi = partition((a,))(x)
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
    install_routing(model)
    model._pomona_rope_state = state
    return state


def rope_state(model: nn.Module) -> _RopeState | None:
    """The state ``install_prefix_rope`` gave ``model``'s ropes, or None before it ran."""
    return getattr(model, "_pomona_rope_state", None)


class SplitMasks:
    """The split layout's masks: its SplitAttention, carrying a sliding layer's window."""

    def __init__(self, split: SplitAttention, positions: np.ndarray):
        self.split = split
        self.positions = mx.array(positions)

    def __call__(self, window: int | None) -> SplitAttention:
        return self.split if window is None else dataclasses.replace(self.split, window=window)

    def arrays(self) -> list[mx.array]:
        return [self.positions]

    def with_arrays(self, arrays: list[mx.array]) -> SplitMasks:
        out = object.__new__(SplitMasks)
        out.split, (out.positions,) = self.split, arrays
        return out

    def key(self, windows: Sequence[int]) -> tuple:
        """What the layers read of the split in Python: its two cuts (windows: per layer)."""
        return ("split", self.split.shared, self.split.first)


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


@contextmanager
def group_positions(state: _RopeState, layout: GroupLayout) -> Iterator[Masks]:
    """Inside: ropes give each completion prompt-relative positions; yields the layout's
    block-sparse masks, per sliding window, in those positions."""
    state.branches = [(mx.array(layout.shifts[:, g]),
                       mx.array(layout.branch == g + 1)[:, None, :, None])
                      for g in range(layout.generations)]
    try:
        yield BlockMasks(layout.mask, layout.positions())
    finally:
        state.branches = None


@contextmanager
def layout_masks(model: nn.Module, batch: PairBatch | PrefixBatch | GroupLayout
                 ) -> Iterator[Masks]:
    """The masks (per sliding window) and positions of ``batch``'s layout; for a shared
    layout, the ropes give rejected tokens (a group's completions) prompt-relative
    positions inside."""
    if isinstance(batch, GroupLayout):
        with group_positions(install_prefix_rope(model), batch) as masks:
            yield masks
    elif isinstance(batch, PrefixBatch):
        with shared_positions(install_prefix_rope(model), batch) as masks:
            yield masks
    else:
        yield CausalMasks()
