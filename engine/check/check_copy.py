"""The load check's model: a float32 copy of the model, cut to its structure.

A decomposition is right or wrong whatever the dtype, so the load check
(engine/check/load_check.py) judges it where rounding can neither hide a mistake nor fake one: on
float32 weights (dequantized from a 4-bit base), against float32 autograd. Plain bf16
autograd is itself 1.4 (relative) off float32 on a 34-layer Gemma 3 stack (docs/design.md,
real checkpoints and precision), so two bf16 paths cannot be asked to agree.

The copy is the same mlx-lm class with a smaller config, its weights taken from the real
ones: the layers the family names (``Stack.check_layers``: one of each kind, each K/V donor
with a consumer), renumbered from 0, and the first ``VOCAB_ROWS`` rows of the vocabulary
(embedding, head, per-layer inputs). The structure is what is checked, not the depth or
the vocabulary: a lost window, scale or shared state shows on one layer of its kind, and
the check costs a few layers' work at any model size. ``same_structure`` confirms the copy's
layers have the kinds of the layers they came from.

LoRA goes on every layer of the copy with the model's own targets, rank and scale, both
factors drawn non-zero, so every factor's gradient is compared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.model.arch import make_stack
from engine.model.arch.stack import Stack
from engine.model.load import LoraSpec, attach_lora, lora_modules

VOCAB_ROWS = 4096  # tokens the copy keeps: its embedding and head rows


@dataclass(frozen=True)
class CheckCopy:
    """A structural copy (module docstring) and where it came from."""

    model: nn.Module
    stack: Stack
    keep: tuple[int, ...]  # the original layers it holds, in order
    layers: int  # the original's depth
    vocab: int  # vocabulary rows kept
    full_vocab: int

    def describe(self) -> str:
        return (f"layers {list(self.keep)} of {self.layers}, {self.vocab} of "
                f"{self.full_vocab} tokens")


def is_quantized(stack: Stack) -> bool:
    """Whether any module of the text decoder holds quantized weights."""
    return any(hasattr(m, "scales") for _, m in stack.text.named_modules())


def layer_prefix(text: nn.Module, stack: Stack) -> str:
    """The blocks' path inside the text model (``model.layers``)."""
    first = stack.layers[0]
    return next(n for n, m in text.named_modules() if m is first).rsplit(".", 1)[0]


Quantization = dict[str, dict]  # copy module path → nn.quantize's group_size, bits, mode


def dense_parameters(text: nn.Module, rename: Callable[[str], str | None],
                     rows: Callable[[str], int | None]
                     ) -> tuple[dict[str, mx.array], Quantization]:
    """The text model's parameters as float32, under mlx-lm's plain names (quantized
    weights dequantized, LoRA layers read as their base linear, their factors left out),
    and how each quantized module was quantized. ``rename`` maps a name to the copy's
    (None: not kept); ``rows`` cuts leading rows (vocabulary) before dequantizing, so a
    262k-token embedding is never expanded."""
    modules = dict(text.named_modules())
    lora = {p for p, m in modules.items() if hasattr(m, "lora_a")}
    out: dict[str, mx.array] = {}
    quantized: Quantization = {}
    for path, m in modules.items():
        arrays = {k: v for k, v in m.parameters().items() if isinstance(v, mx.array)}
        if not arrays or path in lora:
            continue
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        base = parent if path.endswith(".linear") and parent in lora else path
        if "scales" in arrays:
            arrays = _dequantized(m, arrays, rows(f"{base}.weight"))
            if (name := rename(f"{base}.weight")) is not None:
                quantized[name.removesuffix(".weight")] = {
                    "group_size": m.group_size, "bits": m.bits,
                    "mode": getattr(m, "mode", "affine")}
        for key, value in arrays.items():
            name = rename(f"{base}.{key}" if base else key)
            if name is not None:
                cut = rows(f"{base}.{key}")
                out[name] = (value[:cut] if cut else value).astype(mx.float32)
    return out, quantized


def _dequantized(m: nn.Module, arrays: dict[str, mx.array], cut: int | None
                 ) -> dict[str, mx.array]:
    """``weight`` (+ ``bias``) of a quantized module, dequantized (rows cut first)."""
    w, scales, biases = arrays["weight"], arrays["scales"], arrays.get("biases")
    if cut:
        w, scales = w[:cut], scales[:cut]
        biases = None if biases is None else biases[:cut]
    dense = mx.dequantize(w, scales, biases, m.group_size, m.bits,
                          mode=getattr(m, "mode", "affine"))
    return {"weight": dense, **({"bias": arrays["bias"]} if "bias" in arrays else {})}


def structural_copy(model: nn.Module, stack: Stack, vocab_rows: int = VOCAB_ROWS,
                    seed: int = 0, native: bool = False, whole: bool = False) -> CheckCopy:
    """The float32 copy of ``model``'s text decoder (module docstring), LoRA attached as
    ``model``'s is (every layer), or none when ``model`` has none. ``native``: the same
    copy in the model's own dtype, re-quantized as it is (the same seed, the same LoRA);
    ``whole``: every layer (a float32 twin of a copy)."""
    text = stack.text
    keep = list(range(len(stack.layers))) if whole else stack.check_layers()
    full_vocab = int(stack.inner.embed_tokens.weight.shape[0])
    vocab = min(vocab_rows, full_vocab)
    prefix = layer_prefix(text, stack)
    index = {i: j for j, i in enumerate(keep)}

    def rename(name: str) -> str | None:
        if not name.startswith(f"{prefix}."):
            return name
        i, rest = name[len(prefix) + 1:].split(".", 1)
        return f"{prefix}.{index[int(i)]}.{rest}" if int(i) in index else None

    def rows(name: str) -> int | None:
        return vocab if name.endswith(stack.vocab_params) else None

    weights, quantized = dense_parameters(text, rename, rows)
    weights = {k: stack.reduce_weight(k, v, keep) for k, v in weights.items()}
    copy = type(text)(stack.reduced_args(text.args, keep, vocab))
    if hasattr(copy, "sanitize"):  # what mlx_lm.load does: ties, dropped k/v of sharers
        weights = copy.sanitize(weights)
    copy.load_weights(list(weights.items()), strict=True)
    if native:
        copy.set_dtype(stack.embed(mx.array([[1]])).dtype)
        nn.quantize(copy, class_predicate=lambda path, _: quantized.get(path, False))
    mx.eval(copy.parameters())
    _attach_same_lora(copy, model, seed)
    return CheckCopy(copy, make_stack(copy), tuple(keep), len(stack.layers), vocab,
                     full_vocab)


def _attach_same_lora(copy: nn.Module, model: nn.Module, seed: int) -> None:
    """LoRA on every layer of ``copy`` with ``model``'s targets, rank and scale, both
    factors drawn non-zero (B is zero at a fresh start, which would leave A ungraded)."""
    found = lora_modules(model)
    if not found:
        return
    keys = sorted({_block_path(name) for name, _ in found})
    first = found[0][1]
    rank = min(first.lora_a.shape[-2:])  # [in, r], or an expert bank's [E, r, in]
    attach_lora(copy, LoraSpec(rank=rank, scale=float(first.scale), keys=tuple(keys)), seed)
    rng = np.random.default_rng(seed + 1)
    for _, m in lora_modules(copy):
        m.lora_b = mx.array(rng.normal(0, 0.02, m.lora_b.shape).astype(np.float32))


def _block_path(name: str) -> str:
    """``...layers.7.self_attn.q_proj`` → ``self_attn.q_proj`` (the key mlx-lm matches)."""
    parts = name.split(".")
    at = max(i for i, p in enumerate(parts) if p.isdigit())
    return ".".join(parts[at + 1:])


def same_structure(copy: CheckCopy, stack: Stack) -> str | None:
    """None when every layer of the copy has the kind (window, K/V donor) of the layer it
    came from; otherwise what differs (the family's reduction is wrong: a bug here)."""
    index = {i: j for j, i in enumerate(copy.keep)}
    for j, i in enumerate(copy.keep):
        if copy.stack.window(j) != stack.window(i):
            return f"layer {i} has window {stack.window(i)}, its copy {copy.stack.window(j)}"
    want = {index[c]: index[d] for c, d in stack.donor_of.items() if c in index}
    if copy.stack.donor_of != want or type(copy.stack) is not type(stack):
        return f"K/V sharing {copy.stack.donor_of} in the copy, {want} expected"
    return None

