"""Where one layer's backward keeps its memory: the engine's segment vjp, layer by layer.

    python -m benchmarks layer-memory --seq 8192 --dtype bfloat16 --quantize 4 \
        --mlp-chunk 1024 [--layers 12 --kv-shared 6] [--memory-limit-gb 4] [--json]

Builds a Gemma 4 E4B-wide text decoder (hidden 2560, intermediate 10240, 20480 in the
KV-shared layers, heads 8 × 256, full layers 512) with fewer layers, runs the forward of
one pair in its split prefix-shared layout (as ``seg1p``), and then, for each layer in
``--at`` (default: the first sliding, the last donor, the last full and the last layer),
measures the peak above what is held before (weights, boundaries) of:

- ``layer``: the engine's one-layer segment vjp (engine/backward/segmented.py), as a step runs it;
- ``attn``: that layer's attention block alone (norm, q/k/v/o with LoRA, attention);
- ``mlp``: its MLP alone (chunked when ``--mlp-chunk``), cotangent for its input only.

``--memory-limit-gb`` sets MLX's memory limit (engine/settings/config.py); ``--cpu-blocks`` makes
a CPU run block full layers as a GPU does (engine/model/attention.py).
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np

from benchmarks.bench_args import parser as bench_parser
from benchmarks.bench_model import build_model, pair_batch
from engine.backward.segmented import Segment
from engine.forward.prefix_patch import layout_masks
from engine.model import attention
from engine.model.recompute import chunk_mlps


def _measure(fn) -> float:
    """Peak MiB above the memory held when ``fn`` starts; fn's outputs are evaluated."""
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    out = fn()
    mx.eval(out)
    mx.synchronize()
    peak = mx.get_peak_memory()
    del out
    return (peak - base) / 2**20


def _kind(stack, i: int) -> str:
    layer = stack.layers[i]
    width = layer.mlp.gate_proj.weight.shape[0]
    if hasattr(layer.mlp.gate_proj, "bits"):
        width = layer.mlp.gate_proj.scales.shape[0]
    role = "consumer" if i in stack.donor_of else ("donor" if i in stack.donors else "")
    return f"{layer.layer_type.split('_')[0]} {role} mlp {width}".replace("  ", " ")


def _layer_row(stack, masks, states: dict, i: int, h_in: mx.array, seg: Segment,
               cot: mx.array) -> dict:
    """Layer i's three measurements (module docstring), from its input ``h_in``."""
    layer = stack.layers[i]
    state_cots = {d: tuple(mx.zeros_like(x) for x in states[d]) for d in seg.exports}
    row = {"layer": i, "kind": _kind(stack, i), "tokens": int(h_in.shape[1])}
    row["layer_mb"] = _measure(lambda: seg.vjp(h_in, cot, state_cots, True))
    x = layer.input_layernorm(h_in)
    mask = masks(stack.window(i))
    shared = states[stack.donor_of[i]] if i in stack.donor_of else None

    def attn(x_: mx.array) -> mx.array:
        return layer.self_attn(x_, mask, None, shared_kv=shared, offset=0)[0]

    row["attn_mb"] = _measure(lambda: mx.vjp(attn, [x], [cot])[1])
    row["mlp_mb"] = _measure(lambda: mx.vjp(layer.mlp, [x], [cot])[1])
    return row


def main(argv: list[str] | None = None) -> int:
    p = bench_parser()
    p.prog = "python -m benchmarks layer-memory"
    p.add_argument("--at", default="", help="Layer indices (default: one of each kind).")
    p.add_argument("--cpu-blocks", action="store_true")
    a = p.parse_args(argv)
    vars(a).update(arch="gemma4_text", hidden=2560, intermediate=10240, heads=8, kv_heads=2,
                   head_dim=256, ple=256, window=512)
    if a.layers == 16:  # bench's default: a short E4B with both kinds of shared layer
        a.layers, a.kv_shared = 12, 6
    a.vocab = min(a.vocab, 4096)  # the head is not measured here
    if a.cpu_blocks:
        attention.full_block = lambda q: (attention.FULL_BLOCK if q.shape[-1] > 128
                                          and q.shape[2] > attention.FULL_BLOCK else 0)
    if a.memory_limit_gb:
        mx.set_memory_limit(int(a.memory_limit_gb * 2**30))
    model, stack = build_model(a)
    chunk_mlps(stack.layers, a.mlp_chunk)
    batch = pair_batch(a, shared=True)
    at = [int(x) for x in a.at.split(",") if x] or sorted({
        0, max(stack.donors), max(i for i in range(len(stack.layers)) if stack.window(i) is None),
        len(stack.layers) - 1})
    with layout_masks(model, batch) as masks:
        tokens = mx.array(batch.inputs)
        h = stack.embed(tokens)
        side = stack.side(tokens, h, masks)
        mx.eval(h, side)
        states, inputs = {}, []
        for i in range(len(stack.layers)):
            seg = Segment(stack, i, i + 1, masks, side, states)
            inputs.append((h, seg))
            h, exported = seg.forward(h, seg.inputs)
            states.update(exported)
            mx.eval(h, exported)
        held = mx.get_active_memory() / 2**20
        rng = np.random.default_rng(0)
        cot = mx.array(rng.standard_normal(h.shape).astype(np.float32) * 1e-3).astype(h.dtype)
        for i in at:
            row = _layer_row(stack, masks, states, i, *inputs[i], cot)
            print(json.dumps(row) if a.json else
                  f"layer {i:2d} ({row['kind']}): segment vjp {row['layer_mb']:.0f} MiB, "
                  f"attention {row['attn_mb']:.0f}, MLP {row['mlp_mb']:.0f}", flush=True)
    print(f"held before the backward (weights, {len(inputs)} boundaries, side inputs): "
          f"{held:.0f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
