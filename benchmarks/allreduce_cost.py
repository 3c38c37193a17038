"""What data parallel sends each step: LoRA gradient bytes and ring all-reduce time.

    python -m benchmarks allreduce        # the table in docs/cluster.md

Counts r·(in + out) over each model's default LoRA targets (engine/model/arch: every attention
and MLP linear) and over q/k/v/o, at published shapes built by mlx-lm's own classes
(weights never evaluated, so nothing is allocated). The engine all-sums the gradients as
one float32 buffer; a ring all-reduce moves 2(N−1)/N of it per rank, timed at each
link's nominal rate.
"""

from __future__ import annotations

import argparse

import mlx.nn as nn

from benchmarks.bench_model import PRESETS, model_args
from engine.model.arch import make_stack

RANK = 16
QKVO = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINKS = (("1 GbE", 0.125e9), ("10 GbE", 1.25e9), ("TB4 (40 Gb/s)", 5e9), ("TB5 (80 Gb/s)", 10e9))


def lora_params(model: nn.Module, keys: tuple[str, ...] | None = None) -> int:
    stack = make_stack(model)
    keys = keys or stack.lora_keys()
    return sum(RANK * sum(m.weight.shape) for layer in stack.layers
               for path, m in layer.named_modules() if path in keys and isinstance(m, nn.Linear))


def models() -> dict[str, nn.Module]:
    from mlx_lm.models import llama

    def llama_model(hidden: int, layers: int, heads: int, inter: int) -> nn.Module:
        return llama.Model(llama.ModelArgs(
            model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
            intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=8,
            rms_norm_eps=1e-5, vocab_size=128256))

    family, args = model_args(argparse.Namespace(**{**PRESETS["e4b"], "head_dim": 256}))
    return {"Llama 3.2 3B": llama_model(3072, 28, 24, 8192),
            "Llama 3.1 8B": llama_model(4096, 32, 32, 14336),
            "Gemma 4 E4B (text)": family.Model(args)}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds >= 0.01 else f"{seconds * 1e3:.1f}"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m benchmarks allreduce", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter
                            ).parse_args(argv)  # no options: --help, or refuse what it gets
    print("| model | LoRA r=16 on | params | bytes a step | "
          + " | ".join(f"{name}, ms (2 / 4 / 8 ranks)" for name, _ in LINKS) + " |")
    print("|---" * (4 + len(LINKS)) + "|")
    for name, model in models().items():
        for what, keys in (("all attention + MLP linears", None), ("q/k/v/o", QKVO)):
            n = lora_params(model, keys)
            cells = [" / ".join(_ms(2 * (k - 1) / k * 4 * n / rate) for k in (2, 4, 8))
                     for _, rate in LINKS]
            print(f"| {name} | {what} | {n / 1e6:.1f}M | {4 * n / 1e6:.0f} MB | "
                  + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
