"""The training loop: one LoRA adapter trained with ORPO (or SFT) on one dataset.

AdamW (bias-corrected by default, as torch/TRL), linear warmup + cosine decay, global-norm
clipping, gradient accumulation (normalised over the whole optimizer batch, so 4×1 equals
1×4), validation every N steps, checkpoints with optimizer state and resume. Progress
leaves through callbacks (``on_metrics``) and ``metrics.jsonl``; nothing here prints UI.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from engine.adapters import (
    atomic_write_text,
    latest_checkpoint,
    load_adapter_weights,
    load_checkpoint,
    prune_checkpoints,
    save_adapters,
    save_checkpoint,
)
from engine.arch.stack import Stack
from engine.batch import PairBatch, batch_norms
from engine.check_copy import is_quantized, structural_copy
from engine.config import TrainConfig
from engine.data import check_train_split, micro_batches, pair_length
from engine.data_fit import load_pairs_for
from engine.distributed import SINGLE, Ranks, init_ranks
from engine.layout_policy import choose_layout, resolve_pad_multiple, resolve_prefix_attention
from engine.load_check import TOLERANCE, checked_stack, native_dtype
from engine.losses import LossSpec, Norms, pair_loss, validation_metrics
from engine.model import (
    LoraSpec,
    attach_lora,
    load_model,
    resolve_lora_keys,
    set_dropout_seed,
)
from engine.outputs import claim
from engine.prefix import PrefixBatch, pair_batch
from engine.recompute import chunk_mlps, mlp_chunks
from engine.reference import (
    ReferenceSpec,
    attach_reference,
    ensure_reference,
    resolved_reference,
)
from engine.scoring import evaluate
from engine.segmented import Grads, grads_to_tree, value_and_grad

log = logging.getLogger(__name__)


class Callback(Protocol):
    """Receives each metrics record (``split`` = "train" or "valid") as it is written."""

    def on_metrics(self, record: dict[str, Any]) -> None: ...


class NonFiniteLoss(RuntimeError):
    """The loss or gradient norm became NaN/inf; names the step and the pairs."""


class VerifyFailed(RuntimeError):
    """``--verify``: the configured path's loss or gradients differ from the plain path's."""


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
    world_size: int = 1  # processes the run's batches were split over (engine/distributed.py)
    rank_pairs: list[int] = field(default_factory=list)  # pairs each rank trained
    load_check: dict[str, Any] = field(default_factory=dict)  # engine/load_check.py figures
    verified: dict[str, Any] = field(default_factory=dict)  # --verify's figures (verify_paths)


def lora_spec(cfg: TrainConfig) -> LoraSpec:
    return LoraSpec(cfg.lora_rank, cfg.lora_scale, cfg.lora_dropout, cfg.lora_keys,
                    cfg.lora_layers)


def make_optimizer(cfg: TrainConfig) -> optim.AdamW:
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    if cfg.lr_schedule == "cosine":
        main = optim.cosine_decay(cfg.learning_rate, decay_steps,
                                  cfg.learning_rate * cfg.min_lr_ratio)
    else:
        def main(step: mx.array) -> mx.array:
            return mx.array(cfg.learning_rate)
    schedule = main
    if cfg.warmup_steps > 0:
        warm = optim.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
        schedule = optim.join_schedules([warm, main], [cfg.warmup_steps])
    return optim.AdamW(learning_rate=schedule, betas=[cfg.adam_beta1, cfg.adam_beta2],
                       eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                       bias_correction=cfg.bias_correction)


@dataclass
class StepGrads:
    """One optimizer step's loss, metrics and grads, dispatched to the device but not yet
    read: the trainer queues the update behind them and then waits once (``read``)."""

    losses: list[mx.array]
    metrics: list[dict[str, mx.array]]
    grads: Grads
    counts: dict[str, float]  # micro_batches, shared_batches, tokens (host numbers)
    norms: Norms

    def read(self, ranks: Ranks = SINGLE) -> tuple[float, dict[str, float]]:
        """Summed loss and metric sums as host floats (with several ranks, every rank's)."""
        mx.eval(self.losses, self.metrics)
        total, sums = 0.0, {}
        for loss, metrics in zip(self.losses, self.metrics, strict=True):
            total += float(loss)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        sums.update(self.counts)
        sums["loss"] = total
        sums = ranks.sum_floats(sums)
        total = sums.pop("loss")
        sums["pairs"], sums["nll_tokens"] = self.norms.pairs, self.norms.nll_tokens
        return total, sums


def dispatch_grads(model: nn.Module, stack: Stack, micro: Sequence[PairBatch | PrefixBatch],
                   spec: LossSpec, cfg: TrainConfig, step: int, ranks: Ranks = SINGLE
                   ) -> StepGrads:
    """Loss, metrics and grads of one optimizer step's micro-batches (this rank's shards;
    with several ranks, normalised and summed over all of them), the last micro-batch's
    backward still running on return: nothing here waits for it."""
    layouts = [pair_batch(b) for b in micro]
    norms: Norms = ranks.sum_norms(batch_norms(layouts))
    losses, metric_list, grads = [], [], {}
    for i, (b, pb) in enumerate(zip(micro, layouts, strict=True)):
        if i:  # bound the accumulation: the earlier micro-batches finish first
            mx.eval(losses, metric_list, grads)
        set_dropout_seed(model, (cfg.seed * 1_000_003 + step) * 1009 + i)
        resp, nll, ref = mx.array(pb.resp_mask), mx.array(pb.nll_mask), pb.ref_array()
        loss, metrics, g = value_and_grad(
            model, stack, b,
            lambda lp, r=resp, n=nll, f=ref: pair_loss(lp, r, n, spec, norms, f),
            cfg.segment_size, cfg.head_chunk, cfg.inflight)
        grads = g if not grads else {k: grads[k] + g[k] for k in grads}
        losses.append(loss)
        metric_list.append(metrics)
    counts = {"micro_batches": len(micro),
              "shared_batches": sum(isinstance(b, PrefixBatch) for b in micro),
              "tokens": sum(pb.tokens for pb in layouts)}
    return StepGrads(losses, metric_list, ranks.sum_arrays(grads), counts, norms)


def step_grads(model: nn.Module, stack: Stack, micro: Sequence[PairBatch | PrefixBatch],
               spec: LossSpec, cfg: TrainConfig, step: int, ranks: Ranks = SINGLE
               ) -> tuple[float, dict[str, float], Grads]:
    """``dispatch_grads``, waited for: summed loss, metric sums and evaluated grads."""
    pending = dispatch_grads(model, stack, micro, spec, cfg, step, ranks)
    mx.eval(pending.grads)
    return (*pending.read(ranks), pending.grads)


class Window:
    """Accumulates training metrics between reports."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, float] = {}
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.tokens, self.seconds = 0, 0.0
        mx.reset_peak_memory()

    def add(self, loss: float, sums: dict[str, float], grad_norm: float, tokens: int,
            seconds: float) -> None:
        for k, v in sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.losses.append(loss)
        self.norms.append(grad_norm)
        self.tokens += tokens
        self.seconds += seconds

    def record(self, step: int, lr: float) -> dict[str, Any]:
        s = dict(self.sums)
        pairs, nll_tokens = s.pop("pairs"), s.pop("nll_tokens")
        share = s.pop("shared_batches") / max(s.pop("micro_batches"), 1)
        rec: dict[str, Any] = {"step": step, "split": "train",
                               "loss": sum(self.losses) / len(self.losses),
                               "nll_loss": s.pop("nll_sum") / nll_tokens}
        rec.update({k: v / pairs for k, v in s.items()})
        rec.update({"grad_norm": sum(self.norms) / len(self.norms), "learning_rate": lr,
                    "prefix_share_rate": share,
                    "tokens_per_sec": self.tokens / max(self.seconds, 1e-9),
                    "peak_memory_gb": mx.get_peak_memory() / 1e9})
        return rec


def verify_paths(model: nn.Module, stack: Stack, batch: PairBatch | PrefixBatch,
                 spec: LossSpec, cfg: TrainConfig, rtol: float | None = None
                 ) -> dict[str, float]:
    """One step through the configured path and the plain dense two-forward path (whole
    MLPs); raise if they differ by more than ``rtol`` (default: the tolerance for the
    model's dtype, engine/load_check.py). A half-precision or quantized model is verified
    on its float32 structural copy (engine/check_copy.py; the batch's ids folded into its
    vocabulary): two bf16 paths of one deep stack differ by O(1) however right both are."""
    where = "the plain dense path"
    if native_dtype(stack) != mx.float32 or is_quantized(stack):
        copy = structural_copy(model, stack)
        if cfg.mlp_chunk:
            chunk_mlps(copy.stack.layers, cfg.mlp_chunk)
        model, stack, batch = copy.model, copy.stack, fold_ids(batch, copy.vocab)
        where += f" on a float32 copy ({copy.describe()})"
    pairs = pair_batch(batch)
    norms = batch_norms([pairs])
    resp, nll, refs = mx.array(pairs.resp_mask), mx.array(pairs.nll_mask), pairs.ref_array()

    def fn(lp: mx.array) -> Any:
        return pair_loss(lp, resp, nll, spec, norms, refs)

    set_dropout_seed(model, 0)
    with mlp_chunks(stack.layers, 0):
        ref_loss, _, ref = value_and_grad(model, stack, pairs, fn)
    if rtol is None:
        dtype = stack.embed(mx.array(pairs.inputs[:1, :1])).dtype
        rtol = TOLERANCE.get(dtype, 3e-2)
    loss, _, got = value_and_grad(model, stack, batch, fn, cfg.segment_size, cfg.head_chunk,
                                  cfg.inflight)
    scale = max(max(float(mx.abs(g).max()) for g in ref.values()), 1e-12)
    grad_err = max(float(mx.abs(got[k] - ref[k]).max()) for k in ref) / scale
    loss_err = abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-12)
    path = (f"segment_size={cfg.segment_size}, head_chunk={cfg.head_chunk}, "
            f"shared={pairs is not batch}")
    if set(got) != set(ref) or grad_err > rtol or loss_err > rtol:
        raise VerifyFailed(f"--verify failed: {path} differs from {where} (loss rel "
                           f"err {loss_err:.2e}, grad rel err {grad_err:.2e}, tolerance {rtol})")
    log.info("--verify passed: %s matches %s on %d pairs (loss rel err %.2e, grad rel err "
             "%.2e over %d LoRA arrays, tolerance %g)", path, where, pairs.pairs, loss_err,
             grad_err, len(ref), rtol)
    return {"loss_rel_err": loss_err, "grad_rel_err": grad_err, "tolerance": rtol,
            "pairs": pairs.pairs, "arrays": len(ref)}


def fold_ids(batch: PairBatch | PrefixBatch, vocab: int) -> PairBatch | PrefixBatch:
    """``batch`` with every token id taken modulo ``vocab`` (a structural copy's rows):
    the same layout and masks over ids the copy has."""
    if isinstance(batch, PrefixBatch):
        return dataclasses.replace(batch, inputs=batch.inputs % vocab,
                                   pairs=fold_ids(batch.pairs, vocab))
    return dataclasses.replace(batch, inputs=batch.inputs % vocab,
                               targets=batch.targets % vocab)


def _emit(record: dict[str, Any], out: Path, callbacks: Sequence[Callback]) -> None:
    log = out / "metrics.jsonl"
    try:
        with log.open("a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as err:  # a full disk: the error names the file, as the others do
        raise OSError(err.errno, f"cannot write {log}: {err.strerror or err}") from None
    for cb in callbacks:
        cb.on_metrics(record)


def prepare_out(out: Path, resume_step: int | None) -> None:
    """Clear what an earlier run in ``out`` wrote that this one writes again.

    A fresh start (``resume_step`` None) removes the old adapter, summary, metrics and
    checkpoints, as mlx-lm overwrites its ``--adapter-path`` (and a sweep re-runs a trial in
    its directory): a run killed later leaves no old adapter beside its new metrics, and
    ``resume: auto`` never picks up an old run's checkpoint. A resume keeps the
    checkpoints, trims metrics.jsonl back to the checkpoint's step (the steps after it run
    again) and removes the final adapter and summary until it writes them anew. Files the
    trainer does not write are left alone; ``out`` is a Pomona run (``claim_run``).
    """
    import shutil

    from engine.adapters import ADAPTER_FILE, CONFIG_FILE

    log = out / "metrics.jsonl"
    for stale in (out / ADAPTER_FILE, out / CONFIG_FILE, out / "summary.json"):
        stale.unlink(missing_ok=True)
    if resume_step is None:
        log.unlink(missing_ok=True)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    elif log.exists():
        def kept(line: str) -> bool:
            try:
                return int(json.loads(line)["step"]) <= resume_step
            except (ValueError, KeyError, TypeError):
                return False  # a line cut short by the kill
        lines = log.read_text().splitlines(keepends=True)
        atomic_write_text(log, "".join(line for line in lines if kept(line)))


class Prefetch:
    """Builds the next step's micro-batches on a worker thread while this step runs: the
    numpy layouts then cost no device time (MLX releases the GIL while it evaluates).
    The order is the iterator's own, so runs stay deterministic; ``steps`` bounds it."""

    def __init__(self, make: Callable[[], list], steps: int):
        from concurrent.futures import ThreadPoolExecutor

        self.make, self.left = make, steps
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pomona-batches")
        self.pending = self.pool.submit(make) if steps > 0 else None

    def next(self) -> list:
        micro = self.pending.result()
        self.left -= 1
        self.pending = self.pool.submit(self.make) if self.left > 0 else None
        if self.pending is None:
            self.pool.shutdown(wait=False)
        return micro


def make_update(model: nn.Module, optimizer: optim.AdamW, clip: float
                ) -> Callable[[Grads], mx.array]:
    """``update(grads) → norm``: clip (``clip`` > 0) and one AdamW update as ONE compiled
    function over the trainable arrays alone, queued (``async_eval``) and returned unread,
    so the host launches its small kernels while the backward's last stage still runs.
    Host time is the cost here (~128 arrays): the frozen weights stay out of compile's
    inputs, and the trees it takes are filled in place, not rebuilt from names each call.
    Call after the optimizer state is loaded."""
    optimizer.init(model.trainable_parameters())  # the state compile reads and writes
    params, grads_tree = _Tree(model.trainable_parameters()), _Tree(model.trainable_parameters())

    def step(tree: dict, current: dict) -> tuple[mx.array, dict]:
        clipped, norm = optim.clip_grad_norm(tree, clip if clip > 0 else float("inf"))
        return norm, optimizer.apply_gradients(clipped if clip > 0 else tree, current)

    compiled = mx.compile(step, inputs=optimizer.state, outputs=optimizer.state)

    def update(grads: Grads) -> mx.array:
        tree = grads_tree.fill(grads) if grads.keys() == grads_tree.paths.keys() else (
            grads_to_tree(grads))  # grads for a subset: the tree they name
        norm, new = compiled(tree, params.fill(params.read(model)))
        params.write(model, new, grads)
        mx.async_eval(norm, optimizer.state, new)
        return norm

    return update


class _Tree:
    """A nested parameter tree (dicts and lists) with each leaf's path resolved once, so
    reading, filling and writing its ~128 leaves skips mlx.utils' name parsing."""

    def __init__(self, tree: dict):
        self.tree = tree
        self.paths = {k: [int(p) if p.isdigit() else p for p in k.split(".")]
                      for k, _ in tree_flatten(tree)}

    @staticmethod
    def _parent(root: Any, path: list) -> Any:
        for p in path[:-1]:
            root = root[p]
        return root

    def fill(self, flat: dict[str, mx.array]) -> dict:
        for k, path in self.paths.items():
            self._parent(self.tree, path)[path[-1]] = flat[k]
        return self.tree

    def read(self, root: Any) -> dict[str, mx.array]:
        return {k: self._parent(root, path)[path[-1]] for k, path in self.paths.items()}

    def write(self, root: Any, new: dict, names: Iterable[str]) -> None:
        for k in names:
            path = self.paths[k]
            self._parent(root, path)[path[-1]] = self._parent(new, path)[path[-1]]


def better(rec: dict[str, Any], best: dict[str, Any], metric: str, mode: str) -> bool:
    """Whether validation record ``rec`` beats ``best`` on ``metric`` (``mode`` min or max);
    a NaN never does, and a metric the records lack is an error naming what they have."""
    if metric not in rec:
        have = sorted(k for k in rec if k.startswith("val/"))
        raise ValueError(f"best_metric={metric!r}: not among this run's validation metrics "
                         f"{have}")
    value = rec[metric]
    if not best:
        return True
    if not math.isfinite(value):
        return False
    if not math.isfinite(best[metric]):
        return True
    return value < best[metric] if mode == "min" else value > best[metric]


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
    """Inside: MLX's memory limit at ``gib`` GiB (0: unchanged); the old one after."""
    if gib <= 0:
        yield
        return
    before = mx.set_memory_limit(int(gib * 2**30))
    try:
        yield
    finally:
        mx.set_memory_limit(before)


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` holds a run an earlier Pomona wrote, before runs carried the mark
    of engine/outputs.py: its summary, an adapter config with Pomona's block, its metrics
    log or a checkpoint (a run killed early has only some of them)."""
    from engine.adapters import CONFIG_FILE

    def first_json(name: str) -> Any:
        try:
            with (path / name).open() as f:
                return json.loads(f.read() if name.endswith(".json") else f.readline())
        except (OSError, ValueError):
            return None

    summary, config, record = (first_json(n) for n in ("summary.json", CONFIG_FILE,
                                                        "metrics.jsonl"))
    return ((isinstance(summary, dict) and "trainable_params" in summary)
            or (isinstance(config, dict) and isinstance(config.get("pomona"), dict))
            or (isinstance(record, dict) and {"step", "split"} <= record.keys())
            or any((c / "state.json").is_file() for c in (path / "checkpoints").glob("step_*")))


def reference_of(cfg: TrainConfig, ranks: int = 1
                 ) -> tuple[ReferenceSpec, str | None, dict[str, Any]]:
    """DPO's reference as ``ensure_reference`` takes it: whose log-probs, the file to
    read (None: Pomona's cache, computed once when missing) and the forward's options (a
    rank's share of the batch: one device runs the pass)."""
    return (ReferenceSpec(cfg.model, cfg.data, resolved_reference(cfg.reference)),
            cfg.reference_logps,
            {"batch_size": max(1, cfg.batch_size // ranks), "head_chunk": cfg.head_chunk,
             "prefix_share": cfg.prefix_share,
             "allow_tokenizer_mismatch": cfg.allow_tokenizer_mismatch})


def loss_weights(cfg: TrainConfig) -> dict[str, Any]:
    """The loss's own settings, for the adapter's pomona block (adapters.trained_loss;
    DPO's reference too, which evaluation re-reads)."""
    weights = {k: v for k, v in asdict(cfg.loss_spec()).items()
               if k.startswith(f"{cfg.loss}_") or k == "nll_span"}
    if cfg.loss_spec().needs_reference:  # absolute: score and evaluation run from anywhere
        weights.update(rpo_alpha=cfg.rpo_alpha, reference=resolved_reference(cfg.reference))
    return weights


def claim_run(cfg: TrainConfig) -> AbstractContextManager[Path]:
    """``cfg.out`` held as this process's run (engine/outputs.py): refused when it holds
    files Pomona did not write, another process is writing it, or it overlaps an input."""
    reference = cfg.reference if cfg.reference != "base" else None
    return claim(cfg.out, ("run",), legacy=is_run_dir, may_hold=False,
                 inputs=[cfg.model, cfg.data, cfg.warm_start, reference, cfg.reference_logps])


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
        if cfg.warm_start and cfg.reference == "base":
            log.warning("warm_start %s with reference base: the policy starts away from its "
                        "reference (SFT, then DPO: give --reference %s)", cfg.warm_start,
                        cfg.warm_start)
        ensure_reference(*reference_of(cfg, ranks.size))
    model, tokenizer = load_model(cfg.model)
    spec = resolve_lora_keys(model, lora_spec(cfg))  # the family's targets, saved explicitly
    trainable = attach_lora(model, spec, cfg.seed)
    stack, load_check = checked_stack(model)
    if cfg.mlp_chunk:
        chunk_mlps(stack.layers, cfg.mlp_chunk)
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
        raise ValueError(f"best_metric={cfg.best_metric!r}: loss {cfg.loss} reports "
                         f"{validation_metrics(loss_spec)}")
    pad_multiple = resolve_pad_multiple(cfg.pad_multiple)
    resolve_prefix_attention(cfg.prefix_attention, pad_multiple)  # refuse unsafe, before work
    pad_id = tokenizer.pad_token_id or 0
    optimizer = make_optimizer(cfg)

    start = 0
    ckpt = latest_checkpoint(out) if cfg.resume == "auto" else (
        Path(cfg.resume) if cfg.resume else None)
    if ckpt is not None:
        start = int(load_checkpoint(model, optimizer, ckpt)["step"])
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
    window, result = Window(), TrainResult(out=str(out), steps=start, trainable_params=trainable,
                                           rejected_rows=dict(data.rejected),
                                           load_check=load_check, verified=verified)
    total_tokens, total_seconds = 0, 0.0
    update = make_update(model, optimizer, cfg.grad_clip)
    prefetch = Prefetch(lambda: [batch_of(ranks.shard(next(batches)))
                                 for _ in range(cfg.grad_accum)], cfg.steps - start)
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
            save_checkpoint(model, optimizer, out, step, {"seed": cfg.seed}, spec, num_layers)
            prune_checkpoints(out, cfg.keep_checkpoints)

    result.world_size, result.rank_pairs = ranks.size, ranks.gather_counts(trained)
    result.tokens_per_sec = total_tokens / max(total_seconds, 1e-9)
    result.seconds = time.perf_counter() - started
    if ranks.main:
        weights = loss_weights(cfg)
        extra = {"model": cfg.model, "pomona": {"steps": result.steps, "loss": cfg.loss,
                                                **weights, "seed": cfg.seed,
                                                "world_size": ranks.size}}
        save_adapters(model, out, spec, num_layers, extra)
        atomic_write_text(out / "summary.json", json.dumps(result.__dict__, indent=2) + "\n")
    return result
