"""The engine benchmarks' options (``memory``, ``prefix``, ``attention``, ``profile``,
``ops``): one parser, a preset applied, values no row could use refused (exit 2)."""

from __future__ import annotations

import argparse

from benchmarks.bench_model import PRESETS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks memory",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="llama", choices=("llama", "gemma4_text"),
                   help="Random-init model family (gemma4_text: PLE, 5:1 sliding, shared K/V).")
    p.add_argument("--preset", choices=tuple(PRESETS),
                   help="A published shape (e4b: Gemma 4 E4B's text decoder); overrides the "
                        "size flags.")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=0, help="0 = 11/4 × hidden")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--head-dim", type=int, default=0, help="gemma4_text: 0 = hidden / heads "
                                                            "(full layers: twice that).")
    p.add_argument("--ple", type=int, default=256, help="gemma4_text: per-layer input width.")
    p.add_argument("--window", type=int, default=512, help="gemma4_text: sliding window.")
    p.add_argument("--kv-shared", type=int, default=0,
                   help="gemma4_text: last layers reading shared K/V.")
    p.add_argument("--seq", type=int, default=2048, help="Tokens per sequence (pair = 2).")
    p.add_argument("--dtype", default="float32", help="float32 on CPU; bfloat16 on GPUs.")
    p.add_argument("--quantize", type=int, default=0, choices=(0, 4, 8),
                   help="Quantize the base to 4 or 8 bits (group size 64) before LoRA.")
    p.add_argument("--segments", default="1,2,4", help="Segment sizes to measure.")
    p.add_argument("--head-chunk", type=int, default=512)
    p.add_argument("--mlp-chunk", type=int, default=0,
                   help="Tokens per MLP chunk, recomputed (the engine's mlp_chunk; 0 = off).")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--inflight", type=int, default=2,
                   help="Segments / head pieces evaluated at once (the engine's inflight).")
    p.add_argument("--memory-limit-gb", type=float, default=0.0,
                   help="MLX's memory limit in GiB (the engine's memory_limit_gb): past it, "
                        "evaluation waits for queued work to free its buffers (0 = MLX's "
                        "default).")
    p.add_argument("--rows", default="", help="Only these rows (comma-separated names).")
    p.add_argument("--ratios", default="1:1,4:1,16:1", help="prefix: prompt:response ratios.")
    p.add_argument("--pairs", type=int, default=1, help="prefix: pairs per micro-batch.")
    p.add_argument("--segment-size", type=int, default=0,
                   help="prefix: engine segment size; profile: the one profiled (0 = 1).")
    p.add_argument("--pad-multiple", type=int, default=-1,
                   help="prefix: pad lengths to a multiple of this (-1: the engine's default, "
                        "128 on CUDA, none elsewhere).")
    p.add_argument("--prefix", action="store_true",
                   help="profile: the pair in its split prefix-shared layout.")
    p.add_argument("--generations", type=int, default=8, help="group: completions a prompt (G).")
    p.add_argument("--completion", type=int, default=128, help="group: tokens a completion "
                                                               "(the prompt: --seq).")
    p.add_argument("--shapes", default="", help="attention: query:key lengths, comma-separated.")
    p.add_argument("--json", action="store_true", help="Print one JSON object {rows: [...]}.")
    p.add_argument("--row", help=argparse.SUPPRESS)  # internal: measure one row, print JSON
    return p


def parse(argv: list[str], kind: str = "memory", doc: str | None = None) -> argparse.Namespace:
    """The arguments, with a preset applied; a value no row could use is an error (exit 2).
    ``doc``: the kind's module docstring, for ``--help``."""
    p = parser()
    p.prog, p.description = f"python -m benchmarks {kind}", doc
    a = p.parse_args(argv)
    if a.preset:
        vars(a).update(PRESETS[a.preset])
    for name in ("layers", "hidden", "heads", "kv_heads", "vocab", "repeats", "inflight",
                 "window", "pairs"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be at least 1")
    for name in ("head_chunk", "mlp_chunk", "segment_size", "ple", "head_dim", "intermediate",
                 "memory_limit_gb"):
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be >= 0")
    if a.seq < 8:
        p.error(f"--seq {a.seq}: a pair needs at least 8 tokens per sequence")
    if not 0 <= a.kv_shared < a.layers:
        p.error(f"--kv-shared {a.kv_shared}: must be in [0, layers={a.layers})")
    if a.arch != "llama" and kind in ("profile", "ops"):
        p.error(f"bench {kind} times llama blocks only (--arch {a.arch})")
    return a
