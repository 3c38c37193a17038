"""Models: load any mlx-lm model, freeze it, attach LoRA, and expose its layer stack.

The segmented backward needs the model as embed → layers → final norm → head; each
family's decomposition is a ``Stack`` (engine/model/arch); ``engine.check.load_check.checked_stack``
checks it against the model's own forward and gradients once at load and refuses a model
it does not reproduce, rather than train it wrongly. A ``.gguf`` file loads through its
import into the cache (engine/model/gguf_import.py), keyed by content.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from engine.model.adapter_file import check_adapter_folder, check_whole, one_line
from engine.model.source import hub_error, local_model, source_kind


def load_model(model: str, adapter_path: str | None = None) -> tuple[nn.Module, Any]:
    """``mlx_lm.load`` of a local directory, a ``.gguf`` file (its cached import) or a
    Hugging Face repo id (engine/model/source.py), with an error that names the model:
    offline, a mistyped path otherwise ends as a hub connection error. An adapter is read
    whole or refused in one line (engine/model/adapter_file.py)."""
    if adapter_path is None:
        return _load(model, None)
    weights = check_adapter_folder(adapter_path)  # readable, finite: before any weight loads
    try:
        loaded = _load(model, adapter_path)
    except ValueError as err:
        raise one_line(err) from None
    check_whole(loaded[0], weights, adapter_path)
    return loaded


def _load(model: str, adapter_path: str | None) -> tuple[nn.Module, Any]:
    import mlx_lm

    if source_kind(model) != "repo":
        return mlx_lm.load(local_model(model), adapter_path=adapter_path)
    try:
        return mlx_lm.load(model, adapter_path=adapter_path)
    except Exception as err:  # the hub client's many failure types: name them all
        raise hub_error(model, err) from err


@dataclass(frozen=True)
class LoraSpec:
    """LoRA settings, in mlx-lm's adapter_config vocabulary (``scale`` = α/r)."""

    rank: int = 8
    scale: float = 20.0
    dropout: float = 0.0
    keys: tuple[str, ...] | None = None  # None: every linear in the block (mlx-lm default)
    num_layers: int = -1  # last N blocks; -1 = all


class KeyedDropout(nn.Module):
    """Dropout whose mask is a pure function of (``seed``, call site).

    The segmented backward replays each segment's forward; a dropout that drew fresh
    randomness would train on a mask the forward never used. The trainer sets ``seed``
    per micro-step, so the forward and its replay draw the same mask.
    """

    def __init__(self, p: float, site: int):
        super().__init__()
        self.p, self.site, self.seed = p, site, 0

    def __call__(self, x: mx.array) -> mx.array:
        if not self.training or self.p == 0:
            return x
        key = mx.random.key((self.seed * 1_000_003 + self.site) % (2**63))
        keep = mx.random.bernoulli(1 - self.p, x.shape, key=key)
        return mx.where(keep, x / (1 - self.p), mx.zeros_like(x))


@functools.cache
def lora_linear_class() -> type:
    from mlx_lm.tuner.lora import LoRALinear

    class InputDtypeLoRALinear(LoRALinear):
        """mlx-lm's LoRALinear with the low-rank product in the input's dtype.

        The factors stay float32 (what AdamW updates); mlx-lm's own call multiplies a
        bf16 input by them in float32, which on the H200 made each adapted projection
        several times its base matmul (``bench ops``). Casting the factors instead is
        what PEFT does under bf16 autocast; the cast's vjp returns float32 gradients.
        """

        def __call__(self, x: mx.array) -> mx.array:
            a, b = self.lora_a.astype(x.dtype), self.lora_b.astype(x.dtype)
            return self.linear(x) + self.scale * ((self.dropout(x) @ a) @ b)

    return InputDtypeLoRALinear


def use_input_dtype_lora(model: nn.Module) -> None:
    """Every mlx-lm LoRALinear of ``model`` computes its low-rank product in the input's
    dtype (same parameters and adapter files, a cheaper call): trained LoRA and a DPO
    reference adapter compute alike."""
    fast = lora_linear_class()
    for _, m in lora_modules(model):
        if type(m) is fast.__base__:
            m.__class__ = fast


def lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every LoRA layer, in a stable order."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_a")]


def resolve_lora_keys(model: nn.Module, spec: LoraSpec) -> LoraSpec:
    """``spec`` with explicit keys: the family's default targets when it names none
    (engine/model/arch: attention and MLP projections; no experts, routers or per-layer-input
    gates). Written into adapter_config.json, so mlx-lm attaches the same modules."""
    if spec.keys is not None:
        return spec
    from engine.model.arch import make_stack

    return dataclasses.replace(spec, keys=make_stack(model).lora_keys())


def attach_lora(model: nn.Module, spec: LoraSpec, seed: int) -> int:
    """Freeze ``model`` and add LoRA layers; return the trainable parameter count.

    lora_a is re-drawn from ``seed`` (mlx-lm draws it from the global RNG), lora_b is 0,
    so the adapted model starts equal to the base and the same seed gives the same run.
    """
    from mlx_lm.tuner.utils import linear_to_lora_layers

    spec = resolve_lora_keys(model, spec)
    model.freeze()
    config = {"rank": spec.rank, "scale": spec.scale, "dropout": spec.dropout,
              "keys": list(spec.keys)}
    n = len(model.layers) if spec.num_layers < 0 else spec.num_layers
    linear_to_lora_layers(model, n, config)
    modules = lora_modules(model)
    if not modules:
        raise ValueError(f"no LoRA layers attached: keys={spec.keys} matched nothing in "
                         f"the last {n} layers")
    use_input_dtype_lora(model)
    drawn = initial_a([m.lora_a.shape for _, m in modules], seed)
    for site, ((_, m), a) in enumerate(zip(modules, drawn, strict=True)):
        m.lora_a = mx.array(a)
        m.lora_b = mx.zeros_like(m.lora_b)
        m.dropout = KeyedDropout(spec.dropout, site)
    return sum(v.size for _, v in tree_flatten(model.trainable_parameters()))


def initial_a(shapes: list[tuple[int, ...]], seed: int) -> list[np.ndarray]:
    """Each LoRA layer's first ``lora_a``, in order, drawn from ``seed``: U(±1/√fan_in), as
    mlx-lm draws it (from its global RNG); ``lora_b`` starts at 0."""
    rng = np.random.default_rng(seed)
    drawn = []
    for shape in shapes:
        fan_in = shape[-1 if len(shape) == 3 else 0]  # experts: [E, r, in]
        bound = 1.0 / np.sqrt(fan_in)
        drawn.append(rng.uniform(-bound, bound, shape).astype(np.float32))
    return drawn


class _Dropouts:
    """The model's live KeyedDropouts, found once (a plain object: not a module child)."""

    def __init__(self, model: nn.Module):
        self.sites = [m for _, m in model.named_modules()
                      if isinstance(m, KeyedDropout) and m.p > 0]


def micro_seed(seed: int, step: int, micro: int) -> int:
    """The dropout seed of micro-batch ``micro`` of ``step`` in a run seeded ``seed``: every
    path that steps (a lone run, a pack) draws its masks from it."""
    return (seed * 1_000_003 + step) * 1009 + micro


def set_dropout_seed(model: nn.Module, seed: int) -> None:
    """Give every KeyedDropout the micro-step's ``seed`` (walking the module tree once per
    model, not once per micro-batch: that walk is host time on every step)."""
    found = getattr(model, "_pomona_dropouts", None)
    if found is None:
        found = _Dropouts(model)
        model._pomona_dropouts = found
    for m in found.sites:
        m.seed = seed
