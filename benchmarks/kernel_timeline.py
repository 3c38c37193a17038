"""The device timeline of the trainer's steady steps, then of the engine's own step.

torch's profiler (CUPTI) records every CUDA kernel in the process, MLX's included, so on
the GPU machine (torch installed) this shows where a step's device time goes: per step,
its span, kernel count, summed kernel time, the longest idle gaps (with the host phase
running then: ``dispatch`` = forward + backward, ``update``, ``read``) and the kernels
that take the most time. Issue 15 used it to find the update's host cost. Needs torch.

    python -m benchmarks timeline --seq 4096 --out /tmp/t  # repo root on PYTHONPATH

Steps whose host phases are unlabelled are the engine's (``value_and_grad`` alone, on the
trainer's first batch). Results: docs/results/h200-2026-11-30-update/.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks import train_bench, trainer_timing
from engine.backward import step
from engine.train import steps, trainer


def labelled(name: str, fn):
    from torch.profiler import record_function

    def run(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    return run


def trace_trainer(prof: Any, a: argparse.Namespace, model: Path, data: Path, work: Path
                  ) -> None:
    """Train; the profiler starts after the warm-up steps; each step opens ``step``."""
    make_update = trainer.make_update
    steps.dispatch_grads = labelled("dispatch", steps.dispatch_grads)
    trainer.make_update = lambda *x, **k: labelled("update", make_update(*x, **k))
    step.StepGrads.read = labelled("read", step.StepGrads.read)
    steps.Prefetch.next = labelled("step", steps.Prefetch.next)

    class StartAfterWarmup:
        def on_metrics(self, record: dict) -> None:
            if record["split"] == "train" and record["step"] == a.warmup:
                prof.start()

    trainer.train(trainer_timing.bench_config(a, model, data, work), [StartAfterWarmup()])


def trace_engine(a: argparse.Namespace, model_dir: Path, data: Path, work: Path) -> None:
    from torch.profiler import record_function

    step, _ = train_bench.engine_step(a, work, model_dir, data)
    for i in range(a.warmup + a.steps):
        with record_function("step" if i >= a.warmup else "warmup"):
            pass
        t0 = time.perf_counter()
        step()
        print(f"engine step {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    with record_function("step"):
        pass


def report(trace: Path, gaps: int = 4) -> None:
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    phases = [e for e in events if e.get("cat") == "user_annotation"]
    starts = sorted(e["ts"] for e in phases if e["name"] == "step")[1:]  # the first
    for s0, s1 in itertools.pairwise(starts):  # profiled step pays the profiler's start
        ks = [k for k in kernels if s0 <= k["ts"] < s1]
        if not ks or s1 - s0 > 5e5:  # the gap between the trainer and the engine
            continue
        idle = []
        for p, q in itertools.pairwise(ks):
            end = p["ts"] + p["dur"]
            where = [x["name"] for x in phases if x["ts"] <= end <= x["ts"] + x["dur"]]
            idle.append((q["ts"] - end, end - s0, p["name"][:48], q["name"][:48], where))
        print(f"step: span {(s1 - s0) / 1e3:.2f} ms, {len(ks)} kernels, kernel time "
              f"{sum(k['dur'] for k in ks) / 1e3:.2f} ms, first kernel at "
              f"{(ks[0]['ts'] - s0) / 1e3:.2f} ms")
        for g, at, before, after, where in sorted(idle, reverse=True)[:gaps]:
            print(f"  idle {g / 1e3:.2f} ms at {at / 1e3:.1f} ms ({where}): {before} -> {after}")
        for x in phases:
            if s0 <= x["ts"] < s1 and x["name"] != "step":
                print(f"  host {x['name']}: from {(x['ts'] - s0) / 1e3:.1f} ms, "
                      f"{x['dur'] / 1e3:.2f} ms")
        count, spent = Counter(), Counter()
        for k in ks:
            count[k["name"][:60]] += 1
            spent[k["name"][:60]] += k["dur"]
        print("  most time:", "; ".join(f"{n} ×{count[n]} {t / 1e3:.2f} ms"
                                        for n, t in spent.most_common(4)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks timeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--pairs", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("/tmp/kernel-timeline"))
    args = p.parse_args(argv)
    a = train_bench.parser().parse_args(["--seq", str(args.seq), "--pairs", str(args.pairs),
                                         "--steps", str(args.steps), "--warmup", "3"])
    work = args.out / f"work-{args.seq}x{args.pairs}"
    try:  # the bench's own checks: counts, and a folder that is empty or its own
        train_bench.check_args(a)
        train_bench.claim_work(work, a)
    except ValueError as err:
        p.error(str(err))
    model, data = train_bench._model_and_data(a, work)
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.zeros(1, device="cuda")  # CUPTI attaches to the context MLX shares
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    trace_trainer(prof, a, model, data, work)
    trace_engine(a, model, data, work)
    prof.stop()
    trace = work / "trace.json"  # inside the folder claimed above, never beside a user's file
    prof.export_chrome_trace(str(trace))
    report(trace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
