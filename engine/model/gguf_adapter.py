"""A trained LoRA adapter alone, written as llama.cpp's adapter GGUF: what ``llama-cli
--lora``, llama-cpp-python's ``lora_path`` and Ollama's ``ADAPTER`` load on top of the base
model's own GGUF, so a lab serving one base keeps one small file per trial.

The file is what llama.cpp's convert_lora_to_gguf.py writes and llama_adapter_lora_init
reads (src/llama-adapter.cpp):

- ``general.type = adapter``, ``adapter.type = lora``, ``general.architecture`` the base's
  (llama.cpp refuses another);
- per adapted weight ``W`` (llama.cpp's tensor name, engine/model/gguf_archs.py), the pair
  ``W.lora_a`` of numpy shape [rank, in] and ``W.lora_b`` of [out, rank] (PEFT's layout:
  mlx-lm's ``lora_a`` [in, rank] and ``lora_b`` [rank, out], transposed);
- ``adapter.lora.alpha``: llama.cpp scales the update by alpha / rank, so alpha is mlx-lm's
  ``scale`` times the rank, and ``W + scale · (lora_b.T @ lora_a.T)`` (mlx-lm's fuse) is what
  llama.cpp adds;
- llama's q/k rows permuted for its rope, as the base's are: on ``lora_b``'s rows, the
  update's output side (``LlamaModel.permute``, as the converter does).

Refused in one line, before anything is written: DoRA and full fine-tunes (llama.cpp's
adapters hold LoRA alone: export those fused, ``--gguf``), LoRA on a weight llama.cpp's base
has no tensor for (the embedding, a tied head) and ranks that differ between weights (one
alpha states one scale). Written under a hidden name and renamed: no partial file is left
and no file is written over (engine/host/atomic.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine.model.gguf_archs import ARCHS, gguf_name, permute_qk
from engine.model.gguf_export import MARK, check_expressible, finish, gguf_arch

ADAPTER_KIND = "lora-adapter"  # ``MARK``'s value in an adapter file: what wrote it
LEAVES = ("lora_a", "lora_b")


def lora_pairs(weights: dict[str, np.ndarray], source: Path) -> dict[str, tuple[Any, Any]]:
    """mlx-lm parameter name of each adapted weight -> its (lora_a, lora_b); ValueError
    naming a tensor that is not one of a LoRA pair."""
    pairs: dict[str, dict[str, Any]] = {}
    for name, w in weights.items():
        stem, _, leaf = name.rpartition(".")
        if leaf not in LEAVES:
            raise ValueError(f"{source}: tensor {name} is not a LoRA factor (lora_a, "
                             "lora_b); llama.cpp's adapters hold LoRA alone: export the "
                             "adapter fused (--gguf)")
        pairs.setdefault(f"{stem}.weight", {})[leaf] = w
    for name, pair in pairs.items():
        if len(pair) != 2:
            raise ValueError(f"{source}: {name} has {', '.join(pair)} without its other "
                             "LoRA factor; train or copy the adapter again")
    return {name: (pair["lora_a"], pair["lora_b"]) for name, pair in pairs.items()}


def check_lora(config: dict[str, Any], source: Path) -> float:
    """The adapter's LoRA scale; ValueError where its adapter_config.json asks for what
    llama.cpp's adapters cannot hold."""
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ValueError(f"{source}: fine_tune_type {kind}: llama.cpp's adapters hold LoRA "
                         "alone; export it fused into its base with --gguf")
    return float((config.get("lora_parameters") or {}).get("scale", 1.0))


def adapter_tensors(pairs: dict[str, tuple[Any, Any]], base: dict[str, Any],
                    arch: str) -> dict[str, np.ndarray]:
    """Each pair under llama.cpp's names and in its layout; ValueError naming a weight the
    base's GGUF has no tensor for."""
    rules, out = ARCHS[arch], {}
    for name, (a, b) in sorted(pairs.items()):
        target = gguf_name(rules, name)
        if not target.startswith("blk.") and not (target == "output.weight"
                                                  and not base.get("tie_word_embeddings")):
            raise ValueError(f"LoRA on {name}: a {arch} GGUF's adapter can adapt the "
                             "blocks' linear layers and an untied head only; export this "
                             "adapter fused (--gguf)")
        a, b = np.asarray(a, np.float32).T, np.asarray(b, np.float32).T  # [r, in], [out, r]
        if rules.permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            kv = name.endswith("k_proj.weight")
            heads = base["num_attention_heads"]
            b = permute_qk(b, (base.get("num_key_value_heads") or heads) if kv else heads)
        out[f"{target}.lora_a"], out[f"{target}.lora_b"] = a, b
    return out


def one_rank(pairs: dict[str, tuple[Any, Any]], source: Path) -> int:
    """The rank every pair shares; ValueError where they differ (llama.cpp's one alpha
    would scale them differently from mlx-lm's one scale)."""
    ranks = {name: int(a.shape[-1]) for name, (a, _) in pairs.items()}
    if not ranks:
        raise ValueError(f"{source}: holds no LoRA factors")
    if len(set(ranks.values())) > 1:
        raise ValueError(f"{source}: ranks {sorted(set(ranks.values()))} differ between "
                         "weights; one adapter GGUF states one alpha for one rank")
    return next(iter(ranks.values()))


def adapter_gguf_tensors(adapter: Path, base: dict[str, Any]
                         ) -> tuple[str, dict[str, np.ndarray], float]:
    """The GGUF architecture, tensors and alpha of ``adapter`` (an mlx-lm adapter folder)
    on the base whose config is ``base``; every refusal (module docstring) here, before
    any file is written."""
    import mlx.core as mx

    from engine.model.adapter_file import read_adapter_config, read_adapter_weights

    arch = gguf_arch(base)
    check_expressible(base, arch)
    source = adapter / "adapters.safetensors"
    scale = check_lora(read_adapter_config(adapter), adapter / "adapter_config.json")
    pairs = lora_pairs({k: np.array(v.astype(mx.float32))
                        for k, v in read_adapter_weights(adapter).items()}, source)
    rank = one_rank(pairs, source)
    return arch, adapter_tensors(pairs, base, arch), scale * rank  # alpha / r = scale


def write_adapter_gguf(out: Path, adapter: Path, base: dict[str, Any], kind: str,
                       ours: Callable[[Path], bool] = lambda _: False) -> Path:
    """``adapter`` (an mlx-lm adapter folder) written to ``out`` as llama.cpp's LoRA GGUF for
    the base whose config is ``base``, tensors of type ``kind``; published only where no
    file is at ``out`` by then, or one ``ours`` recognises (OSError otherwise)."""
    import gguf

    from engine.host.atomic import clean_stale, no_replace, write_atomic

    arch, tensors, alpha = adapter_gguf_tensors(adapter, base)

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        writer.add_name(f"{adapter.name} (LoRA)")
        writer.add_string(MARK, ADAPTER_KIND)  # what ``exported_here`` recognises
        finish(writer, tensors, kind)

    clean_stale(out, ".gguf")  # a killed export's temporaries
    return write_atomic(out, write, suffix=".gguf", publish=no_replace(ours))
