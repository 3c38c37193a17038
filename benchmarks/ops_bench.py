"""``bench ops``: one layer's attention block split by op, forward and forward + backward.

    python -m benchmarks ops --hidden 2048 --heads 32 --kv-heads 8 --seq 8192 [--json]

Each op runs alone on the input it gets inside mlx-lm's llama attention (batch 2 × seq:
the pair), in the layout it gets there — q/k/v arrive as transposed views
``[B, L, H·D] → [B, H, L, D]``, so rope and attention see non-contiguous inputs; the
``*_contig`` rows feed the same op a contiguous copy to tell layout costs from op costs.
``q_proj_base`` is the frozen matmul alone, ``q_proj_mlx_lm`` mlx-lm's own LoRA call
(float32 factors times a bf16 input) against the engine's (``q_proj``).
``lora_*`` rows take the LoRA factors as inputs too, so their fwd+bwd holds the factors'
gradients: ``lora_q`` is the engine's call, ``lora_q_addmm`` the same sum with the frozen
output and the scale folded into the epilogue of the rank-r ``(x @ A) @ B`` GEMM
(``mx.addmm``: no separate scale and add passes over [B, L, out]; the frozen GEMM itself is
unchanged), ``lora_qkv`` the engine's three q/k/v calls and
``lora_qkv_shared_a`` one ``x @ [A_q | A_k | A_v]`` (x read once) then three addmm.
``layer`` is the whole decoder layer (attention and MLP, its LoRA factors as inputs) and
``layer_compiled`` the same under ``mx.compile`` (forward, and forward + vjp, each traced
once): what compiling a segment's functions would save per layer, kernels fused and host
work replayed.
``fwd+bwd`` is ``mx.vjp`` with respect to the op's array inputs (the ``*_proj`` rows leave
the LoRA parameter gradients out: rank 16, a small share). ``block`` rows are the whole
attention block (norm, projections, rope, attention, output projection); ``block_norope``
replaces rope by the identity, so block − block_norope is what rope costs in place.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx


def _timed(fn: Callable, args: list[mx.array], repeats: int) -> float:
    mx.eval(fn(*args))  # warm-up: kernels compiled, allocator primed
    t0 = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn(*args))
    return (time.perf_counter() - t0) / repeats * 1e3


def _vjp(fn: Callable) -> Callable:
    def both(*xs):
        out = fn(*xs)
        cot = mx.ones_like(out)
        return mx.vjp(fn, list(xs), [cot])
    return both


class _Identity:
    def __call__(self, x, offset=0):
        return x


def ops(layer, a: argparse.Namespace) -> dict[str, tuple[Callable, list[mx.array]]]:
    """Op name → (function, inputs) for ``layer``'s attention at batch 2 × ``a.seq``."""
    from mlx_lm.tuner.lora import LoRALinear

    attn, dtype = layer.self_attn, getattr(mx, a.dtype)
    b, n, h, kv = 2, a.seq, attn.n_heads, attn.n_kv_heads
    d = a.hidden // h

    def rnd(*shape, seed=0):
        return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)

    x, q2, k2, v2 = rnd(b, n, a.hidden), rnd(b, n, h * d, seed=1), rnd(b, n, kv * d, seed=2), \
        rnd(b, n, kv * d, seed=3)
    heads = lambda t, m: t.reshape(b, n, m, d).transpose(0, 2, 1, 3)  # noqa: E731
    q4, k4, v4 = (mx.contiguous(heads(t, m)) for t, m in ((q2, h), (k2, kv), (v2, kv)))
    sdpa = lambda q, k, v: mx.fast.scaled_dot_product_attention(  # noqa: E731
        q, k, v, scale=attn.scale, mask="causal")

    def block_norope(t):
        rope, attn.rope = attn.rope, _Identity()
        try:
            return attn(layer.input_layernorm(t), mask="causal")
        finally:
            attn.rope = rope

    return {
        **lora_ops(attn, x),
        "norm": (layer.input_layernorm, [x]),
        "q_proj": (attn.q_proj, [x]),
        "q_proj_base": (attn.q_proj.linear, [x]),  # the frozen matmul alone
        "q_proj_mlx_lm": (lambda t: LoRALinear.__call__(attn.q_proj, t), [x]),
        "k_proj": (attn.k_proj, [x]),
        "v_proj": (attn.v_proj, [x]),
        "rope_q": (lambda t: attn.rope(heads(t, h)), [q2]),
        "rope_q_contig": (attn.rope, [q4]),
        "rope_k": (lambda t: attn.rope(heads(t, kv)), [k2]),
        "sdpa": (lambda q, k, v: sdpa(heads(q, h), heads(k, kv), heads(v, kv)), [q2, k2, v2]),
        "sdpa_contig": (sdpa, [q4, k4, v4]),
        "o_proj": (lambda o: attn.o_proj(o.transpose(0, 2, 1, 3).reshape(b, n, -1)), [q4]),
        "block": (lambda t: attn(layer.input_layernorm(t), mask="causal"), [x]),
        "block_norope": (block_norope, [x]),
    }


def lora_ops(attn, x: mx.array) -> dict[str, tuple[Callable, list[mx.array]]]:
    """The LoRA variants of q (and q/k/v) on ``x``, factors as inputs (module docstring)."""
    projs = [attn.q_proj, attn.k_proj, attn.v_proj]
    factors = [t for p in projs for t in (p.lora_a, p.lora_b)]
    scales = [p.scale for p in projs]

    def engine(i: int, t: mx.array, a: mx.array, b: mx.array) -> mx.array:
        a, b = a.astype(t.dtype), b.astype(t.dtype)  # engine/model/load.py's call
        return projs[i].linear(t) + scales[i] * ((t @ a) @ b)

    def addmm(i: int, t: mx.array, low: mx.array, b: mx.array) -> mx.array:
        return mx.addmm(projs[i].linear(t), low, b.astype(t.dtype), alpha=scales[i])

    def qkv(t, *ab):
        return mx.concatenate([engine(i, t, ab[2 * i], ab[2 * i + 1]) for i in range(3)], -1)

    def qkv_shared(t, *ab):
        a = mx.concatenate(ab[0::2], axis=1).astype(t.dtype)
        lows = mx.split(t @ a, 3, axis=-1)
        return mx.concatenate([addmm(i, t, lows[i], ab[2 * i + 1]) for i in range(3)], -1)

    return {
        "lora_q": (lambda t, a, b: engine(0, t, a, b), [x, *factors[:2]]),
        "lora_q_addmm": (lambda t, a, b: addmm(0, t, t @ a.astype(t.dtype), b),
                         [x, *factors[:2]]),
        "lora_qkv": (qkv, [x, *factors]),
        "lora_qkv_shared_a": (qkv_shared, [x, *factors]),
    }


def layer_fn(layer) -> tuple[Callable, list[mx.array]]:
    """``layer`` as a function of (x, its LoRA factors), and those factors."""
    from engine.model.load import lora_modules

    loras = [m for _, m in lora_modules(layer)]
    factors = [t for m in loras for t in (m.lora_a, m.lora_b)]

    def fn(t: mx.array, *ab: mx.array) -> mx.array:
        for m, a, b in zip(loras, ab[0::2], ab[1::2], strict=True):
            m.lora_a, m.lora_b = a, b
        try:
            return layer(t, "causal", None)
        finally:  # the module holds its own arrays again (a trace leaves none behind)
            for m, a, b in zip(loras, factors[0::2], factors[1::2], strict=True):
                m.lora_a, m.lora_b = a, b

    return fn, factors


def op_rows(layer, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every op's forward and forward+backward milliseconds."""
    rows = []
    for name, (fn, args) in ops(layer, a).items():
        rows.append({"op": name, "fwd_ms": _timed(fn, args, a.repeats),
                     "fwd_bwd_ms": _timed(_vjp(fn), args, a.repeats)})
    fn, factors = layer_fn(layer)
    x = mx.random.normal((2, a.seq, a.hidden), key=mx.random.key(4)).astype(getattr(mx, a.dtype))
    for name, wrap in (("layer", lambda f: f), ("layer_compiled", mx.compile)):
        rows.append({"op": name, "fwd_ms": _timed(wrap(fn), [x, *factors], a.repeats),
                     "fwd_bwd_ms": _timed(wrap(_vjp(fn)), [x, *factors], a.repeats)})
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(f"{r['op']:>17}  fwd {r['fwd_ms']:8.3f} ms  fwd+bwd {r['fwd_bwd_ms']:8.3f} ms  "
              f"bwd {r['fwd_bwd_ms'] - r['fwd_ms']:8.3f} ms", flush=True)


def main(argv: list[str]) -> int:
    import json

    from benchmarks.bench_args import parse
    from benchmarks.bench_model import build_model

    a = parse(argv, "ops", __doc__)
    _, stack = build_model(argparse.Namespace(**{**vars(a), "layers": 1}))
    rows = op_rows(stack.layers[0], a)
    if a.json:
        print(json.dumps({"config": vars(a), "device": str(mx.default_device()), "rows": rows}))
    else:
        print_rows(rows)
    return 0
