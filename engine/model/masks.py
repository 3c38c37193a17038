"""Attention masks per layer type, for each layout a forward can take.

A layout answers ``masks(window)``: the mask a layer with that sliding window (None: full
causal) must see, in whatever form mlx-lm's attention takes (``"causal"``, a bool array,
or the split layout's ``SplitAttention``). It also carries ``positions``: each token's
logical position, [B, L] int32, or None where positions are 0..L−1 (what a family with
position-dependent inputs, such as Ministral 3's query scale, reads).

- ``CausalMasks``: the two-forward layout, right-padded: what mlx-lm's own
  ``create_attention_mask`` gives (``"causal"``, or once T > window the same windowed
  attention, computed block by block where its scores are large: engine/model/attention.py).
- ``BlockMasks``: the prefix-shared array layout (engine/forward/prefix.py): a block-sparse mask,
  and for a sliding layer the same mask cut to keys within the window, counted in logical
  positions (a rejected token's window covers the prompt as if chosen were absent).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from engine.model.attention import Window


class Masks(Protocol):
    positions: mx.array | None

    def __call__(self, window: int | None) -> Any: ...

    # A compiled segment (engine/backward/compiled.py) takes a layout's arrays as inputs
    # and keys its trace on the rest.
    def arrays(self) -> list[mx.array]: ...

    def with_arrays(self, arrays: list[mx.array]) -> Masks: ...

    def key(self, windows: Sequence[int]) -> tuple: ...


class CausalMasks:
    """Causal masks over T contiguous positions, as ``Window``s (engine/model/attention.py): a
    sliding layer past its window attends block by block instead of through mlx-lm's
    [T, T] array; a full layer is one "causal" call unless its heads are too wide to fuse.
    Inside a segment either is one call where its scores are small (``whole_scores``)."""

    positions = None

    def __call__(self, window: int | None) -> Any:
        return Window(window)  # engine/model/attention.attend: "causal" unless blocks pay

    def arrays(self) -> list[mx.array]:
        return []

    def with_arrays(self, arrays: list[mx.array]) -> CausalMasks:
        return self

    def key(self, windows: Sequence[int]) -> tuple:
        return ("causal",)


class BlockMasks:
    """A block-sparse [B, 1, L, L] mask with logical ``positions`` [B, L]."""

    def __init__(self, block: np.ndarray, positions: np.ndarray):
        self.block = mx.array(block)
        self.positions = mx.array(positions.astype(np.int32))
        self._span = int(positions.max(initial=0)) + 1
        self._windowed: dict[int, mx.array] = {}

    def __call__(self, window: int | None) -> Any:
        if window is None or self._span <= window:
            return self.block
        if window not in self._windowed:
            pos = self.positions
            near = (pos[:, None, :, None] - pos[:, None, None, :]) < window
            self._windowed[window] = self.block & near
        return self._windowed[window]

    def arrays(self) -> list[mx.array]:
        return [self.block, self.positions]

    def with_arrays(self, arrays: list[mx.array]) -> BlockMasks:
        """The same masks over ``arrays`` (traced stand-ins), its windows built anew."""
        out = object.__new__(BlockMasks)
        out.block, out.positions = arrays
        out._span, out._windowed = self._span, {}
        return out

    def key(self, windows: Sequence[int]) -> tuple:
        """Which of the stack's ``windows`` cut the mask (what ``__call__`` decides)."""
        return ("block", tuple(self._span <= w for w in windows))
