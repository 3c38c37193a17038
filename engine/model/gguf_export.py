"""A trained adapter fused into its base model and written as a GGUF that llama.cpp, Ollama
and LM Studio load: the import's rules run backwards (engine/model/gguf_archs.py).

Each family the import reads is written as llama.cpp's converter (convert_hf_to_gguf.py)
writes it: the tensor names (``gguf_name``, the inverse of the import's), llama's q/k rows
permuted for its rope, Gemma's norms stored as 1 + w, the hyperparameters under
``{arch}.*``, Llama 3's rope scaling as the ``rope_freqs`` tensor, and the tokenizer
(engine/model/gguf_vocab.py). A model setting a GGUF cannot state (a rope scaling llama.cpp
does not read, Gemma's window pattern other than its fixed 1-in-6) is refused in one line,
so an export never loads as a different model. Types as the converter writes them: 1-D
tensors (norms, biases) float32 always; q8_0 falls back to f16 for a row not a multiple of
its 32-value block.

    pomona export RUN_OR_ADAPTER --gguf OUT.gguf [--model M] [--type f32|f16|bf16|q8_0]
    python -m engine export RUN_OR_ADAPTER --gguf OUT.gguf ...

Written under a hidden name beside ``OUT.gguf`` and renamed: no partial file is left, and
an existing file is never written over (engine/host/outputs.py, ``check_file``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.host.atomic import clean_stale, no_replace, write_atomic
from engine.model.gguf_archs import (
    ARCHS,
    ROPE_FREQS,
    gemma3_fixed,
    gguf_name,
    llama3_factors,
    permute_qk,
)
from engine.model.gguf_vocab import saved_fields, write_bpe, write_fields

TYPES = ("f32", "f16", "bf16", "q8_0")
MARK = "pomona.export"  # a key every export writes (llama.cpp ignores keys it does not know)
# mlx-lm model_type -> the GGUF architecture llama.cpp knows it as (Mistral is llama there)
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "phi3": "phi3", "gemma3_text": "gemma3"}
Q8_BLOCK = 32


@dataclass(frozen=True)
class Fused:
    """A model with its adapter fused in: its config, and each parameter as float32 under
    mlx-lm's name."""

    config: dict[str, Any]
    weights: dict[str, np.ndarray]


def fuse(model: str, adapter: Path | None) -> Fused:
    """``model`` with ``adapter`` fused in and dequantized, as ``mlx_lm fuse`` does."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import dequantize_model

    from engine.model.load import load_model
    from engine.model.source import model_dir, read_config

    net, _ = load_model(model, str(adapter) if adapter else None)
    fused = [(n, m.fuse(dequantize=True)) for n, m in net.named_modules() if hasattr(m, "fuse")]
    if fused:
        net.update_modules(tree_unflatten(fused))
    net = dequantize_model(net)
    weights = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(net.parameters())}
    config = read_config(model_dir(model))
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    return Fused(config, weights)


def head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def gguf_arch(config: dict[str, Any]) -> str:
    """The GGUF architecture of ``config``, or ValueError naming the family."""
    kind = config.get("model_type")
    if kind not in GGUF_ARCH:
        raise ValueError(f"model_type {kind!r}: the GGUF export writes "
                         f"{', '.join(sorted(GGUF_ARCH))}")
    return GGUF_ARCH[kind]


def check_expressible(config: dict[str, Any], arch: str) -> None:
    """ValueError naming a setting the GGUF cannot state, which llama.cpp (and the import)
    would read back as another value."""
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    allowed = {"llama": (None, "linear", "llama3"), "phi3": (None,)}.get(arch, (None, "linear"))
    if kind not in allowed:
        raise ValueError(f"rope_scaling {kind!r}: a {arch} GGUF states "
                         f"{', '.join(str(a) for a in allowed)} only")
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias: a GGUF of this family holds no MLP biases")
    if arch != "gemma3" and "sliding_attention" in (config.get("layer_types") or ()):
        raise ValueError(f"sliding_window {config.get('sliding_window')}: a {arch} GGUF "
                         "has no sliding layers")
    if arch == "gemma3":
        for key, value in gemma3_fixed(config).items():
            if config.get(key, value) != value:
                raise ValueError(f"{key} {config[key]}: llama.cpp's gemma3 fixes it at {value}")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if config.get(key):
                raise ValueError(f"{key} {config[key]}: a gemma3 GGUF cannot state it")


def write_hparams(writer: Any, config: dict[str, Any], arch: str) -> None:
    """The ``{arch}.*`` keys the import (and llama.cpp) read the config back from."""
    import gguf

    dim = head_dim(config)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    writer.add_rope_dimension_count(int(dim * config.get("partial_rotary_factor", 1.0)))
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(config.get("original_max_position_embeddings",
                                                        config["max_position_embeddings"]))
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])


def gguf_tensors(fused: Fused, arch: str) -> dict[str, np.ndarray]:
    """Every tensor under llama.cpp's name, in its layout and convention."""
    config, rules = fused.config, ARCHS[arch]
    out = {}
    for name, w in fused.weights.items():
        if rules.permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            kv = name.endswith("k_proj.weight")
            w = permute_qk(w, config["num_key_value_heads" if kv else "num_attention_heads"])
        if rules.norm_offset and name.endswith("norm.weight"):
            w = w + rules.norm_offset
        out[gguf_name(rules, name)] = w
    if config.get("tie_word_embeddings"):
        out.pop("output.weight", None)  # tied: llama.cpp reads the embedding as the head
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":
        out[ROPE_FREQS] = llama3_factors(head_dim(config), config.get("rope_theta", 10000.0),
                                         scaling)
    return out


def stored(w: np.ndarray, kind: str) -> tuple[np.ndarray, Any]:
    """``w`` as the converter stores it for export type ``kind``: (data, raw dtype)."""
    import gguf
    from gguf.quants import quantize

    Q = gguf.GGMLQuantizationType
    if kind == "f32" or w.ndim < 2:
        return w.astype(np.float32), None
    if kind == "q8_0" and w.shape[-1] % Q8_BLOCK == 0:
        return quantize(w, Q.Q8_0), Q.Q8_0
    if kind == "bf16":
        return quantize(w, Q.BF16), Q.BF16
    return w.astype(np.float16), None


def finish(writer: Any, tensors: dict[str, np.ndarray], kind: str) -> None:
    """``tensors`` stored as type ``kind`` (``stored``), then the file written and closed."""
    for name, w in tensors.items():
        data, raw = stored(w, kind)
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16",
              "q8_0": "MOSTLY_Q8_0"}


def write_gguf(out: Path, fused: Fused, kind: str, tokenizer_from: Path,
               ours: Callable[[Path], bool] = lambda _: False) -> Path:
    """``fused`` written to ``out`` as a GGUF of type ``kind``, the tokenizer copied from
    ``tokenizer_from``'s GGUF source or built from its tokenizer.json. Published only where
    no file is at ``out`` by then, or one ``ours`` recognises (OSError otherwise)."""
    import gguf

    arch = gguf_arch(fused.config)
    check_expressible(fused.config, arch)
    tensors = gguf_tensors(fused, arch)
    rows = tensors["token_embd.weight"].shape[0]
    copied = saved_fields(tokenizer_from)

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_name(fused.config.get("_name_or_path") or tokenizer_from.name)
        writer.add_string(MARK, kind)  # what ``exported_here`` recognises
        writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[kind]])
        write_hparams(writer, fused.config, arch)
        if copied:
            write_fields(writer, copied)
        else:
            write_bpe(writer, tokenizer_from, rows)
        finish(writer, tensors, kind)

    clean_stale(out, ".gguf")  # a killed export's whole-model temporaries
    return write_atomic(out, write, suffix=".gguf", publish=no_replace(ours))


def exported_here(path: Path) -> bool:
    """Whether ``path`` is a GGUF an export wrote (it carries ``MARK``): the only file a
    pipeline's export replaces. A user's own file of that name is never written over."""
    import gguf

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return False
        return MARK in gguf.GGUFReader(str(path)).fields
    except (OSError, ValueError, IndexError):  # unreadable, or not a GGUF after all
        return False
