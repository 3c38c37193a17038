"""torch's causal attention at ``bench attention``'s shapes: the peer MLX's kernel is held to.

    python3 benchmarks/torch_attention.py --shapes 4096:4096,8192:8192 [--heads 32 --kv-heads 8]

Runs in a torch environment (no MLX). One causal ``F.scaled_dot_product_attention`` call
per shape on [1, H, L, D] inputs, keys and values at ``--kv-heads`` (GQA, as the 1.1B
anchor: 32/8, head dim 64), forward alone and forward + backward, each timed over
``--repeats`` calls between CUDA synchronisations, as ``bench attention`` times MLX's
(``mx.fast.scaled_dot_product_attention``). Prints one JSON line per shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def row(shape: str, a: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    lq, lk = (int(x) for x in shape.split(":"))
    d = a.hidden // a.heads
    g = torch.Generator(device="cuda").manual_seed(0)

    def draw(heads: int, length: int) -> torch.Tensor:
        return torch.randn(1, heads, length, d, device="cuda", dtype=torch.bfloat16,
                           generator=g).requires_grad_()

    q, k, v = draw(a.heads, lq), draw(a.kv_heads, lk), draw(a.kv_heads, lk)

    def fwd() -> torch.Tensor:  # bottom-right causal, as MLX's "causal" with lq <= lk
        return F.scaled_dot_product_attention(q, k, v, is_causal=lq == lk, scale=d**-0.5,
                                              enable_gqa=True).float().sum()

    def fwd_bwd() -> None:
        torch.autograd.grad(fwd(), (q, k, v))

    out = {"name": shape, "q": lq, "k": lk, "torch": torch.__version__}
    for label, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        with torch.no_grad() if label == "fwd" else torch.enable_grad():
            fn()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for _ in range(a.repeats):
                fn()
            torch.cuda.synchronize()
        out[f"{label}_ms"] = (time.perf_counter() - t0) / a.repeats * 1e3
        out[f"{label}_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/torch_attention.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="4096:4096,8192:8192")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)
    for shape in a.shapes.split(","):
        print(json.dumps(row(shape, a)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
