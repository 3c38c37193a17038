"""The lone run: one LoRA adapter trained on one dataset with one loss.

    python -m engine train --model DIR --data DIR --out DIR [--loss orpo|simpo|sft|dpo]

``train(cfg)`` reads top to bottom, in the shape of mlx-lm's tuner:

    run = set_up(cfg, held)       # claim the output folder, DPO's reference, the model set
                                  # up (engine/train/prepared.py), the data, a resume
    loop(run, loss, batches, cb)  # the steps (engine/train/steps.py: the one step the probe
                                  # and the benchmarks run too), reports, validation, checkpoints
    finish(run)                   # the adapter and summary.json

The parts it is made of are every recipe's (engine/train/run_parts.py). Progress leaves
through callbacks (``on_metrics``) and ``metrics.jsonl``; nothing here prints UI.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from engine.backward.distributed import init_ranks
from engine.backward.update import make_optimizer, make_update
from engine.check.load_check import verify_paths
from engine.data.unpaired import loss_for_data
from engine.losses.sampled import samples_now
from engine.losses.spec import LossSpec
from engine.model.adapters import load_adapter_weights, prepare_out
from engine.settings.config import TrainConfig
from engine.settings.reference_kind import BASE
from engine.train.prepared import prepare_training
from engine.train.reference import ensure_reference
from engine.train.run_books import Callback, RunBooks
from engine.train.run_parts import (
    Run,
    TrainResult,
    checked_pad_multiple,
    claim_out,
    finish,
    fresh_result,
    memory_limit,
    reference_of,
    resumed_step,
    say_unread_settings,
    train_batches,
    training_data,
)
from engine.train.steps import Stepper

log = logging.getLogger(__name__)


def train(cfg: TrainConfig, callbacks: Sequence[Callback] = ()) -> TrainResult:
    """Train one adapter as ``cfg`` says; write it to ``cfg.out``; return a summary."""
    cfg.validate()
    if samples_now(cfg.loss):  # sampled groups or pairs: their own set-up
        raise ValueError(f"loss {cfg.loss.kind} samples its completions: "
                         "engine.train.dispatch.train_any runs it")
    with memory_limit(cfg.memory_limit_gb), ExitStack() as held:
        run = set_up(cfg, held)
        loop(run, run.stepper.loss, train_batches(run), callbacks)
        return finish(run)


def set_up(cfg: TrainConfig, held: ExitStack) -> Run:
    """Everything before the first step, each refusal before any work: the ranks, the
    output folder claimed, DPO's reference (made before the policy loads: one model at a
    time), the model set up as every path sets it up, the data, a checkpoint to resume."""
    started = time.perf_counter()
    ranks = init_ranks()
    if cfg.batch_size % ranks.size:
        raise ValueError(f"batch_size={cfg.batch_size} does not split over {ranks.size} "
                         "ranks: make it a multiple of the number of ranks")
    loss = loss_for_data(cfg.loss_spec(), cfg.data, ranks.size)  # unpaired rows: KTO's
    claim_out(cfg, held, writer=ranks.main)  # the one writer holds it until training ends
    if cfg.loss_spec().needs_reference:
        if cfg.warm_start and cfg.reference == BASE:
            log.warning("warm_start %s with reference base: the policy starts away from its "
                        "reference (SFT, then DPO: give --reference %s)", cfg.warm_start,
                        cfg.warm_start)
        ensure_reference(*reference_of(cfg, ranks.size))
    prepared = prepare_training(cfg)
    say_unread_settings(cfg)
    if cfg.warm_start:
        load_adapter_weights(prepared.model, Path(cfg.warm_start))
    data = training_data(cfg, prepared, ranks)
    pad_multiple = checked_pad_multiple(cfg)
    optimizer = make_optimizer(cfg)
    resumed = resumed_step(cfg, prepared.model, optimizer)
    if ranks.main:
        prepare_out(Path(cfg.out), resumed)
    start = resumed or 0
    stepper = Stepper(prepared.model, prepared.stack, loss, cfg, ranks,
                      make_update(prepared.model, optimizer, cfg.grad_clip))
    result = fresh_result(cfg, start, prepared, data.rejected, started)
    run = Run(cfg, ranks, prepared, data, optimizer, stepper, pad_multiple, start, result,
              started)
    if cfg.verify:
        result.verified = verify_paths(prepared.model, prepared.stack,
                                       run.batch_of(data.train[: cfg.batch_size]),
                                       stepper.loss, cfg)
    return run


def loop(run: Run, loss: LossSpec, batches: Callable[[], list],
         callbacks: Sequence[Callback], online: Any = None) -> None:
    """The steps after ``run.start`` on ``batches`` under ``loss``, each one's records,
    validation and checkpoint kept by the run's books (engine/train/run_books.py); ``online``
    (engine/train/online_pairs.py): ``batches`` sample the policy, made after each update,
    and its metrics join each record."""
    books = RunBooks(run, callbacks, extra=online.report if online else None)
    books.begin()
    stepper = dataclasses.replace(run.stepper, loss=loss)
    for done in stepper.steps(batches, run.start + 1, run.cfg.steps, ahead=online is None):
        books.record(done)

