"""The trainer as the benchmarks run it: the benchmark's TrainConfig (LoRA r16 on q/k/v/o,
as TRL's side) and the trainer's step phases timed on the host."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def bench_config(a: argparse.Namespace, model: Path, data: Path, work: Path):
    """The benchmark's TrainConfig: LoRA r16 on q/k/v/o, as TRL's side."""
    from engine.config import TrainConfig

    return TrainConfig(model=str(model), data=str(data), out=str(work / "run"),
                       steps=a.warmup + a.steps, batch_size=a.pairs, report_every=1,
                       val_every=0, learning_rate=1e-5, lora_rank=16, lora_scale=2.0,
                       lora_keys=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                  "self_attn.o_proj"), segment_size=a.segment_size,
                       head_chunk=a.head_chunk, prefix_share=a.prefix_share, warmup_steps=0)


@contextmanager
def timed_phases() -> Iterator[dict[str, list[float]]]:
    """Inside: the trainer's step phases timed on the host, each call's seconds appended
    per name: waiting for the prefetched batches, dispatching the forward + backward
    (``step_grads``: it returns with the last stage still queued) and the clip + AdamW
    update. What a step spends beyond them is the wait for the device (``wait``)."""
    from engine import trainer

    phases: dict[str, list[float]] = {"batches": [], "step_grads": [], "update": []}

    def timed(name: str, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            phases[name].append(time.perf_counter() - t0)
            return out
        return run

    saved = trainer.dispatch_grads, trainer.make_update, trainer.Prefetch.next
    trainer.dispatch_grads = timed("step_grads", saved[0])
    trainer.make_update = lambda *args, **kw: timed("update", saved[1](*args, **kw))
    trainer.Prefetch.next = timed("batches", saved[2])
    try:
        yield phases
    finally:
        trainer.dispatch_grads, trainer.make_update, trainer.Prefetch.next = saved


def phase_medians(phases: dict[str, list[float]], steps: list[float], warmup: int
                  ) -> dict[str, float]:
    """Median milliseconds of each phase over the timed steps, and of the ``wait``: the
    step's time beyond its phases (one call of each a step)."""
    timed = {k: v[warmup:] for k, v in phases.items()}
    wait = [s - sum(v[i] for v in timed.values()) for i, s in enumerate(steps)]
    return {k: statistics.median(v) * 1e3 for k, v in {**timed, "wait": wait}.items()}
