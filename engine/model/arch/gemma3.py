"""Gemma 3 (``gemma3_text``, and ``gemma3``'s text decoder): √hidden embedding scale
rounded through bfloat16 as mlx-lm does, and every ``sliding_window_pattern``-th layer
global, the others sliding."""

from __future__ import annotations

import mlx.core as mx

from engine.model.arch.stack import Stack


class Gemma3(Stack):
    family = "gemma3"

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.inner.embed_tokens(tokens)
        return h * mx.array(self.text.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)

    def window(self, i: int) -> int | None:
        pattern = self.inner.sliding_window_pattern
        return None if i % pattern == pattern - 1 else int(self.inner.window_size)

    def check_layers(self) -> list[int]:
        """A whole period ending on the last global layer: mlx-lm picks a layer's kind by
        its index modulo the pattern, so the copy's layers must keep their residues."""
        n, pattern = len(self.layers), self.inner.sliding_window_pattern
        last = max((i for i in range(n) if self.window(i) is None), default=None)
        if last is None:  # no global layer in the stack: nothing to drop
            return list(range(n))
        return list(range(max(last - max(pattern, 2) + 1, 0), last + 1))
