"""Test helper: a Hugging Face-layout model written as llama.cpp's converter writes it, the
reference the import is checked against (not the importer's own rules read backwards).

The rules, from llama.cpp's convert_hf_to_gguf.py (ggml-org/llama.cpp a458664): tensor names
through the gguf package's own ``TensorNameMap`` (what the converter calls); Llama and
Mistral (``LlamaModel``, written as architecture ``llama``) have q/k rows permuted by
``LlamaModel.permute`` and Llama 3's rope scaling stored as the ``rope_freqs`` tensor
(``generate_extra_tensors``); Qwen2, Qwen3 and Phi-3 tensors go as they are (phi3's fused
``qkv_proj`` and ``gate_up_proj`` included); the hyperparameters as ``TextModel``'s and
``Phi3MiniModel``'s ``set_gguf_parameters`` write them; the byte-level BPE vocabulary as
``_set_vocab_gpt2`` does (tokens, token types, merges).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

# HF model_type -> (GGUF architecture, the gguf package's MODEL_ARCH name, permute q/k)
ARCHS = {"llama": ("llama", "LLAMA", True), "mistral": ("llama", "LLAMA", True),
         "qwen2": ("qwen2", "QWEN2", False), "qwen3": ("qwen3", "QWEN3", False),
         "phi3": ("phi3", "PHI3", False)}


def rope_freqs(head_dim: int, base: float, rope_scaling: dict[str, Any]) -> np.ndarray:
    """``LlamaModel.generate_extra_tensors``' rope factors, as written there."""
    factor = rope_scaling.get("factor", 8.0)
    low_freq_factor = rope_scaling.get("low_freq_factor", 1.0)
    high_freq_factor = rope_scaling.get("high_freq_factor", 4.0)
    old_context_len = rope_scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, np.float32)


def permute(w: np.ndarray, heads: int, kv_heads: int | None = None) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``, as written there."""
    if kv_heads is not None and heads != kv_heads:
        heads = kv_heads
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _hparams(writer: Any, c: dict[str, Any], model_type: str) -> None:
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    if "head_dim" in c:  # TextModel: key/value lengths where the config states a head size
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if model_type == "phi3":
        writer.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])


def _vocab(writer: Any, model: Path) -> None:
    tok = json.loads((model / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    special = {t["id"] for t in tok["added_tokens"] if t.get("special")}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)


def write_gguf_of(model: Path, out: Path) -> Path:
    """The GGUF llama.cpp's converter makes of ``model`` (float32 tensors)."""
    import gguf
    import mlx.core as mx

    config = json.loads((model / "config.json").read_text())
    kind = config["model_type"]
    arch, gguf_arch, permuted = ARCHS[kind]
    weights = {k: np.array(v.astype(mx.float32)) for k, v in
               mx.load(str(model / "model.safetensors")).items()}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[gguf_arch], config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(out), arch)
    _hparams(writer, config, kind)
    _vocab(writer, model)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":
        head_dim = config.get("head_dim") or config["hidden_size"] // config[
            "num_attention_heads"]
        writer.add_tensor("rope_freqs.weight",
                          rope_freqs(head_dim, config["rope_theta"], scaling))
    for name, w in weights.items():
        if permuted and name.endswith("q_proj.weight"):
            w = permute(w, config["num_attention_heads"], config["num_attention_heads"])
        elif permuted and name.endswith("k_proj.weight"):
            w = permute(w, config["num_attention_heads"], config["num_key_value_heads"])
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"{kind}: no GGUF name for {name}"
        writer.add_tensor(gguf_name, w)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):
        step()
    return out
