"""Ministral 3: each block also takes Llama 4's position-dependent query scale,
1 + β·log(1 + ⌊pos / original_max⌋), computed here from the layout's logical positions
(a shared forward's rejected tokens count from the end of the prompt)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.ministral3 import _get_llama_4_attn_scale

from engine.model.arch.stack import Stack, State
from engine.model.masks import Masks


class Ministral3(Stack):
    family = "ministral3"

    def side(self, tokens: mx.array, h: mx.array, masks: Masks) -> list[dict[str, Any]]:
        rope = self.text.args.rope_parameters
        beta, original = rope["llama_4_scaling_beta"], rope["original_max_position_embeddings"]
        if masks.positions is None:  # contiguous: mlx-lm's own call, [T, 1]
            scale = _get_llama_4_attn_scale(tokens.shape[1], 0, beta, original)
        else:  # [B, L] logical positions → [B, 1, L, 1]
            scale = 1 + beta * mx.log(1 + mx.floor(masks.positions / original))
            scale = scale[:, None, :, None]
        scale = scale.astype(h.dtype)
        return [{"attn_scale": scale} for _ in self.layers]

    def call(self, i: int, h: mx.array, mask: Any, side: dict[str, Any],
             state: State | None) -> tuple[mx.array, State | None]:
        return self.layers[i](h, side["attn_scale"], mask, cache=None), None
