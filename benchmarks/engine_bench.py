"""Benchmarks of the engine's levers, side by side with the plain path, in one run.

    python -m benchmarks memory --layers 16 --hidden 512 --seq 2048 [--json]
    python -m benchmarks prefix --seq 1024 [--ratios 1:1,4:1,16:1] [--json]
    python -m benchmarks attention --shapes 2048:2048,2047:2047 [--json]
    python -m benchmarks profile --seq 2048 --segment-size 1 [--prefix] [--json]
    python -m benchmarks ops --seq 8192 [--json]        (benchmarks/ops_bench.py)
    pomona bench memory|prefix ...                             (the same, from the CLI)

``prefix`` rows: one ORPO step on one pair, ``two_forward`` vs ``shared`` (one forward
over [prompt | chosen | rejected] with two fused causal attention calls per layer) vs
``shared_mask`` (the same with one block-sparse array mask), at each prompt:response
ratio (P + R = ``--seq``).

``attention`` rows: one causal ``mx.fast.scaled_dot_product_attention`` call at query:key
lengths ``--shapes``, forward alone and forward + backward — where MLX's fused kernels
apply on this device (what ``pad_multiple`` is chosen by). A row that crashes is reported
as such: the shapes that abort the process are the finding.

``profile``: where one segmented step's time goes, in one process — every phase (embed,
forward per segment, head, backward per segment) timed with its stages run one at a time
(so the sum exceeds an overlapped step; the split is the point), then one layer's
attention and MLP blocks alone, forward and forward + backward (``mx.vjp``). ``--prefix``
profiles the pair's split prefix-shared layout instead of two forwards.

Each row runs in a fresh process (MLX's peak and the process RSS are per process; mlx-lm's
checkpointing patches the layer class), on a random-init llama with LoRA r=16 on q/k/v/o,
one ORPO pair per step (prompt:response 4:1, both sequences ``--seq`` tokens).
Rows: ``plain`` (nn.value_and_grad), ``checkpoint`` (mlx-lm's per-layer mx.checkpoint),
``segK`` (segment_size K with the bounded head, ``--head-chunk``; ``segKd``, via
``--rows``, with the dense head; a suffix ``:N``, as in ``seg1:1``, sets that row's
``inflight``), and
``head_dense``/``head_bounded`` (the LM head alone: loss and dL/dh over all tokens at
``--vocab``). ``act_mb`` = peak − memory held before the step (weights, inputs).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any

import mlx.core as mx
import numpy as np

# Gemma 4 E4B's text decoder as published (the reference trainer's model).
PRESETS = {"e4b": dict(arch="gemma4_text", layers=42, hidden=2560, intermediate=10240,
                       heads=8, kv_heads=2, head_dim=256, vocab=262144, ple=256,
                       window=512, kv_shared=18)}


def _model_args(a: argparse.Namespace):
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


def _model(a: argparse.Namespace):
    from engine.arch import make_stack
    from engine.model import LoraSpec, attach_lora

    family, args = _model_args(a)
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


def _pair_batch(a: argparse.Namespace, shared: bool = False):
    """One pair (prompt:response 4:1, sequences ``--seq`` tokens); ``shared``: its split
    prefix-shared layout at the engine's ``--pad-multiple``."""
    from engine.batch import Pair, make_batch
    from engine.layout_policy import resolve_pad_multiple
    from engine.prefix import split_prefix_batch

    rng = np.random.default_rng(0)
    p = a.seq * 4 // 5 + 1
    r = a.seq + 1 - p
    ids = lambda n: rng.integers(10, a.vocab, n).tolist()  # noqa: E731
    pairs = [Pair("bench", ids(p), ids(r), ids(r))]
    if not shared:
        return make_batch(pairs, "full")
    return split_prefix_batch(pairs, "full", resolve_pad_multiple(a.pad_multiple),
                              attention="split")


def _step_fn(name: str, model, stack, batch, head_chunk: int, inflight: int):
    from engine.batch import batch_norms
    from engine.losses import LossSpec, pair_loss
    from engine.prefix import pair_batch
    from engine.segmented import value_and_grad

    pairs = pair_batch(batch)
    norms, spec = batch_norms([pairs]), LossSpec()
    resp, nll = mx.array(pairs.resp_mask), mx.array(pairs.nll_mask)

    def loss_fn(lp):
        return pair_loss(lp, resp, nll, spec, norms)

    if name == "checkpoint":
        from mlx_lm.tuner.trainer import grad_checkpoint

        grad_checkpoint(stack.layers[0])
    k = int(name[3:].rstrip("dp")) if name.startswith("seg") else 0
    # Segmented rows bound the head too (its dense logits would otherwise set their peak);
    # "segKd" keeps the dense head, to tell the two levers' costs apart.
    chunk = head_chunk if k and not name.endswith("d") else 0
    return lambda: value_and_grad(model, stack, batch, loss_fn, k, chunk, inflight)


def _head_fn(name: str, stack, a: argparse.Namespace):
    from engine.head import bounded_head_grad, dense_logps

    n, t = 2, a.seq
    h = mx.random.normal((n, t, a.hidden), key=mx.random.key(0)).astype(getattr(mx, a.dtype))
    targets = np.random.default_rng(1).integers(0, a.vocab, (n, t)).astype(np.int32)
    mx.eval(h)

    def loss_fn(lp):
        return -lp.mean(), {}

    if name == "head_dense":
        tg = mx.array(targets)
        return lambda: mx.value_and_grad(lambda x: loss_fn(dense_logps(stack, x, tg)))(h)
    active = np.ones((n, t), bool)
    return lambda: bounded_head_grad(stack, h, targets, active, loss_fn, a.head_chunk,
                                     a.inflight)


def _prefix_fn(path: str, ratio: str, model, stack, a: argparse.Namespace):
    """One ORPO step, shared or two-forward, at prompt:response ``ratio`` (seq = P + R)."""
    from engine.batch import Pair, batch_norms, make_batch
    from engine.layout_policy import resolve_pad_multiple
    from engine.losses import LossSpec, pair_loss
    from engine.prefix import split_prefix_batch
    from engine.segmented import value_and_grad

    num, den = (int(x) for x in ratio.split(":"))
    p = a.seq * num // (num + den)
    r = a.seq - p + 1
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(10, a.vocab, n).tolist()  # noqa: E731
    pairs = [Pair(f"bench{i}", ids(p), ids(r), ids(r)) for i in range(a.pairs)]
    pad = resolve_pad_multiple(a.pad_multiple)
    two = make_batch(pairs, "full", pad)
    attention = "mask" if path == "shared_mask" else "split"
    batch = two if path == "two_forward" else split_prefix_batch(pairs, "full", pad,
                                                                 attention=attention, two=two)
    norms, spec = batch_norms([two]), LossSpec()
    resp, nll = mx.array(two.resp_mask), mx.array(two.nll_mask)
    fn = lambda: value_and_grad(model, stack, batch,  # noqa: E731
                                lambda lp: pair_loss(lp, resp, nll, spec, norms),
                                a.segment_size, a.head_chunk, a.inflight)
    return fn, {"ratio": ratio, "path": path, "pairs": a.pairs, "prompt_tokens": p,
                "response_tokens": 2 * r}


def _attention_row(shape: str, a: argparse.Namespace) -> dict[str, Any]:
    """Forward and forward+backward time of one causal attention call, q:k = ``shape``."""
    lq, lk = (int(x) for x in shape.split(":"))
    dtype, d = getattr(mx, a.dtype), a.hidden // a.heads
    key = mx.random.key(0)
    q = mx.random.normal((1, a.heads, lq, d), key=key).astype(dtype)
    k, v = (mx.random.normal((1, a.kv_heads, lk, d), key=key).astype(dtype) for _ in "kv")

    def attend(q, k, v):
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask="causal")
        return out.astype(mx.float32).sum()

    out: dict[str, Any] = {"name": shape, "q": lq, "k": lk}
    for label, fn in (("fwd", attend), ("fwd_bwd", mx.grad(attend, argnums=(0, 1, 2)))):
        mx.eval(fn(q, k, v))
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        for _ in range(a.repeats):
            mx.eval(fn(q, k, v))
        out[f"{label}_ms"] = (time.perf_counter() - t0) / a.repeats * 1e3
        out[f"{label}_peak_mb"] = mx.get_peak_memory() / 2**20
    return out


def run_row(row: str, a: argparse.Namespace) -> dict[str, Any]:
    """Measure one row in this process."""
    if a.shapes:
        return _attention_row(row, a)
    name, depth = row, ""
    if "@" not in row:  # "seg1:1": this row at inflight 1 (prefix rows are "path@P:R")
        name, _, depth = row.partition(":")
    if depth:
        a = argparse.Namespace(**{**vars(a), "inflight": int(depth)})
    if a.memory_limit_gb:
        mx.set_memory_limit(int(a.memory_limit_gb * 2**30))  # as TrainConfig's
    model, stack = _model(a)
    if a.mlp_chunk and name.startswith("seg"):  # the engine's lever; baselines stay mlx-lm's
        from engine.recompute import chunk_mlps

        chunk_mlps(stack.layers, a.mlp_chunk)
    weights = mx.get_active_memory()
    extra: dict[str, Any] = {}
    if name.startswith(("shared@", "shared_mask@", "two_forward@")):
        path, ratio = name.split("@")
        fn, extra = _prefix_fn(path, ratio, model, stack, a)
    elif name.startswith("head_"):
        fn = _head_fn(name, stack, a)
    else:
        shared = name.startswith("seg") and name.endswith("p")  # segKp: prefix-shared
        fn = _step_fn(name, model, stack, _pair_batch(a, shared), a.head_chunk, a.inflight)
    base = mx.get_active_memory()  # weights and inputs: what the step itself does not add
    mx.eval(fn())  # warm-up (kernel compilation, allocator)
    mx.reset_peak_memory()
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    peak = mx.get_peak_memory()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_mb = rss / 2**20 if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB here
    return {"name": row, "peak_mb": peak / 2**20, "rss_mb": rss_mb,
            "weights_mb": weights / 2**20, "act_mb": (peak - base) / 2**20,
            "step_s": float(np.median(times)), **extra}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks memory", description=__doc__,
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
    p.add_argument("--shapes", default="", help="attention: query:key lengths, comma-separated.")
    p.add_argument("--json", action="store_true", help="Print one JSON object {rows: [...]}.")
    p.add_argument("--row", help=argparse.SUPPRESS)  # internal: measure one row, print JSON
    return p


def _ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    by = {r["name"]: r for r in rows}
    out: dict[str, float] = {}
    if "plain" in by:
        for r in rows:
            if r["name"] != "plain" and not r["name"].startswith("head_"):
                out[f"{r['name']}_act_vs_plain"] = r["act_mb"] / by["plain"]["act_mb"]
                out[f"{r['name']}_time_vs_plain"] = r["step_s"] / by["plain"]["step_s"]
    if "head_dense" in by and "head_bounded" in by:
        out["head_bounded_act_vs_dense"] = by["head_bounded"]["act_mb"] / by["head_dense"]["act_mb"]
    return out


def _prefix_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per ratio: shared / two-forward step time, and the target it must stay under."""
    out: dict[str, float] = {}
    by = {(r["ratio"], r["path"]): r for r in rows}
    for ratio in dict.fromkeys(r["ratio"] for r in rows):
        two = by.get((ratio, "two_forward"))
        for path in ("shared", "shared_mask"):
            shared = by.get((ratio, path))
            if two and shared:
                p, resp = shared["prompt_tokens"], shared["response_tokens"]
                out[f"{ratio}_{path}_time_vs_two_forward"] = shared["step_s"] / two["step_s"]
                out[f"{ratio}_target"] = (p + resp) / (2 * p + resp) + 0.10
                out[f"{ratio}_{path}_peak_vs_two_forward"] = shared["peak_mb"] / two["peak_mb"]
    return out


def profile(a: argparse.Namespace) -> dict[str, Any]:
    """Phase times of one step, then one layer's blocks alone (module docstring)."""
    from engine.inflight import observe_phases

    model, stack = _model(a)
    k = a.segment_size or 1
    batch = _pair_batch(a, shared=a.prefix)
    step = _step_fn(f"seg{k}", model, stack, batch, a.head_chunk, a.inflight)
    mx.eval(step())  # warm-up
    marks: list[tuple[str, float]] = []
    with observe_phases(lambda phase: marks.append((phase, time.perf_counter()))):
        t0 = time.perf_counter()
        mx.eval(step())
    starts = [t0] + [t for _, t in marks[:-1]]
    phases = [{"phase": name, "ms": (t - s) * 1e3}
              for (name, t), s in zip(marks, starts, strict=True)]
    return {"phases": phases, "blocks": _block_times(stack, a)}


def _block_times(stack, a: argparse.Namespace) -> list[dict[str, Any]]:
    """One layer's attention and MLP (each with its norm), forward and forward+backward."""
    layer = stack.layers[0]
    x = mx.random.normal((2, a.seq, a.hidden), key=mx.random.key(1)).astype(getattr(mx, a.dtype))
    blocks = {"attention": lambda h: layer.self_attn(layer.input_layernorm(h), "causal", None),
              "mlp": lambda h: layer.mlp(layer.post_attention_layernorm(h)),
              "layer": lambda h: layer(h, "causal", None)}
    rows = []
    for name, fn in blocks.items():
        def both(h, fn=fn):
            return mx.vjp(fn, [h], [mx.ones_like(h)])
        for kind, run in (("fwd", fn), ("fwd+bwd", both)):
            mx.eval(run(x))
            t0 = time.perf_counter()
            for _ in range(a.repeats):
                mx.eval(run(x))
            rows.append({"block": name, "pass": kind,
                         "ms": (time.perf_counter() - t0) / a.repeats * 1e3})
    return rows


def _print_profile(result: dict[str, Any]) -> None:
    total = sum(p["ms"] for p in result["phases"])
    for p in result["phases"]:
        print(f"{p['phase']:>16}  {p['ms']:9.2f} ms  {100 * p['ms'] / total:5.1f}%")
    print(f"{'sum':>16}  {total:9.2f} ms")
    for b in result["blocks"]:
        print(f"{b['block'] + ' ' + b['pass']:>20}  {b['ms']:9.3f} ms")


def _attention_table(argv: list[str], a: argparse.Namespace) -> int:
    """Every shape in its own process; one that dies is a row saying so."""
    rows = []
    for shape in (a.shapes or "2048:2048,2047:2047,1920:2048,2048:2125").split(","):
        proc = subprocess.run([sys.executable, "-m", "benchmarks", "attention", *argv,
                               "--shapes", shape, "--row", shape], capture_output=True, text=True)
        if proc.returncode == 0:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        else:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:200]
            rows.append({"name": shape, "error": f"exit {proc.returncode}: {last}"})
        if not a.json:
            r = rows[-1]
            print(f"{shape:>11}  " + (r.get("error") or
                  f"fwd {r['fwd_ms']:7.2f} ms  fwd+bwd {r['fwd_bwd_ms']:7.2f} ms  "
                  f"peak {r['fwd_bwd_peak_mb']:8.1f} MB"), flush=True)
    if a.json:
        print(json.dumps({"config": {k: v for k, v in vars(a).items() if k != "row"},
                          "device": str(mx.default_device()), "rows": rows}))
    return 0


def parse(argv: list[str], kind: str = "memory") -> argparse.Namespace:
    """The arguments, with a preset applied; a value no row could use is an error (exit 2)."""
    p = parser()
    p.prog = f"python -m benchmarks {kind}"
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


def main(argv: list[str], kind: str = "memory") -> int:
    a = parse(argv, kind)
    if a.row:
        print(json.dumps(run_row(a.row, a)))
        return 0
    names = ["plain", "checkpoint", *[f"seg{k}" for k in a.segments.split(",") if k],
             "head_dense", "head_bounded"]
    if kind == "prefix":
        names = [f"{p}@{r}" for r in a.ratios.split(",")
                 for p in ("two_forward", "shared", "shared_mask")]
    if kind == "attention":
        return _attention_table(argv, a)
    if kind == "ops":
        from benchmarks.ops_bench import op_rows, print_rows

        _, stack = _model(argparse.Namespace(**{**vars(a), "layers": 1}))
        rows = op_rows(stack.layers[0], a)
        if a.json:
            print(json.dumps({"config": vars(a), "device": str(mx.default_device()),
                              "rows": rows}))
        else:
            print_rows(rows)
        return 0
    if kind == "profile":
        result = profile(a)
        if a.json:
            print(json.dumps({"config": vars(a), "device": str(mx.default_device()), **result}))
        else:
            _print_profile(result)
        return 0
    if a.rows:
        names = a.rows.split(",")
    rows = []
    for name in names:
        proc = subprocess.run([sys.executable, "-m", "benchmarks", kind, *argv,
                               "--row", name], capture_output=True, text=True)
        if proc.returncode != 0:  # out of memory, say: the row says so, the table goes on
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
            print(f"row {name} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            rows.append({"name": name, "error": f"exit {proc.returncode}: {last}"})
        else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        if not a.json:
            r = rows[-1]
            print(f"{name:>13}  " + (r.get("error") or
                  f"peak {r['peak_mb']:9.1f} MB  act {r['act_mb']:9.1f} MB  "
                  f"rss {r['rss_mb']:9.1f} MB  step {r['step_s']:7.3f} s"), flush=True)
    rows_ok = [r for r in rows if "error" not in r]
    ratios = _prefix_ratios(rows_ok) if kind == "prefix" else _ratios(rows_ok)
    if a.json:
        print(json.dumps({"config": {k: v for k, v in vars(a).items() if k != "row"},
                          "device": str(mx.default_device()), "rows": rows, "ratios": ratios}))
    else:
        for k, v in ratios.items():
            print(f"{k:>32}  {v:.3f}")
    return 0
