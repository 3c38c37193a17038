"""How each GGUF ``general.architecture`` maps onto an mlx-lm ``model_type``: its config from
the metadata, its tensor names, and what llama.cpp's converter (convert_hf_to_gguf.py)
changed that an import undoes.

- ``llama`` (Llama, and Mistral, which llama.cpp writes as llama): q/k rows permuted for its
  rope (``LlamaModel.permute``); Llama 3.1+'s scaled rope stored as the ``rope_freqs``
  tensor, read back into mlx-lm's ``llama3`` rope scaling (``llama3_scaling``).
- ``qwen2``: q/k/v biases; ``qwen3``: q/k norms and an explicit head size; neither permuted
  (llama.cpp runs their rope in the NeoX layout, as HF does).
- ``phi3``: the fused ``attn_qkv`` and ``ffn_up`` (gate and up in one) as mlx-lm's phi3 keeps
  them; LongRoPE's factor tensors are refused.
- ``gemma3``: norms stored as 1 + w.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.model.gguf_meta import Keys, check_dimensions


@dataclass(frozen=True)
class Arch:
    """How one GGUF ``general.architecture`` maps onto an mlx-lm ``model_type``."""

    model_type: str
    # (metadata, GGUF tensor name -> the reader's tensor) -> the mlx-lm config
    config: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]
    names: dict[str, str]  # GGUF block-tensor stem → mlx-lm name inside the block
    permute_qk: bool = False  # llama.cpp's LlamaModel.permute of q/k rows (rope layout)
    norm_offset: float = 0.0  # llama.cpp stores Gemma's (1 + w) norms as 1 + w
    extra: tuple[str, ...] = ()  # tensors read into the config, not written as weights


_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ROPE_FREQS = "rope_freqs.weight"


def _common(meta: dict[str, Any], arch: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """The config keys every decoder states, under llama.cpp's names (``arch.key``), each
    checked (engine/model/gguf_meta.py) before anything is built from it."""
    keys = Keys(meta, arch)
    heads = keys.count("attention.head_count")
    hidden = keys.count("embedding_length")
    kv = keys.count("attention.head_count_kv", heads)
    if heads % kv:
        raise ValueError(f"{arch}.attention.head_count_kv is {kv}, which does not divide "
                         f"{arch}.attention.head_count {heads}; the file is damaged: "
                         "re-export it")
    if f"{arch}.attention.key_length" not in meta and hidden < heads:
        raise ValueError(f"{arch}.attention.head_count is {heads}, more than "
                         f"{arch}.embedding_length {hidden} (and no attention.key_length "
                         "states the head size); the file is damaged: re-export it")
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": keys.count("block_count"),
        "intermediate_size": keys.count("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": keys.count("attention.key_length", hidden // heads),
        "rms_norm_eps": keys.real("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": keys.count("context_length"),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_theta": keys.real("rope.freq_base", 10000.0),
    }
    check_dimensions(arch, config, tensors)
    return config


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported (linear only)")
    return {"rope_type": "linear", "factor": Keys(meta, arch).real("rope.scaling.factor")}


def llama3_factors(head_dim: int, base: float, scaling: dict[str, Any]) -> np.ndarray:
    """Per rope frequency, the factor llama.cpp's converter stores as ``rope_freqs``
    (LlamaModel.generate_extra_tensors): 1 below the high-frequency wavelength, ``factor``
    above the low one, smoothly between (Llama 3.1's rope scaling)."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old = scaling.get("original_max_position_embeddings", 8192)
    out = []
    for freq in 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def llama3_scaling(factors: np.ndarray, head_dim: int, base: float) -> dict[str, Any] | None:
    """mlx-lm's ``llama3`` rope scaling whose factors are ``factors`` (a GGUF's
    ``rope_freqs``), or ValueError when they do not follow that form. The smooth band fixes
    only old/low and old/high (the wavelength bounds), so low_freq_factor is taken as 1."""
    factors = np.asarray(factors, np.float64).reshape(-1)
    if factors.shape != (head_dim // 2,):
        raise ValueError(f"rope_freqs holds {factors.size} values, the rope needs "
                         f"{head_dim // 2}: not Llama 3's rope scaling")
    if not np.isfinite(factors).all():
        raise ValueError(f"tensor 'rope_freqs.weight' holds {(~np.isfinite(factors)).sum()} "
                         "NaN or infinite values; the file is damaged: re-export it")
    if np.allclose(factors, 1.0):
        return None
    wavelens = 2 * math.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
    factor = float(factors.max())
    ones, full = np.isclose(factors, 1.0, rtol=1e-6), np.isclose(factors, factor, rtol=1e-6)
    mid = ~(ones | full)
    if factor <= 1.0 or not (wavelens[ones].max(initial=0) < wavelens[~ones].min()
                             and wavelens[full].min() > wavelens[~full].max()):
        raise ValueError("rope_freqs does not rise from 1 to one factor as the wavelength "
                         "grows: not Llama 3's rope scaling")
    smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)  # s in 1/r = (1-s)/f + s
    below = wavelens[ones].max(initial=wavelens.min() / 2)  # the band's neighbours
    above = wavelens[full].min(initial=wavelens.max() * 2)
    if mid.sum() >= 2:  # s = old/(λ·(high − low)) − low/(high − low): a line in 1/λ
        slope, intercept = np.polyfit(1 / wavelens[mid], smooth, 1)
        old_over_low, old_over_high = slope / -intercept, slope / (1 - intercept)
    elif mid.any():  # one point λ: the low bound L midway to its neighbour, the high h
        s, lam = float(smooth[0]), float(wavelens[mid][0])  # from s = (L/λ − 1)/(L/h − 1)
        old_over_low = math.sqrt(lam * above)
        old_over_high = s / (1 / lam - (1 - s) / old_over_low)
    else:  # a step: both bounds in the gap between its two sides (geometric thirds)
        old_over_high, old_over_low = below ** (2 / 3) * above ** (1 / 3), \
            below ** (1 / 3) * above ** (2 / 3)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": old_over_low / old_over_high,
               "original_max_position_embeddings": old_over_low}
    if not np.allclose(llama3_factors(head_dim, base, scaling), factors, rtol=1e-5):
        raise ValueError("rope_freqs does not follow Llama 3's rope scaling (no factor, "
                         "low/high frequency factor and original context reproduce it)")
    return scaling


def _llama_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    from gguf.quants import dequantize

    base = _common(meta, "llama", tensors)
    scaling = _rope_scaling(meta, "llama")
    if ROPE_FREQS in tensors:  # Llama 3.1+'s scaled rope, stored as a tensor
        if scaling:
            raise ValueError("GGUF llama states both rope scaling and rope_freqs")
        t = tensors[ROPE_FREQS]
        scaling = llama3_scaling(dequantize(t.data, t.tensor_type), base["head_dim"],
                                 base["rope_theta"])
    return {**base, "model_type": "llama", "rope_scaling": scaling,
            "attention_bias": "blk.0.attn_q.bias" in tensors, "mlp_bias": False}


def _qwen2_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    return {**_common(meta, "qwen2", tensors), "model_type": "qwen2",
            "rope_scaling": _rope_scaling(meta, "qwen2")}


def _qwen3_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    return {**_common(meta, "qwen3", tensors), "model_type": "qwen3",
            "rope_scaling": _rope_scaling(meta, "qwen3")}


def _phi3_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    if "rope_factors_long.weight" in tensors:
        raise ValueError("GGUF phi3 with rope_factors_long (LongRoPE, the 128k models) is "
                         "not supported yet; import its Hugging Face checkpoint instead")
    base, keys = _common(meta, "phi3", tensors), Keys(meta, "phi3")
    rope_dims = keys.count("rope.dimension_count", base["head_dim"], high=base["head_dim"])
    return {**base, "model_type": "phi3", "partial_rotary_factor": rope_dims / base["head_dim"],
            "original_max_position_embeddings": keys.count(
                "rope.scaling.original_context_length", base["max_position_embeddings"]),
            "rope_scaling": None}


def _gemma3_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    base, keys = _common(meta, "gemma3", tensors), Keys(meta, "gemma3")
    return {**base, "model_type": "gemma3_text",
            "rope_theta": keys.real("rope.freq_base", 1_000_000.0),
            **gemma3_fixed(base), "sliding_window": keys.count("attention.sliding_window"),
            "rope_scaling": _rope_scaling(meta, "gemma3")}


def gemma3_fixed(config: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp fixes for Gemma 3 rather than reading from the file: 5 sliding layers
    to 1 global, a local rope base of 10k, and queries scaled by head_dim, except 27B (62
    layers), which scales by hidden/heads. The import sets them; the export refuses others."""
    big = config["num_hidden_layers"] == 62
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return {"sliding_window_pattern": 6, "rope_local_base_freq": 10_000.0,
            "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"]
            if big else head}


ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", _llama_config, {**_BLOCK, **_NORMS}, permute_qk=True,
                  extra=(ROPE_FREQS,)),
    "qwen2": Arch("qwen2", _qwen2_config, {**_BLOCK, **_NORMS}),
    "qwen3": Arch("qwen3", _qwen3_config, {**_BLOCK, **_NORMS}),
    "phi3": Arch("phi3", _phi3_config,
                 {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                  "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj", **_NORMS}),
    "gemma3": Arch("gemma3_text", _gemma3_config,
                   {**_BLOCK, "attn_norm": "input_layernorm",
                    "post_attention_norm": "post_attention_layernorm",
                    "ffn_norm": "pre_feedforward_layernorm",
                    "post_ffw_norm": "post_feedforward_layernorm"}, norm_offset=1.0),
}


def hf_name(arch: Arch, name: str) -> str:
    """mlx-lm's parameter name for GGUF tensor ``name`` (ValueError if it has none)."""
    stem, _, kind = name.rpartition(".")  # kind: weight or bias
    if stem in _TOP:
        return f"{_TOP[stem]}.{kind}"
    parts = stem.split(".")
    if (len(parts) == 3 and parts[0] == "blk" and parts[1].isdecimal()
            and str(int(parts[1])) == parts[1] and parts[2] in arch.names):
        return f"model.layers.{parts[1]}.{arch.names[parts[2]]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} has no {arch.model_type} counterpart")


def gguf_name(arch: Arch, hf: str) -> str:
    """The GGUF tensor name of mlx-lm parameter ``hf``: ``hf_name``'s inverse."""
    stem, _, kind = hf.rpartition(".")
    parts = stem.split(".", 3)
    block = {v: k for k, v in arch.names.items()}
    if parts[:2] == ["model", "layers"] and len(parts) == 4 and parts[3] in block:
        return f"blk.{parts[2]}.{block[parts[3]]}.{kind}"
    top = {v: k for k, v in _TOP.items()}
    return f"{top[stem]}.{kind}" if stem in top else hf


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of q/k rows: each head's rows from halves
    [2, d/2] (HF's rope layout) to pairs [d/2, 2] (llama.cpp's); ``unpermute_qk`` undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q/k rows, which took each head's rows from rope
    pairs [d/2, 2] to halves [2, d/2]: read them as [d/2, 2] and swap back."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)
