"""``config.json`` of each self-made architecture, tiny, from mlx-lm's own ``ModelArgs`` fields.

One function per family, registered in ``CONFIGS``: each maps a ``ModelSpec`` (shared
sizes) to the Hugging Face config that mlx-lm's ``models/<model_type>.py`` reads, with the
features that make the family hard to segment switched on (sliding windows, rope scaling,
embedding and logit scales, per-layer inputs, shared K/V, experts), so that the engine's
parity tests meet them at tiny sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.model_factory import ModelSpec

# Tokenizers that prepend BOS, as their upstream checkpoints do (qwen's do not).
NO_BOS = ("qwen2", "qwen3", "qwen3_moe")


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
        "eos_token_id": 4,  # <|im_end|>: tasks/model_factory.SPECIAL_TOKENS
        "pad_token_id": 0,
        "bos_token_id": None if model_type in NO_BOS else 1,
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


def gemma4(spec: ModelSpec) -> dict[str, Any]:
    """A multimodal Gemma 4 checkpoint: the text decoder under ``text_config`` (mlx-lm's
    ``gemma4.py`` drops the vision and audio towers at load)."""
    text = gemma4_text(spec)
    return {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
            "text_config": text, "vision_config": {"hidden_size": 16},
            "audio_config": {"hidden_size": 16}, "vocab_size": spec.vocab,
            "tie_word_embeddings": spec.tied, "torch_dtype": spec.dtype,
            "eos_token_id": text["eos_token_id"], "pad_token_id": 0, "bos_token_id": 1}


CONFIGS: dict[str, Callable[[ModelSpec], dict[str, Any]]] = {
    "llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3,
    "qwen3_moe": qwen3_moe, "phi3": phi3, "minicpm": minicpm, "ministral3": ministral3,
    "gemma3_text": gemma3_text, "gemma4_text": gemma4_text, "gemma4": gemma4,
}
# Families whose upstream checkpoints tie the head to the embedding.
TIED = ("qwen2", "qwen3", "gemma3_text", "gemma4_text", "gemma4", "ministral3")
