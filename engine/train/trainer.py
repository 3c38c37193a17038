"""The training loop: one LoRA adapter trained on one dataset with one loss.

    python -m engine train --model DIR --data DIR --out DIR [--loss orpo|simpo|sft|dpo]

``train(cfg)`` reads top to bottom: claim the output folder, DPO's reference, the model
set up as every path sets it up (engine/train/prepared.py: LoRA, load check, levers), the data
and its refusals,
then per step: the prefetched micro-batches (engine/host/prefetch.py), their gradients
(engine/backward/step.py), the compiled update (engine/backward/update.py), the metrics window
(engine/train/report_window.py), validation and checkpoints; the adapter and summary last.
Progress leaves through callbacks (``on_metrics``) and ``metrics.jsonl``; nothing here
prints UI.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx

from engine.backward.distributed import init_ranks
from engine.backward.step import Idle, dispatch_grads
from engine.backward.update import make_optimizer, make_update
from engine.check.load_check import verify_paths
from engine.data.batch import PairBatch
from engine.data.data_fit import load_pairs_for
from engine.data.pairs import check_train_split, micro_batches, pair_length
from engine.forward.layout_policy import (
    choose_layout,
    resolve_pad_multiple,
    resolve_prefix_attention,
)
from engine.forward.prefix import PrefixBatch
from engine.forward.scoring import evaluate
from engine.host.command_queue import queue_note
from engine.host.outputs import claim
from engine.host.prefetch import Prefetch
from engine.losses import validation_metrics
from engine.model.adapters import (
    is_run_dir,
    load_adapter_weights,
    load_checkpoint,
    prepare_out,
    prune_checkpoints,
    run_write_text,
    save_adapters,
    save_checkpoint,
)
from engine.model.content_key import adapter_fingerprint, model_fingerprint
from engine.settings.config import TrainConfig
from engine.settings.ranking import beats
from engine.settings.reference_kind import BASE, adapter_path
from engine.train.prepared import prepare_training
from engine.train.reference import (
    ReferenceSpec,
    attach_reference,
    ensure_reference,
    resolved_reference,
)
from engine.train.report_window import Window
from engine.train.resume import check_resume, read_state, resume_checkpoint, run_settings

log = logging.getLogger(__name__)


class Callback(Protocol):
    """Receives each metrics record (``split`` = "train" or "valid") as it is written."""

    def on_metrics(self, record: dict[str, Any]) -> None: ...


class NonFiniteLoss(RuntimeError):
    """The loss or gradient norm became NaN/inf; names the step and the pairs."""


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


def _emit(record: dict[str, Any], out: Path, callbacks: Sequence[Callback]) -> None:
    log = out / "metrics.jsonl"
    try:
        with log.open("a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as err:  # a full disk: the error names the file, as the others do
        raise OSError(err.errno, f"cannot write {log}: {err.strerror or err}") from None
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
                 ) -> tuple[ReferenceSpec, str | None, dict[str, Any]]:
    """DPO's reference as ``ensure_reference`` takes it: whose log-probs, the file to
    read (None: Pomona's cache, computed once when missing) and the forward's options (a
    rank's share of the batch: one device runs the pass)."""
    return (ReferenceSpec(cfg.model, cfg.data, resolved_reference(cfg.reference),
                          cfg.loss.needs_kl),
            cfg.reference_logps,
            {"batch_size": max(1, cfg.batch_size // ranks), "head_chunk": cfg.head_chunk,
             "prefix_share": cfg.prefix_share,
             "allow_tokenizer_mismatch": cfg.allow_tokenizer_mismatch})


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
    """The base's content key (a reference adapter is refused on another base) and, for
    DPO with an adapter reference, that adapter's (retrained in place: said at score)."""
    keys = {"model_key": model_fingerprint(cfg.model)}
    if cfg.loss_spec().needs_reference and (folder := adapter_path(cfg.reference)):
        keys["reference_key"] = adapter_fingerprint(folder)
    return keys


def claim_run(cfg: TrainConfig) -> AbstractContextManager[Path]:
    """``cfg.out`` held as this process's run (engine/host/outputs.py): refused when it holds
    files Pomona did not write, another process is writing it, or it overlaps an input."""
    return claim(cfg.out, ("run",), legacy=is_run_dir, may_hold=False,
                 inputs=[cfg.model, cfg.data, cfg.warm_start, adapter_path(cfg.reference),
                         cfg.reference_logps])


def train(cfg: TrainConfig, callbacks: Sequence[Callback] = ()) -> TrainResult:
    """Train one adapter as ``cfg`` says; write it to ``cfg.out``; return a summary."""
    cfg.validate()
    with memory_limit(cfg.memory_limit_gb), ExitStack() as held:
        return _train(cfg, callbacks, held)


def _train(cfg: TrainConfig, callbacks: Sequence[Callback], held: ExitStack) -> TrainResult:
    started = time.perf_counter()
    ranks = init_ranks()
    if cfg.batch_size % ranks.size:
        raise ValueError(f"batch_size={cfg.batch_size} does not split over {ranks.size} "
                         "ranks: make it a multiple of the number of ranks")
    out = Path(cfg.out)
    if ranks.main:  # the one writer holds its folder until training ends
        held.enter_context(claim_run(cfg))
    out.mkdir(parents=True, exist_ok=True)
    if cfg.loss_spec().needs_reference:  # made before the policy loads: one model at a time
        if cfg.warm_start and cfg.reference == BASE:
            log.warning("warm_start %s with reference base: the policy starts away from its "
                        "reference (SFT, then DPO: give --reference %s)", cfg.warm_start,
                        cfg.warm_start)
        ensure_reference(*reference_of(cfg, ranks.size))
    prepared = prepare_training(cfg)
    say_unread_settings(cfg)
    model, stack, spec = prepared.model, prepared.stack, prepared.lora
    num_layers = len(stack.layers) if cfg.lora_layers < 0 else cfg.lora_layers
    if cfg.warm_start:
        load_adapter_weights(model, Path(cfg.warm_start))
    data = load_pairs_for(cfg.data, cfg.model, stack, cfg.allow_tokenizer_mismatch)
    if cfg.loss_spec().needs_reference:
        attach_reference(data, *reference_of(cfg, ranks.size))
    check_train_split(data, cfg.data)
    refuse_beyond_context([*data.train, *data.valid, *data.test], stack.context)
    loss_spec = cfg.loss_spec()
    if cfg.best_metric not in validation_metrics(loss_spec):  # refused before any step
        raise ValueError(f"best_metric={cfg.best_metric!r}: loss {cfg.loss.kind} reports "
                         f"{validation_metrics(loss_spec)}")
    pad_multiple = resolve_pad_multiple(cfg.pad_multiple)
    resolve_prefix_attention(cfg.prefix_attention, pad_multiple)  # refuse unsafe, before work
    pad_id = prepared.pad_id
    optimizer = make_optimizer(cfg)

    start = 0
    ckpt = resume_checkpoint(cfg, out)
    if ckpt is not None:  # refused before any weight is touched
        check_resume(cfg, ckpt, read_state(ckpt))
        start = int(load_checkpoint(model, optimizer, ckpt)["step"])
        log.info("resumed from %s (step %d)", ckpt, start)
    settings = run_settings(cfg) if cfg.checkpoint_every else {}
    if ranks.main:
        prepare_out(out, start if ckpt is not None else None)

    def batch_of(pairs: list) -> PairBatch | PrefixBatch:
        return choose_layout(pairs, cfg, pad_multiple, pad_id)

    batches = micro_batches(data.train, cfg.batch_size, cfg.seed, start * cfg.grad_accum)
    verified = verify_paths(model, stack, batch_of(data.train[: cfg.batch_size]), loss_spec,
                            cfg) if cfg.verify else {}

    def validate(step: int) -> dict[str, Any]:
        metrics = evaluate(model, stack, data.valid, loss_spec, cfg.batch_size, pad_multiple,
                           cfg.head_chunk, cfg.val_batches, layout=batch_of)
        rec = {"step": step, "split": "valid",
               **{f"val/{k}": v for k, v in metrics.items()},
               "val/rows_skipped": sum(data.rejected.values())}
        if ranks.main:
            _emit(rec, out, callbacks)
        return rec

    model.train()
    if not data.valid:  # said once every refusal is past: the run goes ahead without
        log.warning("%s: the valid split is empty: no validation metrics, and no best "
                    "evaluation to rank this run by", cfg.data)
    elif cfg.val_every and start == 0:
        validate(0)  # the "before" numbers every later evaluation is read against
    window = Window()
    result = TrainResult(out=str(out), steps=start, trainable_params=prepared.trainable,
                         rejected_rows=dict(data.rejected), load_check=prepared.check,
                         verified=verified)
    total_tokens, total_seconds = 0, 0.0
    update = make_update(model, optimizer, cfg.grad_clip)
    def shard_of(pairs: list) -> PairBatch | PrefixBatch | Idle:
        mine = ranks.shard(pairs)  # none: the last micro-batch of an epoch, fewer than ranks
        return batch_of(mine) if mine else Idle(batch_of(pairs[:1]))

    prefetch = Prefetch(lambda: [shard_of(next(batches)) for _ in range(cfg.grad_accum)],
                        cfg.steps - start)
    trained = 0  # this rank's pairs
    for step in range(start + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        micro = prefetch.next()  # built on a thread while the last step ran
        pending = dispatch_grads(model, stack, micro, loss_spec, cfg, step, ranks)
        # The update is queued before the host waits: one barrier a step. A non-finite
        # step still stops the run before anything is saved.
        norm = update(pending.grads)
        loss, sums = pending.read(ranks)
        grad_norm = float(norm)
        trained += sum(len(b.ids) for b in micro)
        if not math.isfinite(loss):
            raise NonFiniteLoss(f"step {step}: loss {loss} on pairs "
                                f"{[i for b in micro for i in b.ids][:8]}")
        if not math.isfinite(grad_norm):  # the run stops: this update is never saved
            raise NonFiniteLoss(f"step {step}: grad norm {grad_norm} on pairs "
                                f"{[i for b in micro for i in b.ids][:8]}")
        lr = float(optimizer.learning_rate)  # the rate this update used
        seconds = time.perf_counter() - t0
        tokens = int(sums.pop("tokens"))  # every rank's
        window.add(loss, sums, grad_norm, tokens, seconds)
        total_tokens, total_seconds = total_tokens + tokens, total_seconds + seconds
        result.steps = step
        if step % cfg.report_every == 0 or step == cfg.steps:
            result.final = window.record(step, lr)
            result.peak_memory_gb = max(result.peak_memory_gb, result.final["peak_memory_gb"])
            if ranks.main:
                _emit(result.final, out, callbacks)
            window.reset()
        if data.valid and ((cfg.val_every and step % cfg.val_every == 0) or step == cfg.steps):
            rec = validate(step)
            if better(rec, result.best_val, cfg.best_metric, cfg.best_mode):
                result.best_val = rec
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and ranks.main:
            save_checkpoint(model, optimizer, out, step,
                            {"seed": cfg.seed, "settings": settings}, spec, num_layers)
            prune_checkpoints(out, cfg.keep_checkpoints)

    result.world_size, result.rank_pairs = ranks.size, ranks.gather_counts(trained)
    result.tokens_per_sec = total_tokens / max(total_seconds, 1e-9)
    result.seconds = time.perf_counter() - started
    if ranks.main:
        weights = loss_weights(cfg)
        extra = {"model": cfg.model, "pomona": {"steps": result.steps, "loss": cfg.loss.kind,
                                                **weights, **content_keys(cfg),
                                                "seed": cfg.seed, "world_size": ranks.size}}
        save_adapters(model, out, spec, num_layers, extra)
        run_write_text(out / "summary.json", json.dumps(result.__dict__, indent=2) + "\n")
    return result
