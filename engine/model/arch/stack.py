"""Stack: a decoder as embed → layers → norm → head, explicit enough to run layer by layer.

The segmented backward, the prefix-shared forward and the bounded head never call a
model's own ``__call__``; they call its parts through a ``Stack``. This class is the
decomposition of the llama-likes (llama, mistral, qwen2/3, qwen3-MoE, phi3): mlx-lm's
``model.model.{embed_tokens, layers, norm}`` with each block called as
``layer(h, mask, None)``. A family that differs (embedding or logit scales, per-layer
inputs, state handed between layers, other layer signatures) overrides the hooks in its
own file under ``engine/model/arch/`` and calls mlx-lm's modules, never a copy of them.

What a family states:
- ``embed`` (with its scale) and ``side``: per-forward constants each layer also takes
  (Gemma 4's per-layer inputs, Ministral 3's position-dependent query scale);
- ``window(i)``: the sliding window of layer i (None: full causal), so every layout can
  build the mask that layer's type needs;
- ``donor_of``: layer → the earlier layer whose state it reads (Gemma 4's shared K/V); the
  segmented backward carries that state across segment boundaries, both ways;
- ``norm`` and ``project`` (tied or untied, logit scale, softcap);
- what a structural copy of it keeps (``check_layers``, ``reduced_args``,
  ``reduce_weight``): the load check's float32 copy (engine/check/check_copy.py) holds one layer
  of each kind and a slice of the vocabulary, and must be the same family, smaller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.model.attention import install_routing
from engine.model.masks import CausalMasks, Masks

State = tuple[mx.array, ...]  # what a donor layer hands to later layers


class Stack:
    """The llama-likes' decomposition; families override the hooks below."""

    family = "llama-like"

    def __init__(self, model: nn.Module, text: nn.Module, model_type: str = "?",
                 listed: bool = True):
        self.model, self.text = model, text  # text: the decoder (a multimodal model's part)
        self.model_type = model_type
        self.listed = listed  # False: an unlisted model_type on trial (the check decides)
        self.inner = text.model
        self.layers: list[nn.Module] = list(self.inner.layers)
        first = self.layers[0]
        self.layers_prefix = next(n for n, m in model.named_modules()
                                  if m is first).rsplit(".", 1)[0]
        self.donor_of: dict[int, int] = {}
        install_routing(model)  # split and windowed attention for the engine's masks

    # --- hooks a family may override -------------------------------------------------
    def embed(self, tokens: mx.array) -> mx.array:
        """Token ids [N, T] → the first layer's input [N, T, H]."""
        return self.inner.embed_tokens(tokens)

    def side(self, tokens: mx.array, h: mx.array, masks: Masks) -> list[dict[str, Any]]:
        """Per-layer constant inputs of one forward (no trainable parameter upstream)."""
        return [{} for _ in self.layers]

    def window(self, i: int) -> int | None:
        """Layer i's sliding window, or None for full causal attention: a block's
        ``use_sliding`` (llama.py, ministral3.py) or the config's ``layer_types`` (olmo3)."""
        args = getattr(self.text, "args", None)
        types = getattr(args, "layer_types", None) or []
        if getattr(self.layers[i], "use_sliding", False) or (
                i < len(types) and types[i] == "sliding_attention"):
            size = getattr(self.inner, "sliding_window", None) or args.sliding_window
            return int(size)
        return None

    def call(self, i: int, h: mx.array, mask: Any, side: dict[str, Any],
             state: State | None) -> tuple[mx.array, State | None]:
        """Run layer i; return its output and the state it hands on (donors only)."""
        return self.layers[i](h, mask, None), None

    def norm(self, h: mx.array) -> mx.array:
        return self.inner.norm(h)

    def project(self, h: mx.array) -> mx.array:
        """Normed hidden state → logits (the head, with any scale or softcap)."""
        head = getattr(self.text, "lm_head", None)
        logits = head(h) if head is not None else self.inner.embed_tokens.as_linear(h)
        cap = getattr(getattr(self.text, "args", None), "final_logit_softcapping", None)
        return mx.tanh(logits / cap) * cap if cap else logits

    def lora_excluded(self, path: str) -> bool:
        """Linears (paths inside a block) that LoRA leaves alone unless asked."""
        return False

    # --- what a structural copy keeps (engine/check/check_copy.py) ---------------------------
    vocab_params: tuple[str, ...] = ("embed_tokens.weight", "lm_head.weight", "lm_head.bias")

    def check_layers(self) -> list[int]:
        """Layers a structural copy keeps, ascending: the last of each kind (window, donor,
        consumer) and the last two, so segments of one cross a boundary."""
        n = len(self.layers)
        last = {(self.window(i), i in self.donors, i in self.donor_of): i for i in range(n)}
        return sorted(set(last.values()) | set(range(max(n - 2, 0), n)))

    def reduced_args(self, args: Any, keep: list[int], vocab: int) -> Any:
        """The config of a copy holding layers ``keep`` (renumbered from 0) and the first
        ``vocab`` tokens; per-layer lists (``layer_types``) follow the layers."""
        changes: dict[str, Any] = {"num_hidden_layers": len(keep), "vocab_size": vocab}
        types = getattr(args, "layer_types", None)
        if types:
            changes["layer_types"] = [types[i] for i in keep]
        return dataclasses.replace(args, **changes)

    def reduce_weight(self, name: str, w: mx.array, keep: list[int]) -> mx.array:
        """A parameter outside the blocks that holds per-layer slices, cut to ``keep``
        (the vocabulary rows are already cut)."""
        return w

    # --- derived ---------------------------------------------------------------------
    @property
    def windows(self) -> list[int]:
        """The distinct sliding windows of the stack, ascending."""
        return sorted({w for i in range(len(self.layers)) if (w := self.window(i))})

    @property
    def declared_windows(self) -> list[int]:
        """Window-like sizes the config declares, mapped to layers or not: the load check of
        an unlisted family runs past them all (a window the Stack misses shows there)."""
        args = getattr(self.text, "args", None)
        keys = ("sliding_window", "window_size", "sliding_window_size", "attention_chunk_size")
        return sorted({int(v) for k in keys
                       if isinstance(v := getattr(args, k, None), int) and v > 0})

    @property
    def context(self) -> int | None:
        """Positions the model was built for (config ``max_position_embeddings``), if any."""
        value = getattr(getattr(self.text, "args", None), "max_position_embeddings", None)
        return int(value) if value else None

    @property
    def donors(self) -> set[int]:
        return set(self.donor_of.values())

    def imports(self, start: int, end: int) -> list[int]:
        """Donors below ``start`` whose state layers in [start, end) read."""
        return sorted({d for c, d in self.donor_of.items() if start <= c < end and d < start})

    def exports(self, start: int, end: int) -> list[int]:
        """Donors in [start, end) whose state layers at or after ``end`` read."""
        return sorted({d for c, d in self.donor_of.items() if start <= d < end <= c})

    def run(self, start: int, end: int, h: mx.array, masks: Masks,
            side: list[dict[str, Any]], states: dict[int, State]) -> mx.array:
        """Layers [start, end) on h; donors' states are added to ``states``."""
        donors = self.donors
        for i in range(start, end):
            donor = self.donor_of.get(i)
            h, out = self.call(i, h, masks(self.window(i)), side[i],
                               states[donor] if donor is not None else None)
            if i in donors:
                states[i] = out
        return h

    def head(self, h: mx.array) -> mx.array:
        """Logits from the last layer's output h [..., H] → [..., V]."""
        return self.project(self.norm(h))

    def hidden(self, tokens: mx.array, masks: Masks | None = None) -> mx.array:
        """Last layer's output [N, T, H] for tokens [N, T] (``masks``: the layout's)."""
        masks = masks or CausalMasks()
        h = self.embed(tokens)
        return self.run(0, len(self.layers), h, masks, self.side(tokens, h, masks), {})

    def forward(self, tokens: mx.array, masks: Masks | None = None) -> mx.array:
        """Plain forward tokens [N, T] → logits [N, T, V]."""
        return self.head(self.hidden(tokens, masks))

    def lora_keys(self) -> tuple[str, ...]:
        """Default LoRA targets: every linear of attention and MLP in any block (before
        LoRA is attached); MoE experts, routers and what ``lora_excluded`` names stay off."""
        keys: set[str] = set()
        for layer in self.layers:
            routed = {p.rsplit(".", 1)[0] if "." in p else "" for p, m in layer.named_modules()
                      if _is_experts(m)}
            for path, m in layer.named_modules():
                parent = path.rsplit(".", 1)[0] if "." in path else ""
                if (isinstance(m, (nn.Linear, nn.QuantizedLinear)) and parent not in routed
                        and not self.lora_excluded(path)):
                    keys.add(path)
        return tuple(sorted(keys))


def _is_experts(m: nn.Module) -> bool:
    """mlx-lm's expert banks (SwitchGLU / SwitchLinear): their siblings include the router."""
    return type(m).__name__ in ("SwitchGLU", "SwitchMLP", "SwitchLinear",
                                "QuantizedSwitchLinear")


StackFactory = Callable[[nn.Module, nn.Module], Stack]
