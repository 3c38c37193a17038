"""Where one trainer step's device time goes, phase by phase (``bench train --profile``).

The trainer's configuration on its own first batch: the engine's step with every stage
evaluated alone (``engine.host.inflight.observe_phases`` makes them synchronous), each stage's
seconds summed by kind — the embedding, the forward and the backward by layer type (Gemma
4: sliding / full, with or without its own K/V), the head — and then one optimizer update
(the trainer's compiled clip + AdamW), evaluated alone. Plain autograd has no stages: its
profile is the forward alone (the loss evaluated) and the whole step.

Stages run one at a time here, so their sum exceeds a pipelined step's time by the host
time the queue hides; the split, not the sum, is what this is for. ``host_ms`` splits the
same stages' time into Python building graphs, MLX queueing kernels and the device's
work: where the first two reach the third, a pipelined step waits on its host.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx


def layer_kind(stack: Any, i: int) -> str:
    """A layer's type for the profile: its attention (full / sliding) and, where some
    layers read another's K/V (Gemma 4), whether it does."""
    kind = "sliding" if stack.window(i) is not None else "full"
    if stack.donor_of:
        kind += " kv-shared" if i in stack.donor_of else " own-kv"
    return kind


def stage_kind(stack: Any, phase: str) -> str:
    """``forward 3-4`` → ``forward full own-kv`` (a segment of several kinds joins them)."""
    verb, _, span = phase.partition(" ")
    if verb not in ("forward", "backward") or "-" not in span:
        return phase
    start, end = map(int, span.split("-"))
    kinds = sorted({layer_kind(stack, i) for i in range(start, end)})
    return f"{verb} {' + '.join(kinds)}"


def timed_stages(stack: Any, step: Callable[[], Any], peaks: dict[str, float],
                 host: dict[str, float]) -> dict[str, float]:
    """Seconds per stage kind of one ``step()`` run with its stages synchronous. Each
    kind's peak memory (GB, MLX's, weights included) is raised into ``peaks``; ``host``
    sums the seconds of the three parts of every stage: Python building its graph
    (``build``), MLX queueing its kernels (``dispatch``), the device running them
    (``wait``). A pipelined step is host-bound where build + dispatch reach the wait."""
    from engine.host.inflight import clock, observe_phases

    marks: list[tuple[str, float, float, float, float]] = []

    def mark(phase: str) -> None:
        marks.append((phase, time.perf_counter(), mx.get_peak_memory() / 1e9,
                      clock["dispatch"], clock["wait"]))
        mx.reset_peak_memory()

    mx.reset_peak_memory()
    t0, d0, w0 = time.perf_counter(), clock["dispatch"], clock["wait"]
    with observe_phases(mark):
        mx.eval(step())
    out: dict[str, float] = {}
    last = (t0, d0, w0)
    for phase, t, peak, d, w in marks:
        kind = stage_kind(stack, phase)
        out[kind] = out.get(kind, 0.0) + t - last[0]
        peaks[kind] = max(peaks.get(kind, 0.0), peak)
        dispatch, wait = d - last[1], w - last[2]
        for part, seconds in (("build", t - last[0] - dispatch - wait), ("dispatch", dispatch),
                              ("wait", wait)):
            host[part] = host.get(part, 0.0) + seconds
        last = (t, d, w)
    out["rest"] = time.perf_counter() - last[0]  # the last stage's wait, loss and grads read
    return out


def profile(cfg: Any, repeats: int = 3) -> dict[str, Any]:
    """Median milliseconds per stage kind of ``cfg``'s engine step on its first batch, and
    of one update (``ms``), and each stage kind's peak GB (``peak_gb``); plain autograd:
    its forward alone and its step."""
    from benchmarks.trainer_timing import engine_step_of
    from engine.backward.update import make_optimizer, make_update
    from engine.train.run_parts import memory_limit

    with memory_limit(cfg.memory_limit_gb):
        es = engine_step_of(cfg)
        model, stack, loss, pb, step = es.model, es.stack, es.loss, es.pairs, es.run
        update = make_update(model, make_optimizer(cfg), cfg.grad_clip)
        runs, peaks, hosts = [], {}, []
        for _ in range(repeats + 1):  # the first compiles
            if cfg.segment_size or cfg.head_chunk:
                hosts.append({})
                stages = timed_stages(stack, step, peaks, hosts[-1])
            else:
                stages = {"forward": _seconds(lambda: loss(_plain_logps(model, pb))),
                          "step": _seconds(step)}
            grads = step()[2]
            mx.eval(grads)
            stages["update"] = _seconds(lambda g=grads: update(g))
            runs.append(stages)
        mx.eval(model.trainable_parameters())
    def median_ms(rows: list[dict[str, float]]) -> dict[str, float]:
        return {k: statistics.median(r.get(k, 0.0) for r in rows[1:]) * 1e3 for k in rows[-1]}

    return {"ms": median_ms(runs), "peak_gb": peaks,
            "host_ms": median_ms(hosts) if hosts else {}}


def _plain_logps(model: Any, pb: Any) -> mx.array:
    from engine.model.head import token_logps

    return token_logps(model(mx.array(pb.inputs)), mx.array(pb.targets))


def _seconds(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - t0
