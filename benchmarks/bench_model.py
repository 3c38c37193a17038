"""The engine benchmarks' one model builder: a random-init model (llama, or Gemma 4's text
decoder at ``--preset e4b``) with LoRA r=16 on q/k/v/o, its Stack, and one pair.

Random weights: the shape is what is measured. ``PRESETS`` are benchmarks/shapes.py's
published shapes (which it writes as model folders) as the engine benchmarks' flags.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from benchmarks.shapes import PRESETS as SHAPES


def as_flags(config: dict) -> dict:
    """A published Gemma 4 text config (benchmarks/shapes.py) as this builder's flags; its
    full layers' heads are twice the sliding ones' (``model_args``)."""
    if config["global_head_dim"] != 2 * config["head_dim"]:
        raise ValueError(f"{config['model_type']}: full heads of {config['global_head_dim']}, "
                         f"not twice {config['head_dim']}: model_args cannot build it")
    return dict(arch=config["model_type"], layers=config["num_hidden_layers"],
                hidden=config["hidden_size"], intermediate=config["intermediate_size"],
                heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"],
                head_dim=config["head_dim"], vocab=config["vocab_size"],
                ple=config["hidden_size_per_layer_input"], window=config["sliding_window"],
                kv_shared=config["num_kv_shared_layers"])


# Gemma 4 E4B's text decoder as published (the reference trainer's model).
PRESETS = {"e4b": as_flags(SHAPES["e4b"])}


def model_args(a: argparse.Namespace):
    """mlx-lm ModelArgs of the benchmark's random-init model (``--arch``)."""
    from mlx_lm.models import gemma4_text, llama

    inter = a.intermediate or a.hidden * 11 // 4
    if a.arch == "gemma4_text":
        return gemma4_text, gemma4_text.ModelArgs(
            hidden_size=a.hidden, num_hidden_layers=a.layers, intermediate_size=inter,
            num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
            head_dim=a.head_dim or a.hidden // a.heads,
            global_head_dim=2 * (a.head_dim or a.hidden // a.heads), vocab_size=a.vocab,
            vocab_size_per_layer_input=a.vocab, hidden_size_per_layer_input=a.ple,
            sliding_window=a.window, sliding_window_pattern=6,
            num_kv_shared_layers=a.kv_shared)
    return llama, llama.ModelArgs(model_type="llama", hidden_size=a.hidden,
                                  num_hidden_layers=a.layers, intermediate_size=inter,
                                  num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                                  rms_norm_eps=1e-5, vocab_size=a.vocab,
                                  tie_word_embeddings=False)


def build_model(a: argparse.Namespace):
    """The benchmark's model (``model_args``) in ``--dtype``, ``--quantize``d, LoRA'd."""
    from engine.model.arch import make_stack
    from engine.model.load import LoraSpec, attach_lora

    family, args = model_args(a)
    model = family.Model(args)
    model.set_dtype(getattr(mx, a.dtype))
    mx.eval(model.parameters())  # float32 init, then the cast: one at a time, not both
    if a.quantize:  # a quantized base (QLoRA-style), as mlx_lm.convert would make it
        import mlx.nn as nn

        nn.quantize(model, group_size=64, bits=a.quantize)
    keys = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    attach_lora(model, LoraSpec(rank=16, scale=2.0, keys=keys), seed=0)
    mx.eval(model.parameters())
    return model, make_stack(model)


def pair_batch(a: argparse.Namespace, shared: bool = False):
    """One pair (prompt:response 4:1, sequences ``--seq`` tokens); ``shared``: its split
    prefix-shared layout at the engine's ``--pad-multiple``."""
    from engine.data.batch import Pair, make_batch
    from engine.forward.layout_policy import resolve_pad_multiple
    from engine.forward.prefix import split_prefix_batch

    rng = np.random.default_rng(0)
    p = a.seq * 4 // 5 + 1
    r = a.seq + 1 - p
    ids = lambda n: rng.integers(10, a.vocab, n).tolist()  # noqa: E731
    pairs = [Pair("bench", ids(p), ids(r), ids(r))]
    if not shared:
        return make_batch(pairs, "full")
    return split_prefix_batch(pairs, "full", resolve_pad_multiple(a.pad_multiple),
                              attention="split")
