"""The self-made model families: one ``Family`` record each, and the ``ModelSpec`` they read.

A family's record holds everything Pomona knows about it: its ``config.json`` builder
(from mlx-lm's own ``ModelArgs`` fields: what ``models/<model_type>.py`` reads), whether
its tokenizer prepends BOS and its head is tied (as upstream checkpoints do), how its
weights start (norms scaled by 1 + w; attention without 1/√d), the ``ModelSpec`` options it
reads beyond the shared sizes, and the checks its own structure needs. The builders switch
on the features that make a family hard to segment (sliding windows, rope scaling,
embedding and logit scales, per-layer inputs, shared K/V, experts), so that the engine's
parity tests meet them at tiny sizes. A new family is one builder and one ``FAMILIES``
line; tasks/models/model_factory.py writes the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
PAD, BOS, EOT = "<|pad|>", "<|bos|>", "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOT, IM_START, IM_END]  # ids 0..4, in this order


@dataclass(frozen=True)
class Family:
    """One self-made model family."""

    config: Callable[[ModelSpec], dict[str, Any]]  # ModelSpec -> its config.json
    bos: bool = True  # the tokenizer prepends BOS (qwen's upstream tokenizers do not)
    tied: bool = False  # upstream checkpoints tie the head to the embedding
    offset_norms: bool = False  # RMSNorm scales by (1 + w): its norms start at 0
    unscaled_attention: bool = False  # attention scale 1 (trained q/k norms take 1/√d's role)
    uses: frozenset[str] = frozenset()  # ModelSpec options it reads beyond the shared sizes
    check: Callable[[ModelSpec], None] | None = None  # raises ValueError on a bad spec


def _common(spec: ModelSpec, model_type: str, architecture: str) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "intermediate_size": spec.intermediate,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_position,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tied,
        "torch_dtype": spec.dtype,
        "rms_norm_eps": 1e-6,
        "eos_token_id": SPECIAL_TOKENS.index(IM_END),
        "pad_token_id": 0,
        "bos_token_id": 1 if FAMILIES[model_type].bos else None,
    }


def _layer_types(spec: ModelSpec, pattern: int) -> list[str]:
    """``pattern − 1`` sliding layers then one full, repeated (Gemma's 5:1 is pattern 6)."""
    unit = ["sliding_attention"] * (pattern - 1) + ["full_attention"]
    return (unit * (spec.layers // pattern + 1))[: spec.layers]


def llama(spec: ModelSpec) -> dict[str, Any]:
    """Llama 3: optional ``llama3`` rope scaling; with a window, llama.py's sliding layers."""
    config = {**_common(spec, "llama", "LlamaForCausalLM"), "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False}
    if spec.rope_scaling == "llama3":
        config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": spec.max_position // 8}
    if spec.window:
        config["sliding_window"] = spec.window
        config["layer_types"] = _layer_types(spec, spec.window_pattern or 2)
    return config


def mistral(spec: ModelSpec) -> dict[str, Any]:
    """Mistral: mlx-lm maps ``mistral`` to llama.py (sliding layers as llama's)."""
    return {**llama(spec), "model_type": "mistral", "architectures": ["MistralForCausalLM"]}


def qwen2(spec: ModelSpec) -> dict[str, Any]:
    """Qwen2: q/k/v biases, tied head at small sizes."""
    return {**_common(spec, "qwen2", "Qwen2ForCausalLM"), "rope_theta": 1000000.0,
            "use_sliding_window": False}


def qwen3(spec: ModelSpec) -> dict[str, Any]:
    """Qwen3: q/k norms, explicit head_dim."""
    return {**_common(spec, "qwen3", "Qwen3ForCausalLM"), "rope_theta": 1000000.0,
            "head_dim": spec.head_dim}


def qwen3_moe(spec: ModelSpec) -> dict[str, Any]:
    """Qwen3-MoE: every block sparse, ``experts`` experts, top ``experts_per_token``."""
    return {**qwen3(spec), "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": spec.experts or 4, "num_experts_per_tok": spec.experts_per_token,
            "decoder_sparse_step": 1, "mlp_only_layers": [],
            "moe_intermediate_size": spec.intermediate // 2, "norm_topk_prob": True}


def phi3(spec: ModelSpec) -> dict[str, Any]:
    """Phi-3/4: fused qkv and gate_up projections."""
    return {**_common(spec, "phi3", "Phi3ForCausalLM"), "rope_theta": 10000.0,
            "original_max_position_embeddings": spec.max_position}


def minicpm(spec: ModelSpec) -> dict[str, Any]:
    """MiniCPM: embedding scale, depth-scaled residuals, logits divided by hidden/base."""
    return {**_common(spec, "minicpm", "MiniCPMForCausalLM"), "rope_theta": 10000.0,
            "scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": max(spec.hidden // 4, 1)}


def ministral3(spec: ModelSpec) -> dict[str, Any]:
    """Ministral 3: YaRN rope with Llama-4 position-dependent query scaling, sliding layers."""
    original = max(spec.max_position // 64, 16)  # small, so test lengths reach the scaling
    config = {**_common(spec, "ministral3", "Ministral3ForCausalLM"), "head_dim": spec.head_dim,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                  "original_max_position_embeddings": original,
                                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                  "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}}
    if spec.window:
        config["sliding_window"] = spec.window
        config["layer_types"] = _layer_types(spec, spec.window_pattern or 2)
    return config


def gemma3_text(spec: ModelSpec) -> dict[str, Any]:
    """Gemma 3: √hidden embedding scale, (1 + w) norms, 5 sliding layers : 1 full."""
    return {**_common(spec, "gemma3_text", "Gemma3ForCausalLM"), "head_dim": spec.head_dim,
            "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": spec.head_dim,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "sliding_window": spec.window or 32, "sliding_window_pattern": spec.window_pattern or 6}


def check_gemma3(spec: ModelSpec) -> None:
    """mlx-lm reads the first full layer's cache: there must be one."""
    if spec.layers < (spec.window_pattern or 6):
        raise ValueError(f"gemma3_text needs layers >= window_pattern "
                         f"({spec.window_pattern or 6}): mlx-lm reads the first full "
                         "layer's cache")


def gemma4_text(spec: ModelSpec) -> dict[str, Any]:
    """Gemma 4 (E2B/E4B-like): per-layer inputs, shared K/V in the last layers, softcap 30,
    5 sliding : 1 full with a wider global head and partial rope; experts when asked."""
    pattern = spec.window_pattern or 6
    shared = spec.layers // 3 if spec.kv_shared_layers is None else spec.kv_shared_layers
    config = {**_common(spec, "gemma4_text", "Gemma4ForCausalLM"), "head_dim": spec.head_dim,
              "global_head_dim": 2 * spec.head_dim, "hidden_activation": "gelu_pytorch_tanh",
              "sliding_window": spec.window or 32, "sliding_window_pattern": pattern,
              "layer_types": _layer_types(spec, pattern), "num_kv_shared_layers": shared,
              "hidden_size_per_layer_input": 16 if spec.ple is None else spec.ple,
              "vocab_size_per_layer_input": spec.vocab,
              "final_logit_softcapping": 30.0, "use_double_wide_mlp": True,
              "attention_k_eq_v": False}
    if spec.experts:
        config.update(enable_moe_block=True, num_experts=spec.experts,
                      top_k_experts=spec.experts_per_token,
                      moe_intermediate_size=spec.intermediate // 2)
    return config


def check_gemma4(spec: ModelSpec) -> None:
    """Each KV-shared layer reads the last earlier layer of its type: one must exist
    (mlx-lm fails with a bare KeyError otherwise)."""
    config = gemma4_text(spec)
    types, shared = config["layer_types"], config["num_kv_shared_layers"]
    first = spec.layers - shared
    for i in range(first, spec.layers):
        if types[i] not in types[:first]:
            raise ValueError(
                f"gemma4: layer {i} ({types[i]}) shares K/V, but no earlier layer of that "
                f"type has its own (layers {spec.layers}, kv_shared_layers {shared}, every "
                f"{spec.window_pattern or 6}th full): use more layers or fewer shared")


def gemma4(spec: ModelSpec) -> dict[str, Any]:
    """A multimodal Gemma 4 checkpoint: the text decoder under ``text_config`` (mlx-lm's
    ``gemma4.py`` drops the vision and audio towers at load)."""
    text = gemma4_text(spec)
    return {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
            "text_config": text, "vision_config": {"hidden_size": 16},
            "audio_config": {"hidden_size": 16}, "vocab_size": spec.vocab,
            "tie_word_embeddings": spec.tied, "torch_dtype": spec.dtype,
            "eos_token_id": text["eos_token_id"], "pad_token_id": 0, "bos_token_id": 1}


_WINDOW = frozenset({"window", "window_pattern"})
_EXPERTS = frozenset({"experts", "experts_per_token"})
_GEMMA4 = _WINDOW | _EXPERTS | {"kv_shared_layers", "ple"}
FAMILIES: dict[str, Family] = {
    "llama": Family(llama, uses=_WINDOW | {"rope_scaling"}),
    "mistral": Family(mistral, uses=_WINDOW | {"rope_scaling"}),
    "qwen2": Family(qwen2, bos=False, tied=True),
    "qwen3": Family(qwen3, bos=False, tied=True),
    "qwen3_moe": Family(qwen3_moe, bos=False, uses=_EXPERTS),
    "phi3": Family(phi3),
    "minicpm": Family(minicpm),
    "ministral3": Family(ministral3, tied=True, uses=_WINDOW),
    "gemma3_text": Family(gemma3_text, tied=True, offset_norms=True, uses=_WINDOW,
                          check=check_gemma3),
    "gemma4_text": Family(gemma4_text, tied=True, unscaled_attention=True, uses=_GEMMA4,
                          check=check_gemma4),
    "gemma4": Family(gemma4, tied=True, unscaled_attention=True, uses=_GEMMA4,
                     check=check_gemma4),
}


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ModelSpec:
    """What ``pomona model init`` builds. Defaults: a ~1M-parameter model that trains on CPU."""

    arch: str = _opt("llama", f"Model family: {', '.join(FAMILIES)} (gemma4: a multimodal "
                              "checkpoint).")
    layers: int = _opt(4, "Transformer blocks.")
    hidden: int = _opt(128, "Model width.")
    heads: int = _opt(4, "Attention heads.")
    kv_heads: int = _opt(2, "Key/value heads (GQA, as in current llama/qwen models).")
    intermediate: int = _opt(256, "MLP width.")
    vocab: int = _opt(1024, "Vocabulary size (BPE trained locally).")
    seed: int = _opt(0, "Weight seed; same seed, same bytes.")
    # CPU matmuls in bf16 skip BLAS and are slow: keep float32 there.
    dtype: str = _opt("float32", "float32 | bfloat16 | float16.")
    max_position: int = _opt(4096, "Context length the config declares.")
    tie_embeddings: bool | None = _opt(None, "Tie the head to the embedding (default: as "
                                             "the family's checkpoints do).")
    quantize: int | None = _opt(None, "4 or 8: quantize via mlx_lm.convert.")
    q_group_size: int = _opt(64, "Quantization group size.")
    window: int = _opt(0, "Sliding window of the sliding layers (llama, mistral, ministral3: "
                          "0 = none; gemma: 0 = 32).")
    window_pattern: int = _opt(0, "Every Nth layer full, the others sliding (0: the "
                                  "family's own).")
    rope_scaling: str | None = _opt(None, "llama: llama3 rope scaling.")
    kv_shared_layers: int | None = _opt(None, "gemma4: the last N layers reuse earlier K/V "
                                              "(default layers // 3).")
    ple: int | None = _opt(None, "gemma4: per-layer input width (default 16; 0 = none).")
    experts: int = _opt(0, "gemma4 / qwen3_moe: experts per MoE block (qwen3_moe: 0 = 4).")
    experts_per_token: int = _opt(2, "gemma4 / qwen3_moe: experts each token is routed to.")

    @property
    def family(self) -> Family:
        return FAMILIES[self.arch]

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def tied(self) -> bool:
        return self.family.tied if self.tie_embeddings is None else self.tie_embeddings

    @property
    def bos(self) -> bool:
        """Whether the tokenizer prepends BOS (as the family's upstream tokenizer does)."""
        return self.family.bos

    def config(self) -> dict[str, Any]:
        """``config.json`` in the Hugging Face layout for this spec's family."""
        return self.family.config(self)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.arch not in FAMILIES:
            raise ValueError(f"arch={self.arch!r}: expected one of {', '.join(FAMILIES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {', '.join(DTYPES)}")
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not a multiple of heads={self.heads}")
        if (self.hidden // self.heads) % 2:
            raise ValueError(f"hidden={self.hidden} / heads={self.heads} gives head dim "
                             f"{self.hidden // self.heads}; rotary needs it even")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.vocab < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab={self.vocab}: byte-level BPE needs at least "
                             f"{256 + len(SPECIAL_TOKENS)} (256 bytes + special tokens)")
        for name in ("window", "window_pattern", "ple", "experts"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        self._check_features()
        if self.window_pattern == 1:
            raise ValueError("window_pattern=1 leaves no sliding layer; use window 0 instead")
        if self.rope_scaling not in (None, "llama3"):
            raise ValueError(f"rope_scaling={self.rope_scaling!r}: expected llama3 or none")
        if self.kv_shared_layers is not None and not 0 <= self.kv_shared_layers < self.layers:
            raise ValueError(f"kv_shared_layers={self.kv_shared_layers}: must be in "
                             f"[0, layers={self.layers})")
        experts = self.experts or (4 if self.arch == "qwen3_moe" else 0)
        if experts and not 1 <= self.experts_per_token <= experts:
            raise ValueError(f"experts_per_token={self.experts_per_token}: must be in "
                             f"[1, experts={experts}]")
        if self.family.check:
            self.family.check(self)
        if self.quantize not in (None, 4, 8):
            raise ValueError(f"quantize={self.quantize}: expected 4 or 8")
        if self.quantize and (self.hidden % self.q_group_size or
                              self.intermediate % self.q_group_size):
            raise ValueError(f"quantize needs hidden ({self.hidden}) and intermediate "
                             f"({self.intermediate}) to be multiples of q_group_size "
                             f"({self.q_group_size})")

    def _check_features(self) -> None:
        """A setting the family has no use for is refused, not silently dropped."""
        optional = set().union(*(f.uses for f in FAMILIES.values()))
        for option in (f for f in fields(self) if f.name in optional):  # in field order
            name = option.name
            if getattr(self, name) != option.default and name not in self.family.uses:
                archs = [a for a, f in FAMILIES.items() if name in f.uses]
                raise ValueError(f"{name}={getattr(self, name)!r}: arch {self.arch} has no "
                                 f"use for it (only {', '.join(archs)})")
        if self.window_pattern and not self.window and self.arch in ("llama", "mistral",
                                                                     "ministral3"):
            raise ValueError(f"window_pattern={self.window_pattern} without a window: set "
                             "--window too")
