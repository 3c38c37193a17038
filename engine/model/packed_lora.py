"""Several LoRA adapters trained together over one frozen base model: a pack.

A pack's batch is the trials' one batch, its rows repeated once per adapter (``repeat_rows``);
copy i runs through adapter i. The base's matmuls run once over all the copies, and each
adapted projection adds every adapter's low-rank product in one batched matmul over its
own rows (mLoRA's batch fusion, Ye et al., VLDB 2025). The adapters' parameters are
disjoint, so the gradient of the summed loss with respect to adapter i is its own loss's:
each adapter trains as it would alone (tests/test_packed_lora.py holds it to 1e-5 in
float32). Ranks may differ: a smaller rank is padded with zeros, whose products and
gradients are zero.

    adapters = pack_lora(model, [LoraSpec(rank=8), LoraSpec(rank=16)], seed=0)
    logps = forward_logps(model, stack, repeat_rows(batch, 2))   # [2 × rows, T]
    lora = adapter_of(model, 1)                         # adapter 1, named as when alone
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from engine.model.load import (
    KeyedDropout,
    LoraSpec,
    attach_lora,
    initial_a,
    lora_linear_class,
    lora_modules,
)


class PackedLoRALinear(nn.Module):
    """A frozen linear and k adapters: input rows [k × n, ..., in], copy i adapted by
    adapter i (its own ``lora_a[i]`` [in, r_i], ``lora_b[i]`` [r_i, out], scale, dropout)."""

    def __init__(self, linear: nn.Module, a: list[mx.array], b: list[mx.array],
                 scales: Sequence[float], dropouts: Sequence[KeyedDropout]):
        super().__init__()
        self.linear = linear
        self.lora_a, self.lora_b = a, b  # lists: each adapter its own parameters
        self.dropouts = list(dropouts)
        self._scales = tuple(scales)

    def __call__(self, x: mx.array) -> mx.array:
        k = len(self.lora_a)
        copies = x.reshape(k, -1, *x.shape[1:])  # [k, n, ..., in]: the copy's own shape
        if any(d.p > 0 for d in self.dropouts):  # each copy the mask it draws alone
            copies = mx.stack([d(c) for d, c in zip(self.dropouts, copies, strict=True)])
        rows = copies.reshape(k, -1, x.shape[-1])
        rank = max(a.shape[1] for a in self.lora_a)
        a = mx.stack([_pad(m, rank, 1) for m in self.lora_a]).astype(x.dtype)  # [k, in, r]
        b = mx.stack([_pad(m, rank, 0) for m in self.lora_b]).astype(x.dtype)  # [k, r, out]
        scales = mx.array(self._scales, dtype=x.dtype).reshape(k, 1, 1)
        low = scales * ((rows @ a) @ b)  # the order of LoRALinear's own product
        return self.linear(x) + low.reshape(*x.shape[:-1], low.shape[-1])


def _pad(factor: mx.array, rank: int, axis: int) -> mx.array:
    """``factor`` with zeros up to ``rank`` along ``axis`` (its rank's axis)."""
    short = rank - factor.shape[axis]
    if not short:
        return factor
    widths = [(0, 0), (0, 0)]
    widths[axis] = (0, short)
    return mx.pad(factor, widths)


def pack_lora(model: nn.Module, specs: Sequence[LoraSpec], seed: int) -> int:
    """Freeze ``model`` and give each adapted projection one adapter per spec, each drawn
    from ``seed`` as ``attach_lora`` draws a lone adapter; return the trainable count.

    The specs may differ in rank, scale and dropout; they adapt the same projections
    (``keys``, ``num_layers``), since a copy's rows pass through every projection."""
    specs = list(specs)
    where = {dataclasses.replace(s, rank=0, scale=0.0, dropout=0.0) for s in specs}
    if len(where) != 1:
        raise ValueError(f"a pack's adapters adapt one set of projections; got {where}")
    attach_lora(model, specs[0], seed)
    modules = lora_modules(model)
    if any(m.lora_a.ndim != 2 for _, m in modules):
        raise ValueError("a pack adapts plain projections only (not experts' stacked ones)")
    shapes = [[(m.lora_a.shape[0], s.rank) for _, m in modules] for s in specs]
    drawn = [initial_a(shape, seed) for shape in shapes]
    packed = []
    for site, (name, m) in enumerate(modules):
        a = [mx.array(d[site]) for d in drawn]
        b = [mx.zeros((s.rank, m.lora_b.shape[1])) for s in specs]
        dropouts = [KeyedDropout(s.dropout, site) for s in specs]
        packed.append((name, PackedLoRALinear(m.linear, a, b, [s.scale for s in specs],
                                              dropouts)))
    model.update_modules(tree_unflatten(packed))
    model.__dict__.pop("_pomona_dropouts", None)  # set_dropout_seed finds the pack's anew
    return sum(a.size + b.size for _, p in packed
               for a, b in zip(p.lora_a, p.lora_b, strict=True))


def packed_layers(model: nn.Module) -> list[tuple[str, PackedLoRALinear]]:
    """(name, layer) of every packed projection, in a stable order (found once by a
    caller that steps: the layers outlive a dropped adapter)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, PackedLoRALinear)]


def drop_adapter(model: nn.Module, i: int) -> None:
    """Adapter ``i`` out of the pack: every projection keeps the others, in their order."""
    for _, m in packed_layers(model):
        del m.lora_a[i], m.lora_b[i], m.dropouts[i]
        m._scales = m._scales[:i] + m._scales[i + 1:]


def adapter_of(model: nn.Module | list, i: int) -> dict[str, mx.array]:
    """Adapter ``i``'s weights, named as a lone adapter's (``….lora_a``, ``….lora_b``):
    what its trial saves as ``adapters.safetensors``. ``model``: the model, or its
    ``packed_layers``."""
    layers = model if isinstance(model, list) else packed_layers(model)
    out = {}
    for name, m in layers:
        out[f"{name}.lora_a"], out[f"{name}.lora_b"] = m.lora_a[i], m.lora_b[i]
    return out


def set_adapter(model: nn.Module | list, i: int, weights: dict[str, mx.array]) -> None:
    """Adapter ``i``'s weights replaced by ``weights`` (named as ``adapter_of`` names them)."""
    layers = model if isinstance(model, list) else packed_layers(model)
    for name, m in layers:
        m.lora_a[i], m.lora_b[i] = weights[f"{name}.lora_a"], weights[f"{name}.lora_b"]


@contextmanager
def alone(model: nn.Module, i: int) -> Iterator[nn.Module]:
    """Inside: ``model`` as adapter ``i`` alone makes it (a lone run's LoRA layers holding
    its weights, dropout and scale), which evaluation, saving and checkpoints read as they
    read a lone run; after: the pack, with whatever was loaded into the view kept."""
    packed = packed_layers(model)
    views = []
    for name, m in packed:
        view = lora_linear_class().from_base(m.linear, r=m.lora_a[i].shape[1],
                                             scale=m._scales[i])
        view.__class__ = lora_linear_class()  # from_base makes mlx-lm's own class
        view.lora_a, view.lora_b, view.dropout = m.lora_a[i], m.lora_b[i], m.dropouts[i]
        view.train(m.training)
        views.append((name, view))
    model.update_modules(tree_unflatten(views))
    try:
        yield model
    finally:
        for (_, m), (_, view) in zip(packed, views, strict=True):
            m.lora_a[i], m.lora_b[i] = view.lora_a, view.lora_b
        model.update_modules(tree_unflatten(packed))
