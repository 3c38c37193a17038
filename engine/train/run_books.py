"""A run's books between its steps: the metrics window and its records, validation (the
"before" numbers first, every ``val_every`` and at the end, the best kept) and
checkpoints; ``metrics.jsonl`` and the callbacks hear each record as it is written.

A lone run reads its model as it is; a pack's adapter reads it through its view
(engine/model/packed_lora.py ``alone``), so each adapter keeps the books a lone run keeps.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from engine.forward.scoring import evaluate
from engine.model.adapters import prune_checkpoints, save_checkpoint
from engine.settings.metric_order import beats
from engine.train.report_window import Window
from engine.train.resume import run_settings
from engine.train.steps import StepDone

log = logging.getLogger(__name__)


class Callback(Protocol):
    """Receives each metrics record (``split`` = "train" or "valid") as it is written."""

    def on_metrics(self, record: dict[str, Any]) -> None: ...


def emit(record: dict[str, Any], out: Path, callbacks: Sequence[Callback]) -> None:
    """``record`` appended to ``out/metrics.jsonl``, then handed to each callback."""
    path = out / "metrics.jsonl"
    try:
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as err:  # a full disk: the error names the file, as the others do
        raise OSError(err.errno, f"cannot write {path}: {err.strerror or err}") from None
    for cb in callbacks:
        cb.on_metrics(record)


def better(rec: dict[str, Any], best: dict[str, Any], metric: str, mode: str) -> bool:
    """Whether validation record ``rec`` beats ``best`` on ``metric`` (``mode`` min or max);
    a NaN never does, and a metric the records lack is an error naming what they have."""
    if metric not in rec:
        have = sorted(k for k in rec if k.startswith("val/"))
        raise ValueError(f"best_metric={metric!r}: not among this run's validation metrics "
                         f"{have}")
    return not best or beats(rec[metric], best[metric], mode)


def lora_blocks(run: Any) -> int:
    """How many of the last blocks carry LoRA (``lora_layers``; -1: all of them)."""
    return len(run.prepared.stack.layers) if run.cfg.lora_layers < 0 else run.cfg.lora_layers


def validate(run: Any, step: int, callbacks: Sequence[Callback]) -> dict[str, Any]:
    """The valid split scored at ``step``: its record, written by the main rank."""
    cfg, valid = run.cfg, run.data.valid
    if cfg.val_batches > 0:  # the first val_batches × batch_size pairs
        valid = valid[: cfg.val_batches * cfg.batch_size]
    metrics = evaluate(run.prepared.model, run.prepared.stack, valid, run.stepper.loss,
                       cfg.batch_size, cfg.head_chunk, layout=run.batch_of)
    rec = {"step": step, "split": "valid", **{f"val/{k}": v for k, v in metrics.items()},
           "val/rows_skipped": sum(run.data.rejected.values())}
    if run.ranks.main:
        emit(rec, run.out, callbacks)
    return rec


@dataclass
class RunBooks:
    """The books of ``run`` (engine/train/run_parts.py's Run): where its records go and the
    view its validation and checkpoints read the model through."""

    run: Any
    callbacks: Sequence[Callback]
    view: Callable[[], AbstractContextManager] = nullcontext
    window: Window = field(default_factory=Window)
    settings: dict[str, Any] = field(default_factory=dict)  # what its checkpoints record
    # a record's metrics beyond the step's (online pairs' rewards): their window's, read once
    extra: Callable[[], dict[str, float]] | None = None

    def begin(self) -> None:
        """Before the first step: the model in training mode, and the "before" numbers
        every later evaluation is read against (or, with no valid split, that said)."""
        run, cfg = self.run, self.run.cfg
        run.prepared.model.train()
        if not run.data.valid:  # said once every refusal is past: the run goes ahead
            log.warning("%s: the valid split is empty: no validation metrics, and no best "
                        "evaluation to rank this run by", cfg.data)
        elif cfg.val_every and run.start == 0:
            with self.view():
                validate(run, 0, self.callbacks)
        # read once, as the run starts: a checkpoint records the inputs it trained on
        self.settings = run_settings(cfg) if cfg.checkpoint_every else {}
        self.window.reset()  # the first window's peak: its steps', not the validation's

    def record(self, done: StepDone) -> None:
        """After step ``done``: its window, and a record, validation or checkpoint where
        this step is due one."""
        run, cfg, result, step = self.run, self.run.cfg, self.run.result, done.step
        lr = float(run.optimizer.learning_rate)  # the rate this update used
        self.window.add(done.loss, done.sums, done.grad_norm, done.tokens, done.seconds)
        result.steps, run.trained = step, run.trained + done.pairs
        run.tokens, run.seconds = run.tokens + done.tokens, run.seconds + done.seconds
        result.phases.setdefault("first_step", done.seconds)  # MLX's first compile in it
        if step % cfg.report_every == 0 or step == cfg.steps:
            result.final = {**self.window.record(step, lr), **(self.extra() if self.extra else {})}
            result.peak_memory_gb = max(result.peak_memory_gb, result.final["peak_memory_gb"])
            if run.ranks.main:
                emit(result.final, run.out, self.callbacks)
            self.window.reset()
        if run.data.valid and ((cfg.val_every and step % cfg.val_every == 0)
                               or step == cfg.steps):
            with self.view():
                rec = validate(run, step, self.callbacks)
            if better(rec, result.best_val, cfg.best_metric, cfg.best_mode):
                result.best_val = rec
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and run.ranks.main:
            with self.view():
                save_checkpoint(run.prepared.model, run.optimizer, run.out, step,
                                {"seed": cfg.seed, "settings": self.settings},
                                run.prepared.lora, lora_blocks(run))
            prune_checkpoints(run.out, cfg.keep_checkpoints)
