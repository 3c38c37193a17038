"""LoRA layers that read one input computing its low-rank product once: q, k and v read
the attention's normed input, gate and up the MLP's, so ``x @ [A_q|A_k|A_v]`` (one matmul,
``x`` read once) replaces three, each adapter taking its slice (issue 69: 11 % of one
layer's forward + backward on an H100; end to end on an H200 the step is level and its
peak ~2 % lower, on CPU ~2 % faster: docs/performance.md). Each adapter's factors, and
the saved format, stay mlx-lm's; the gradient of each ``A`` comes back through the
concatenation's vjp.

A group shares only what it can prove is shared: a member reuses the product when its
input is the very array the product was made from and every member's ``lora_a`` is the
very array it was made with (a traced replay writes new arrays in: it recomputes). The
product is dropped once every member has read it, so no layer's input outlives its call.
A group with dropout is left alone: each adapter draws its own mask.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger(__name__)
# Modules inside a block that read one input, by mlx-lm's names.
GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          ("mlp.gate_proj", "mlp.up_proj"))


class SharedInput:
    """One group's product of its input with its members' factors, until all have read it."""

    def __init__(self, members: list[nn.Module]):
        self.members = members
        self.entry: tuple[mx.array, list[mx.array], list[mx.array], set[int]] | None = None

    def low_rank(self, member: nn.Module, x: mx.array) -> mx.array:
        """``x @ member.lora_a`` in ``x``'s dtype, from the group's shared product."""
        me = next(i for i, m in enumerate(self.members) if m is member)
        factors = [m.lora_a for m in self.members]
        entry = self.entry
        if (entry is None or entry[0] is not x or me not in entry[3]
                or any(a is not b for a, b in zip(entry[1], factors, strict=True))):
            ranks = [a.shape[-1] for a in factors]
            cuts = [sum(ranks[: i + 1]) for i in range(len(ranks) - 1)]
            product = x @ mx.concatenate([a.astype(x.dtype) for a in factors], axis=-1)
            entry = (x, factors, mx.split(product, cuts, axis=-1), set(range(len(factors))))
        entry[3].discard(me)
        self.entry = entry if entry[3] else None  # every member has read it: dropped
        return entry[2][me]


def shared_class(base: type) -> type:
    """``base`` (Pomona's input-dtype LoRALinear) reading its low-rank product from its
    group."""

    class SharedInputLoRALinear(base):
        """A LoRALinear whose ``x @ lora_a`` comes from its group's one product."""

        def __call__(self, x: mx.array) -> mx.array:
            low = self.shared_input.low_rank(self, x)
            return self.linear(x) + self.scale * (low @ self.lora_b.astype(x.dtype))

    return SharedInputLoRALinear


def share_lora_inputs(layers: list[nn.Module]) -> int:
    """Group each block's LoRA layers that read one input (``GROUPS``); return how many
    groups share. Only Pomona's own 2-D LoRA layers without dropout take part."""
    from engine.model.load import lora_linear_class

    plain = lora_linear_class()
    cls = shared_class(plain)
    shared = 0
    for layer in layers:
        modules = dict(layer.named_modules())
        for names in GROUPS:
            members = [modules.get(n) for n in names]
            if not all(type(m) is plain and not _drops(m) for m in members):
                continue
            if len({m.lora_a.shape[0] for m in members}) != 1:
                continue
            group = SharedInput(members)
            for m in members:
                m.__class__ = cls
                object.__setattr__(m, "shared_input", group)  # not a child: no parameters
            shared += 1
    log.info("shared LoRA inputs: %d groups (q/k/v, gate/up) compute their low-rank "
             "product once", shared)
    return shared


def _drops(m: Any) -> bool:
    return getattr(m.dropout, "p", 0) > 0
