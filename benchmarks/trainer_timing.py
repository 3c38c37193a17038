"""The trainer as the benchmarks run it: the benchmark's TrainConfig (LoRA r16 on q/k/v/o,
as TRL's side), a config trained with its steady steps and host phases timed, and the
engine's own step on that config's model and first batch."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def bench_config(a: argparse.Namespace, model: Path, data: Path, work: Path):
    """The benchmark's TrainConfig: LoRA r16 on q/k/v/o, as TRL's side."""
    from engine.settings.config import TrainConfig

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
    from engine.train import steps, trainer

    phases: dict[str, list[float]] = {"batches": [], "step_grads": [], "update": []}

    def timed(name: str, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            phases[name].append(time.perf_counter() - t0)
            return out
        return run

    saved = steps.dispatch_grads, trainer.make_update, steps.Prefetch.next
    steps.dispatch_grads = timed("step_grads", saved[0])
    trainer.make_update = lambda *args, **kw: timed("update", saved[1](*args, **kw))
    steps.Prefetch.next = timed("batches", saved[2])
    try:
        yield phases
    finally:
        steps.dispatch_grads, trainer.make_update, steps.Prefetch.next = saved


def phase_medians(phases: dict[str, list[float]], steps: list[float], warmup: int
                  ) -> dict[str, float]:
    """Median milliseconds of each phase over the timed steps, and of the ``wait``: the
    step's time beyond its phases (one call of each a step)."""
    timed = {k: v[warmup:] for k, v in phases.items()}
    wait = [s - sum(v[i] for v in timed.values()) for i, s in enumerate(steps)]
    return {k: statistics.median(v) * 1e3 for k, v in {**timed, "wait": wait}.items()}


def timed_train(cfg: Any, warmup: int, fed: int) -> dict[str, Any]:
    """Train ``cfg``, reporting every step: the steady steps after ``warmup`` (seconds
    each, their median), their peak GB and prefix-share rate, and the host phases.
    ``fed``: tokens a step as the trainer counts them (every token of a sequence), so
    its tokens/s gives the step's wall time."""
    from engine.train.trainer import train

    records: list[dict[str, Any]] = []

    class Collect:
        def on_metrics(self, record: dict[str, Any]) -> None:
            if record["split"] == "train":
                records.append(record)

    with timed_phases() as phases:
        train(cfg, [Collect()])
    timed = records[warmup:]
    steps = [fed / r["tokens_per_sec"] for r in timed]
    return {"step_s": statistics.median(steps), "steps_s": steps,
            "peak_gb": max(r["peak_memory_gb"] for r in timed),
            "prefix_share_rate": statistics.mean(r["prefix_share_rate"] for r in timed),
            "phases_ms": phase_medians(phases, steps, warmup)}


@dataclass
class EngineStep:
    """The engine's step (forward + backward, no update) as ``cfg`` trains it, on its
    model and first batch: ``run()`` returns the loss, metrics and grads unevaluated."""

    model: Any
    stack: Any
    pairs: Any  # the batch in the two-forward layout (its masks, targets)
    shared: bool  # whether the batch took the prefix-shared layout
    loss: Callable[[Any], Any]
    run: Callable[[], Any]


def engine_step_of(cfg: Any) -> EngineStep:
    """``cfg``'s model loaded with its LoRA, checked, MLPs chunked as it says; its batch."""
    import mlx.core as mx

    from engine.backward.segmented import value_and_grad
    from engine.data.batch import batch_norms
    from engine.data.pairs import load_pairs
    from engine.forward.layout_policy import choose_layout, resolve_pad_multiple
    from engine.forward.prefix import pair_batch
    from engine.losses import pair_loss
    from engine.train.prepared import prepare_training

    prepared = prepare_training(cfg)  # as the trainer sets it up
    model, stack = prepared.model, prepared.stack
    batch = choose_layout(load_pairs(cfg.data).train[: cfg.batch_size], cfg,
                          resolve_pad_multiple(cfg.pad_multiple), prepared.pad_id)
    pb = pair_batch(batch)
    norms, spec = batch_norms([pb]), cfg.loss_spec()
    resp, nll = mx.array(pb.resp_mask), mx.array(pb.nll_mask)

    def loss(lp: mx.array) -> Any:
        return pair_loss(lp, resp, nll, spec, norms)

    def run() -> Any:
        return value_and_grad(model, stack, batch, loss, cfg.segment_size, cfg.head_chunk,
                              cfg.inflight)

    return EngineStep(model, stack, pb, batch is not pb, loss, run)
