"""The parts every training recipe is built from: the lone run (engine/train/trainer.py),
a pack (engine/train/pack_trainer.py), GRPO (engine/train/grpo_trainer.py) and online
pairs (engine/train/online_pairs.py) each call these in their own order, and none of them
imports another recipe's set-up.

What is here: a run's result (``TrainResult``) and state (``Run``), the output folder
claimed, MLX's memory limit, DPO's reference as the cache takes it, the run's data
checked, a checkpoint resumed, the training order, and the run's end (``finish``: the
adapter and summary.json).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.backward.compiled import compiled_counts
from engine.backward.distributed import Ranks
from engine.backward.step import Idle
from engine.data.batch import PairBatch
from engine.data.data_fit import load_pairs_for
from engine.data.pairs import PairSet, check_train_split, micro_batches, pair_length
from engine.data.unpaired import loss_for_data
from engine.forward.layout_policy import (
    choose_layout,
    resolve_pad_multiple,
    resolve_prefix_attention,
)
from engine.forward.prefix import PrefixBatch
from engine.host.command_queue import queue_note
from engine.host.outputs import claim
from engine.losses import validation_metrics
from engine.model.adapters import is_run_dir, load_checkpoint, run_write_text, save_adapters
from engine.model.content_key import adapter_fingerprint, model_fingerprint, reference_key
from engine.settings.config import TrainConfig
from engine.settings.forward_options import ForwardOptions
from engine.settings.reference_kind import BASE, adapter_path
from engine.train.prepared import Prepared
from engine.train.reference import ReferenceSpec, attach_reference, resolved_reference
from engine.train.resume import check_resume, read_state, resume_checkpoint
from engine.train.run_books import lora_blocks
from engine.train.steps import Stepper

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a run leaves behind (small: crosses Ray and Prefect as is)."""

    out: str
    steps: int
    final: dict[str, float] = field(default_factory=dict)
    best_val: dict[str, float] = field(default_factory=dict)
    trainable_params: int = 0
    rejected_rows: dict[str, int] = field(default_factory=dict)
    peak_memory_gb: float = 0.0
    tokens_per_sec: float = 0.0
    seconds: float = 0.0
    # processes the run's batches were split over (engine/backward/distributed.py)
    world_size: int = 1
    rank_pairs: list[int] = field(default_factory=list)  # pairs each rank trained
    load_check: dict[str, Any] = field(default_factory=dict)  # engine/check/load_check.py figures
    verified: dict[str, Any] = field(default_factory=dict)  # --verify's figures (verify_paths)
    # compiled segments (engine/backward/compiled.py): traces, replays and calls
    compiled: dict[str, int] = field(default_factory=dict)
    # where the run's seconds went (``PHASES``): what a sweep's trial costs beyond its steps
    phases: dict[str, float] = field(default_factory=dict)


# set_up: claim to first step (model load, load check, data, reference, resume); load_check:
# its part of set_up; first_step: the first step's own (MLX's first compile); steps: every
# step's (GRPO's: its updates); finish: the adapter written. The rest: validation,
# checkpoints, GRPO's rollouts.
PHASES = ("set_up", "load_check", "first_step", "steps", "finish")


def refuse_beyond_context(pairs: Sequence, context: int | None) -> None:
    """Raise ValueError naming the pairs longer than the model's context: one such row
    (822k tokens, say) would otherwise exhaust memory mid-run, or train past the positions
    the model knows."""
    if not context:
        return
    long = [p for p in pairs if pair_length(p) > context]
    if long:
        first, size = long[0], pair_length(long[0])
        raise ValueError(f"{len(long)} pair(s) longer than the model's context of {context} "
                         f"tokens (first: id {first.id!r}, {size} tokens); re-tokenize with "
                         "--max-length (pomona data tokenize), or drop them")


@contextmanager
def memory_limit(gib: float) -> Iterator[None]:
    """Inside: MLX's memory limit at ``gib`` GiB (0: unchanged); the old one after. The
    log says whether MLX's queue is capped to match (engine/host/command_queue.py)."""
    if gib <= 0:
        yield
        return
    log.log(*queue_note(gib))
    before = mx.set_memory_limit(int(gib * 2**30))
    try:
        yield
    finally:
        mx.set_memory_limit(before)


def reference_of(cfg: TrainConfig, ranks: int = 1
                 ) -> tuple[ReferenceSpec, str | None, ForwardOptions]:
    """DPO's reference as ``ensure_reference`` takes it: whose log-probs, the file to
    read (None: Pomona's cache, computed once when missing) and the forward's options (a
    rank's share of the batch: one device runs the pass)."""
    return (ReferenceSpec(cfg.model, cfg.data, resolved_reference(cfg.reference),
                          loss_for_data(cfg.loss_spec(), cfg.data).needs_kl),
            cfg.reference_logps, cfg.forward(ranks))


def loss_weights(cfg: TrainConfig) -> dict[str, Any]:
    """The loss's own settings, for the adapter's pomona block (adapters.trained_loss;
    DPO's reference too, which evaluation re-reads)."""
    weights = {**cfg.loss.fields(), "nll_span": cfg.nll_span}
    if cfg.loss.needs_reference:  # absolute: score and evaluation run from anywhere
        weights["reference"] = str(resolved_reference(cfg.reference))
    return weights


def say_unread_settings(cfg: TrainConfig) -> None:
    """Settings this run will not use, said: a reference file a loss without a reference
    would not read (a sweep's fixed file beside ORPO trials), a warmup past the steps."""
    if cfg.reference_logps and not cfg.loss_spec().needs_reference:
        log.warning("reference_logps %s is not read: loss %s takes no reference (only "
                    "DPO does)", cfg.reference_logps, cfg.loss.kind)
    if cfg.warmup_steps > cfg.steps:
        log.warning("warmup_steps=%d is longer than steps=%d: the learning rate never "
                    "reaches its peak", cfg.warmup_steps, cfg.steps)


def content_keys(cfg: TrainConfig) -> dict[str, str]:
    """The base's content key (a reference adapter is refused on another base), a warm
    start's (what the adapter began from) and, for DPO with an adapter reference, that
    adapter's (retrained in place: said at score)."""
    keys = {"model_key": model_fingerprint(cfg.model)}
    if cfg.warm_start:
        keys["warm_start_key"] = adapter_fingerprint(cfg.warm_start)
    if cfg.loss_spec().needs_reference and cfg.reference != BASE:
        keys["reference_key"] = reference_key(cfg.reference)
    return keys


def claim_run(cfg: TrainConfig) -> AbstractContextManager[Path]:
    """``cfg.out`` held as this process's run (engine/host/outputs.py): refused when it holds
    files Pomona did not write, another process is writing it, or it overlaps an input."""
    return claim(cfg.out, ("run",), legacy=is_run_dir, may_hold=False,
                 inputs=[cfg.model, cfg.data, cfg.warm_start, adapter_path(cfg.reference),
                         cfg.reference_logps])


@dataclass
class Run:
    """A run set up (``set_up``): its config, ranks, model set up, data, optimizer and
    step, and the result its loop fills in."""

    cfg: TrainConfig
    ranks: Ranks
    prepared: Prepared
    data: PairSet
    optimizer: Any
    stepper: Stepper
    pad_multiple: int
    start: int  # the step it resumes after (0: a fresh run)
    result: TrainResult
    started: float
    trained: int = 0  # this rank's pairs
    tokens: int = 0  # every rank's, over the timed steps
    seconds: float = 0.0

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    def batch_of(self, pairs: list) -> PairBatch | PrefixBatch:
        """``pairs`` in the layout the config and the batch call for."""
        return choose_layout(pairs, self.cfg, self.pad_multiple, self.prepared.pad_id)

    def shard_of(self, pairs: list) -> PairBatch | PrefixBatch | Idle:
        """This rank's share of a micro-batch; none (the last micro-batch of an epoch,
        fewer pairs than ranks): an idle step on the first pair's shape."""
        mine = self.ranks.shard(pairs)
        return self.batch_of(mine) if mine else Idle(self.batch_of(pairs[:1]))


def training_data(cfg: TrainConfig, prepared: Prepared, ranks: Ranks) -> PairSet:
    """The run's pairs for its model, DPO's reference log-probs attached; refused (naming
    the file, the pair or the metric) without a train split, with a pair past the model's
    context, or with a ``best_metric`` its loss never reports."""
    data = load_pairs_for(cfg.data, cfg.model, prepared.stack, cfg.allow_tokenizer_mismatch)
    if cfg.loss_spec().needs_reference:
        attach_reference(data, *reference_of(cfg, ranks.size))
    check_train_split(data, cfg.data)
    refuse_beyond_context([*data.train, *data.valid, *data.test], prepared.stack.context)
    reported = validation_metrics(cfg.loss_spec())
    if cfg.best_metric not in reported:  # refused before any step
        raise ValueError(f"best_metric={cfg.best_metric!r}: loss {cfg.loss.kind} reports "
                         f"{reported}")
    return data


def resumed_step(cfg: TrainConfig, model: Any, optimizer: Any) -> int | None:
    """The step of the checkpoint this run resumes from, its weights and optimizer state
    loaded (refused before any weight is touched when it does not match); None: none."""
    ckpt = resume_checkpoint(cfg, Path(cfg.out))
    if ckpt is None:
        return None
    check_resume(cfg, ckpt, read_state(ckpt))
    start = int(load_checkpoint(model, optimizer, ckpt)["step"])
    log.info("resumed from %s (step %d)", ckpt, start)
    return start


def train_batches(run: Run) -> Callable[[], list]:
    """The run's training order from where it resumes: each call, one step's
    ``grad_accum`` micro-batches, this rank's share of each."""
    cfg = run.cfg
    pairs = micro_batches(run.data.train, cfg.batch_size, cfg.seed, run.start * cfg.grad_accum)
    return lambda: [run.shard_of(next(pairs)) for _ in range(cfg.grad_accum)]


def finish(run: Run) -> TrainResult:
    """The result's totals; the main rank writes the adapter (with what trained it:
    loss, its settings, content keys) and summary.json."""
    cfg, result = run.cfg, run.result
    result.world_size = run.ranks.size
    result.rank_pairs = run.ranks.gather_counts(run.trained)
    result.tokens_per_sec = run.tokens / max(run.seconds, 1e-9)
    result.compiled = compiled_counts(run.prepared.stack)
    ending = time.perf_counter()
    if run.ranks.main:
        extra = {"model": cfg.model, "pomona": {"steps": result.steps, "loss": cfg.loss.kind,
                                                **loss_weights(cfg), **content_keys(cfg),
                                                "seed": cfg.seed, "world_size": run.ranks.size}}
        save_adapters(run.prepared.model, run.out, run.prepared.lora, lora_blocks(run), extra)
    now = time.perf_counter()
    result.phases.update(steps=run.seconds, finish=now - ending)
    result.seconds = now - run.started  # to the adapter written
    if run.ranks.main:
        run_write_text(run.out / "summary.json", json.dumps(result.__dict__, indent=2) + "\n")
    return result


def claim_out(cfg: TrainConfig, held: ExitStack, writer: bool = True) -> None:
    """``cfg.out`` claimed for the rest of ``held`` (by its one ``writer``: the main rank)
    and made."""
    if writer:
        held.enter_context(claim_run(cfg))
    Path(cfg.out).mkdir(parents=True, exist_ok=True)


def checked_pad_multiple(cfg: TrainConfig) -> int:
    """The run's pad multiple, and its prefix attention refused where unsafe, before any
    work."""
    pad_multiple = resolve_pad_multiple(cfg.pad_multiple)
    resolve_prefix_attention(cfg.prefix_attention, pad_multiple)
    return pad_multiple


def fresh_result(cfg: TrainConfig, start: int, prepared: Prepared, rejected: dict[str, int],
                 started: float) -> TrainResult:
    """A run's result as its set-up (begun at ``started``, perf_counter) ends: where it
    starts, what it trains, what its data rejected and what its load check measured."""
    phases = {"set_up": time.perf_counter() - started,
              "load_check": float(prepared.check.get("seconds", 0.0))}
    return TrainResult(out=str(Path(cfg.out)), steps=start, trainable_params=prepared.trainable,
                       rejected_rows=dict(rejected), load_check=prepared.check, phases=phases)
