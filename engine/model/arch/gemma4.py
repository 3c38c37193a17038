"""Gemma 4 (``gemma4_text``, and ``gemma4``'s text decoder; dense or with experts).

What it adds to the llama-likes, all through mlx-lm's own modules:
- the embedding times √hidden, and per-layer inputs (PLE): ``embed_tokens_per_layer``
  plus a projection of the scaled embedding, one [N, T, P] slice per layer. They depend on
  frozen weights only, so they are computed once per forward and reused by every replay;
- sliding layers (``sliding_window``) and full ones, by ``layer_types``;
- shared K/V: the last ``num_kv_shared_layers`` layers have no k/v projections and read
  the (keys, values) of the last earlier layer of their type (``previous_kvs``). That
  donor's state is what ``Stack.donor_of`` carries across segments, and its cotangent
  collects every consumer's (engine/backward/segmented.py);
- a softcapped head (mlx-lm's compiled ``logit_softcap``);
- LoRA defaults to attention and MLP projections: the per-layer-input gate/projection
  and the expert router stay off unless asked (``lora_keys``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gemma4_text import logit_softcap

from engine.model.arch.stack import Stack, State
from engine.model.masks import Masks


class Gemma4(Stack):
    family = "gemma4"

    def __init__(self, model: nn.Module, text: nn.Module, **kwargs: Any):
        super().__init__(model, text, **kwargs)
        self.donor_of = {j: d for j, d in enumerate(self.inner.previous_kvs) if d != j}

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens) * self.inner.embed_scale

    def side(self, tokens: mx.array, h: mx.array, masks: Masks) -> list[dict[str, Any]]:
        if not self.inner.hidden_size_per_layer_input:
            return [{} for _ in self.layers]
        per_layer = self.inner._get_per_layer_inputs(tokens)
        per_layer = self.inner._project_per_layer_inputs(h, per_layer)  # [N, T, layers, P]
        return [{"per_layer_input": per_layer[:, :, i, :]} for i in range(len(self.layers))]

    def window(self, i: int) -> int | None:
        sliding = self.layers[i].layer_type == "sliding_attention"
        return int(self.inner.window_size) if sliding else None

    def call(self, i: int, h: mx.array, mask: Any, side: dict[str, Any],
             state: State | None) -> tuple[mx.array, State | None]:
        h, kvs, _ = self.layers[i](h, mask, None, per_layer_input=side.get("per_layer_input"),
                                   shared_kv=state, offset=0)
        return h, kvs

    def project(self, h: mx.array) -> mx.array:
        text = self.text
        logits = (self.inner.embed_tokens.as_linear(h) if text.tie_word_embeddings
                  else text.lm_head(h))
        cap = text.final_logit_softcapping
        return logit_softcap(cap, logits) if cap is not None else logits

    def lora_excluded(self, path: str) -> bool:
        return path.startswith(("router.", "per_layer_"))

    vocab_params = (*Stack.vocab_params, "embed_tokens_per_layer.weight")

    def check_layers(self) -> list[int]:
        """Per layer type: its K/V donor with its first and last consumers (a donor's
        cotangent sums over several), or its last layer when nothing shares its K/V (the
        copy's config re-derives the same sharing)."""
        kinds: dict[str, list[int]] = {}
        for i, layer in enumerate(self.layers):
            kinds.setdefault(layer.layer_type, []).append(i)
        keep = set()
        for layers in kinds.values():
            consumers = [i for i in layers if i in self.donor_of]
            own = [i for i in layers if i not in self.donor_of]
            keep.update(own[-1:] + consumers[:1] + consumers[-1:])
        n = len(self.layers)
        return sorted(keep) if len(keep) > 1 else sorted(keep | {max(n - 2, 0), n - 1})

    def reduced_args(self, args: Any, keep: list[int], vocab: int) -> Any:
        first_shared = len(self.layers) - args.num_kv_shared_layers
        return dataclasses.replace(
            super().reduced_args(args, keep, vocab), vocab_size_per_layer_input=vocab,
            num_kv_shared_layers=sum(i >= first_shared for i in keep))

    def reduce_weight(self, name: str, w: mx.array, keep: list[int]) -> mx.array:
        """Per-layer inputs: one [P] slice per layer, in the embedding's columns and the
        projection's rows."""
        per = self.inner.hidden_size_per_layer_input
        idx = mx.array(keep)
        if name.endswith("embed_tokens_per_layer.weight"):  # [V, L*P]
            w = w.reshape(w.shape[0], -1, per)[:, idx]
            return w.reshape(w.shape[0], -1)
        if name.endswith("per_layer_model_projection.weight"):  # [L*P, H]
            return w.reshape(-1, per, w.shape[-1])[idx].reshape(-1, w.shape[-1])
        return w
