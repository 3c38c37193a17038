"""Architectures: which ``Stack`` decomposes which mlx-lm ``model_type``.

One file per family that needs its own hooks, one line here per model_type. A multimodal
checkpoint (``gemma3``, ``gemma4``) trains its text decoder (``model.language_model``), the
part mlx-lm loads. A model_type not listed is accepted only if the llama-like
decomposition passes the load-time check (engine/check/load_check.py); otherwise it is refused
with this list.

To add a family: read its ``mlx_lm/models/<type>.py``; if its embedding, layer call, masks,
cross-layer state or head differ from ``Stack``'s, subclass it in ``engine/model/arch/<family>.py``
overriding only those hooks; add a line to ``FAMILIES``, a config builder and its record
to ``tasks/models/model_families.py`` and the family to the parity tests (tests/test_arch.py).
"""

from __future__ import annotations

import mlx.nn as nn

from engine.model.arch.gemma3 import Gemma3
from engine.model.arch.gemma4 import Gemma4
from engine.model.arch.minicpm import MiniCPM
from engine.model.arch.ministral3 import Ministral3
from engine.model.arch.stack import Stack, StackFactory

FAMILIES: dict[str, StackFactory] = {
    "llama": Stack, "mistral": Stack, "qwen2": Stack, "qwen3": Stack, "qwen3_moe": Stack,
    "phi3": Stack, "minicpm": MiniCPM, "ministral3": Ministral3,
    "gemma3_text": Gemma3, "gemma4_text": Gemma4,
}


def text_model(model: nn.Module) -> nn.Module:
    """The causal decoder inside ``model`` (a multimodal model's ``language_model``)."""
    return getattr(model, "language_model", model)


def model_type(model: nn.Module) -> str:
    text = text_model(model)
    args = getattr(text, "args", None)
    return str(getattr(text, "model_type", None) or getattr(args, "model_type", "?"))


def supported() -> str:
    return ", ".join(sorted(FAMILIES))


def make_stack(model: nn.Module) -> Stack:
    """The family's Stack for ``model``, or the llama-like one for an unlisted model_type
    with the llama layout (the caller must check it: ``engine.check.load_check.checked_stack``)."""
    text = text_model(model)
    kind = model_type(model)
    factory = FAMILIES.get(kind)
    if factory is None:
        inner = getattr(text, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers",
                                                               "norm")):
            raise ValueError(f"model_type {kind!r} is not supported (no embed_tokens/layers/"
                             f"norm layout to segment); supported: {supported()}")
        factory = Stack
    return factory(model, text, model_type=kind, listed=kind in FAMILIES)
