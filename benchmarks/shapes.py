"""``python -m benchmarks shape``: a published model's shape as a model directory, random weights.

The GPU proofs train real shapes through the trainer a user runs (``python -m engine train
--model DIR``), so the shape must be an ordinary directory mlx_lm.load reads: mlx-lm's own
classes at the published config, seeded random weights in the chosen dtype, quantized the
way ``mlx_lm.convert`` does with ``--quantize``, and Pomona's small local tokenizer (the
data are token ids; the tokenizer only has to load).

    python -m benchmarks shape --preset e4b --dtype bfloat16 [--quantize 4] --out /tmp/e4b
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from engine.host.parsers import OneLineParser

# Published text-decoder configs (random weights: the shape is what is measured).
PRESETS = {
    "e4b": {"model_type": "gemma4_text", "hidden_size": 2560, "num_hidden_layers": 42,
            "intermediate_size": 10240, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 256, "global_head_dim": 512, "vocab_size": 262144,
            "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256,
            "sliding_window": 512, "sliding_window_pattern": 6, "num_kv_shared_layers": 18},
    "gemma3-4b": {"model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34,
                  "intermediate_size": 10240, "num_attention_heads": 8,
                  "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 262208,
                  "sliding_window": 1024, "sliding_window_pattern": 6,
                  "query_pre_attn_scalar": 256,
                  "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    # E4B's structure at a CPU's size (benchmark code paths, not figures): 5 sliding
    # layers to 1 full, wider full heads, shared K/V in the last third, per-layer inputs.
    "e4b-mini": {"model_type": "gemma4_text", "hidden_size": 128, "num_hidden_layers": 12,
                 "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 32, "global_head_dim": 64, "vocab_size": 4096,
                 "vocab_size_per_layer_input": 4096, "hidden_size_per_layer_input": 16,
                 "sliding_window": 64, "sliding_window_pattern": 6,
                 "num_kv_shared_layers": 4},
}


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m benchmarks shape", description=__doc__.splitlines()[0])
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--out", required=True, help="New directory for the model.")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--quantize", type=int, choices=[4, 8], help="Bits, group size 64.")
    p.add_argument("--layers", type=int, help="Fewer layers than published (a quick look).")
    p.add_argument("--seed", type=int, default=0)
    return p


def min_layers(config: dict) -> int:
    """The fewest layers a preset builds with: Gemma 4's last ``num_kv_shared_layers`` read
    the K/V of an earlier layer of their type, so a full pattern of non-shared layers
    (sliding and full) must come first; mlx-lm fails with a KeyError otherwise."""
    shared = config.get("num_kv_shared_layers", 0)
    return shared + config.get("sliding_window_pattern", 1) if shared else 1


def write_shape(preset: str, out: Path, dtype: str = "bfloat16", quantize: int | None = None,
                layers: int | None = None, seed: int = 0) -> Path:
    """The model directory (module docstring); refuses a non-empty ``out``."""
    import importlib

    import mlx.core as mx
    from mlx_lm.utils import quantize_model, save_config, save_model

    from tasks.models.model_factory import ModelSpec, tokenizer_config, train_tokenizer

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out}: exists and is not an empty folder; choose a new "
                              "--out")
    config = dict(PRESETS[preset], **({"num_hidden_layers": layers} if layers else {}))
    if layers is not None and layers < min_layers(PRESETS[preset]):
        raise ValueError(f"--layers {layers}: preset {preset} needs at least "
                         f"{min_layers(PRESETS[preset])} (its shared K/V layers read a "
                         "non-shared layer of each attention type)")
    family = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)  # mlx-lm's initialisers draw from MLX's global key
    model = family.Model(family.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    full = {**dataclasses.asdict(model.args), **config}
    if quantize:
        model, full = quantize_model(model, full, group_size=64, bits=quantize)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(full, config_path=out / "config.json")
    spec = ModelSpec(vocab=1024)
    train_tokenizer(spec).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(spec), indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        path = write_shape(a.preset, Path(a.out), a.dtype, a.quantize, a.layers, a.seed)
    except (ValueError, OSError) as err:  # a refusal: one line, as the parser's own
        print(f"error: shape: {err}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in path.iterdir()) / 1e9
    print(f"wrote {a.preset} ({a.dtype}{f', {a.quantize}-bit' if a.quantize else ''}) to "
          f"{path} [{size:.1f} GB]")
    return 0
