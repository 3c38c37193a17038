"""What one optimizer update costs beside the step: the trainer's compiled clip + AdamW on
the benchmark's LoRA arrays (16 layers, r16 on q/k/v/o, hidden 2048, kv 512), host
dispatch and evaluation apart, against variants (issue 15's trainer-vs-engine gap):
uncompiled (``eager``), without clipping, and ``flat_concat`` — an AdamW-shaped update
(not the trainer's exact maths) over one concatenation of every array, sliced back: what
fusing across arrays would save. Results: docs/performance.md (end to end).

    python -m benchmarks update [--layers 16] [--hidden 2048] [--kv 512] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from engine.backward.segmented import grads_to_tree


class Lora(nn.Module):
    def __init__(self, a: argparse.Namespace):
        super().__init__()
        shapes = {"q": (a.hidden, a.hidden), "k": (a.hidden, a.kv), "v": (a.hidden, a.kv),
                  "o": (a.hidden, a.hidden)}
        self.layers = [{k: {"lora_a": mx.zeros((i, a.rank)), "lora_b": mx.zeros((a.rank, o))}
                        for k, (i, o) in shapes.items()} for _ in range(a.layers)]


def timed(fn, n: int) -> tuple[float, float]:
    call = ev = 0.0
    for i in range(n + 3):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        if i >= 3:
            call, ev = call + t1 - t0, ev + t2 - t1
    return call / n * 1e3, ev / n * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks update", description=__doc__)
    for k, v in (("layers", 16), ("hidden", 2048), ("kv", 512), ("rank", 16), ("n", 30)):
        p.add_argument(f"--{k}", type=int, default=v)
    a = p.parse_args(argv)
    rows = {}
    for clip in (1.0, 0.0):
        model = Lora(a)
        opt = optim.AdamW(learning_rate=1e-5)
        opt.init(model.trainable_parameters())
        grads = {k: mx.random.normal(v.shape) * 1e-3
                 for k, v in tree_flatten(model.trainable_parameters())}
        mx.eval(grads)
        state = [model.state, opt.state]

        def step(tree, clip=clip, opt=opt, model=model):
            if clip:
                tree, norm = optim.clip_grad_norm(tree, clip)
            else:
                norm = mx.array(0.0)
            opt.update(model, tree)
            return norm

        compiled = mx.compile(step, inputs=state, outputs=state)
        rows[f"compiled_clip{clip:g}"] = timed(
            lambda c=compiled, s=state, g=grads: (c(grads_to_tree(g)), s), a.n)
        rows[f"eager_clip{clip:g}"] = timed(lambda s=step, st=state, g=grads:
                                           (s(grads_to_tree(g)), st), a.n)
    # one flat AdamW over all arrays (m, v flat): concatenate in, slice views out
    model = Lora(a)
    flat = tree_flatten(model.trainable_parameters())
    sizes = [v.size for _, v in flat]
    total = sum(sizes)
    m, v = mx.zeros((total,)), mx.zeros((total,))
    grads = [mx.random.normal(x.shape) * 1e-3 for _, x in flat]
    mx.eval(m, v, grads)

    @mx.compile
    def flat_step(ps, gs, m, v):
        p = mx.concatenate([x.reshape(-1) for x in ps])
        g = mx.concatenate([x.reshape(-1) for x in gs])
        g = g * mx.minimum(1.0 / (mx.sqrt(mx.sum(g * g)) + 1e-6), 1.0)
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        p = p * (1 - 1e-7) - 1e-5 * m / (mx.sqrt(v) + 1e-8)
        return p, m, v

    params = [x for _, x in flat]

    def run_flat():
        nonlocal m, v, params
        p, m, v = flat_step(params, grads, m, v)
        offs, out = 0, []
        for x, n in zip(params, sizes, strict=True):
            out.append(p[offs:offs + n].reshape(x.shape))
            offs += n
        params = out
        return params, m, v

    rows["flat_concat"] = timed(run_flat, a.n)
    print(json.dumps({"device": str(mx.default_device()), "arrays": len(sizes),
                      "params": total,
                      "rows": {k: {"call_ms": c, "eval_ms": e} for k, (c, e) in rows.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
