"""Several trials trained as one pack (engine/model/packed_lora.py): one model, one pass
over their shared batches, and each trial's folder as its lone run leaves it (records,
validation, checkpoints at its steps, adapter and its config, summary), its books kept
through its adapter's view. A trial's summary says what the pack spent: its seconds are
the pack's, its peak memory the pack's process's, its load check the pack's model's.

    results = train_pack([cfg_a, cfg_b, cfg_c])     # per config: TrainResult or NonFiniteLoss

What the trials must share (DPO and KTO trials: their one reference, made before the
model loads) is engine/train/pack_steps.py's ``check_pack``; a pack starts fresh (no
resume, warm start or ``--verify``), on one process. A trial whose loss turns
non-finite leaves the pack, failed as its lone run would fail; the others go on as a pack
without it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

import mlx.core as mx

from engine.backward.distributed import SINGLE
from engine.backward.update import make_adapter_update, make_optimizer
from engine.data.unpaired import refuse_unpaired
from engine.losses import validation_metrics
from engine.model.adapters import prepare_out
from engine.model.packed_lora import alone
from engine.settings.config import TrainConfig
from engine.train.pack_steps import PackStepper, check_pack
from engine.train.prepared import prepare_pack
from engine.train.reference import ensure_reference
from engine.train.report_window import Window
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
    say_unread_settings,
    train_batches,
    training_data,
)
from engine.train.steps import NonFiniteLoss, Stepper


def train_pack(cfgs: Sequence[TrainConfig],
               callbacks: Sequence[Sequence[Callback]] | None = None
               ) -> list[TrainResult | NonFiniteLoss]:
    """Train ``cfgs`` as one pack; ``callbacks``: each trial's own (its records only). Each
    trial's TrainResult, or the NonFiniteLoss that took it out of the pack (its folder then
    holds its records so far and no adapter, as a lone run's does)."""
    cfgs = list(cfgs)
    refuse_unpacked(cfgs)
    heard = list(callbacks) if callbacks is not None else [()] * len(cfgs)
    with memory_limit(cfgs[0].memory_limit_gb), ExitStack() as held:
        live = list(range(len(cfgs)))  # the trials still in the pack (PackStepper.drop)
        runs = set_up_pack(cfgs, held, live)
        model = runs[0].prepared.model
        stepper = PackStepper(model, runs[0].prepared.stack, cfgs,
                              [run.stepper.update for run in runs], live)
        trials_books = [RunBooks(run, cb, view=functools.partial(view_of, stepper, i),
                                 window=Window(shared=True))
                        for i, (run, cb) in enumerate(zip(runs, heard, strict=True))]
        for books in trials_books:
            books.begin()
        results: dict[int, TrainResult | NonFiniteLoss] = {}
        mx.reset_peak_memory()
        for done in stepper.steps(train_batches(runs[0]), 1, cfgs[0].steps):
            peak = mx.get_peak_memory()  # the pack's step, read once for all its trials
            mx.reset_peak_memory()
            for trial, own in done.items():
                if isinstance(own, NonFiniteLoss):
                    results[trial] = own
                else:
                    trials_books[trial].window.saw(peak)
                    trials_books[trial].record(own)
        for trial in stepper.live:
            with view_of(stepper, trial):
                results[trial] = finish(runs[trial])
        return [results[trial] for trial in range(len(cfgs))]


def view_of(stepper: PackStepper, trial: int) -> AbstractContextManager:
    """The model as ``trial``'s adapter alone makes it, wherever it sits in the pack now."""
    return alone(stepper.model, stepper.position(trial))


def refuse_unpacked(cfgs: list[TrainConfig]) -> None:
    """ValueError naming what keeps ``cfgs`` from one pack: a setting they do not share, a
    loss a pack does not train yet, or a start a pack does not make."""
    if not cfgs:
        raise ValueError("a pack of no trials")
    check_pack(cfgs)
    for cfg in cfgs:
        cfg.validate()
        for name in ("resume", "warm_start"):
            if getattr(cfg, name):
                raise ValueError(f"{cfg.out}: {name}={getattr(cfg, name)!r}: a pack starts "
                                 "fresh; train this trial alone")
        if cfg.verify:
            raise ValueError(f"{cfg.out}: verify: check the path on a lone run")
        refuse_unpaired(Path(cfg.data), "a pack trains pairs: train this trial alone")
        reported = validation_metrics(cfg.loss_spec())
        if cfg.best_metric not in reported:
            raise ValueError(f"{cfg.out}: best_metric={cfg.best_metric!r}: loss "
                             f"{cfg.loss.kind} reports {reported}")
    outs = [str(Path(c.out).resolve()) for c in cfgs]
    if len(set(outs)) != len(outs):
        raise ValueError(f"a pack's trials write to one folder each; got {outs}")


def set_up_pack(cfgs: list[TrainConfig], held: ExitStack, live: list[int]) -> list[Run]:
    """Each trial's folder claimed, the pack's model set up once (prepared.py), the data
    read once; one Run per trial, each with its own optimizer and the update of its
    adapter, wherever ``live`` (the trials still in the pack) puts it."""
    started = time.perf_counter()
    for cfg in cfgs:
        claim_out(cfg, held)
    pad_multiple = checked_pad_multiple(cfgs[0])  # one layout: check_pack found it shared
    # the data as its trials that read a reference read it: their one reference attached
    # (KTO's first: its KL partners too, which DPO's loss never reads)
    readers = sorted(cfgs, key=lambda c: (not c.loss.needs_kl, not c.loss.needs_reference))
    reader = readers[0]
    if reader.loss_spec().needs_reference:  # made before the pack's model loads
        ensure_reference(*reference_of(reader))
    prepared = prepare_pack(cfgs)
    for cfg in cfgs:
        say_unread_settings(cfg)
    data = training_data(reader, prepared[0], SINGLE)
    runs = []
    for i, (cfg, own) in enumerate(zip(cfgs, prepared, strict=True)):
        prepare_out(Path(cfg.out), None)
        optimizer = make_optimizer(cfg)
        update = make_adapter_update(own.model, functools.partial(live.index, i), optimizer,
                                     cfg.grad_clip)
        stepper = Stepper(own.model, own.stack, cfg.loss_spec(), cfg, SINGLE, update)
        runs.append(Run(cfg, SINGLE, own, data, optimizer, stepper, pad_multiple, 0,
                        fresh_result(cfg, 0, own, data.rejected, started), started))
    return runs
