"""The load-time check: a family's Stack must reproduce the model's own logits and gradients;
and ``--verify``, the configured path against the plain one on a real batch.

Every path that trains, probes or scores reads the model through a ``Stack``
(engine/model/arch); ``checked_stack`` refuses a model whose decomposition is wrong rather than
train it wrongly. The check runs on the model's float32 structural copy
(engine/check/check_copy.py: one layer of each kind, dequantized, a slice of the vocabulary) at
float32 tolerances, at a length past the largest sliding window (an 8-token check cannot
see a window): the stack's logits against ``model(tokens)``, and the segmented backward's
LoRA gradients (segment size 1, so every boundary and cross-segment state is crossed)
against ``nn.value_and_grad`` over the model's own call.

Half precision judges nothing: two bf16 computations of one deep Gemma stack differ by
O(1) (plain bf16 autograd is 1.4 off float32 on 34 layers), so the native dtype's distance
from float32 is reported, for the segmented path and plain autograd alike, never refused
on. On CUDA, float32 matmuls must not run as TF32 (engine/__init__.py turns it off; a
user's ``MLX_ENABLE_TF32=1`` is refused by name here).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from engine.backward.segmented import segmented_value_and_grad, value_and_grad
from engine.check.check_copy import CheckCopy, is_quantized, same_structure, structural_copy
from engine.data.batch import PairBatch, batch_norms
from engine.forward.prefix import PrefixBatch, pair_batch
from engine.forward.scoring import batch_kl, kl_point
from engine.host.inflight import silent_phases
from engine.losses import LossSpec, pair_loss
from engine.model.arch import FAMILIES, make_stack, model_type, supported
from engine.model.arch.stack import Stack
from engine.model.head import token_logps
from engine.model.load import set_dropout_seed
from engine.model.recompute import chunk_mlps, mlp_chunks
from engine.settings.config import TrainConfig

log = logging.getLogger(__name__)

# Relative tolerances by activation dtype. The load check and --verify run float32 (a
# half-precision model on its float32 copy): the stack calls the same modules in the same
# order, so it agrees to rounding (≤ 2e-4 measured on every real shape); a structural
# mistake (a lost window, scale or state) is of order 1e-1 to 1. The half-precision
# entries hold for a direct check_stack call on a model in that dtype.
TOLERANCE = {mx.float32: 1e-3, mx.bfloat16: 3e-2, mx.float16: 1e-2}
MIN_LENGTH = 64


def check_length(stack: Stack) -> int:
    """Tokens the check runs on: past the largest sliding window the stack maps and the
    config declares, by a margin (a stack blind to a window must meet it)."""
    windows = stack.windows + stack.declared_windows
    return max(MIN_LENGTH, max(windows, default=0) + 32)


def _tokens(vocab: int, length: int) -> mx.array:
    rng = np.random.default_rng(0)  # a fixed probe: the check is deterministic
    return mx.array(rng.integers(5, max(vocab, 6), size=(1, length)).astype(np.int32))


def _rel_err(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.abs(a - b).max()) / max(float(mx.abs(b).max()), 1e-12)


def grad_distance(got: dict[str, mx.array], ref: dict[str, mx.array]) -> float:
    """max |got − ref| over every tensor, relative to max |ref|."""
    scale = max(float(mx.abs(g).max()) for g in ref.values())
    return max(float(mx.abs(got[k].astype(mx.float32) - ref[k].astype(mx.float32)).max())
               for k in ref) / max(scale, 1e-12)


@contextmanager
def checkpointed_layers(stack: Stack) -> Iterator[None]:
    """Inside: the model's own blocks recompute their activations in the backward (mlx-lm's
    ``grad_checkpoint`` pattern, undone after), so the reference gradient holds one layer's
    activations, not the whole stack's."""
    saved = {cls: cls.__call__ for cls in {type(layer) for layer in stack.layers}}

    def wrap(call: Callable) -> Callable:
        def checkpointed(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            def inner(params: dict, *a: Any, **k: Any) -> Any:
                module.update(params)
                return call(module, *a, **k)

            return mx.checkpoint(inner)(module.trainable_parameters(), *args, **kwargs)

        return checkpointed

    try:
        for cls, call in saved.items():
            cls.__call__ = wrap(call)
        yield
    finally:
        for cls, call in saved.items():
            cls.__call__ = call


class CheckInputs:
    """The check's fixed inputs: tokens past the largest window and a random weighting of
    their log-probs (a loss whose gradient reaches every position)."""

    def __init__(self, stack: Stack, length: int | None = None):
        self.length = length or check_length(stack)
        tokens = _tokens(stack.inner.embed_tokens.weight.shape[0], self.length + 1)
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:]
        rng = np.random.default_rng(1)
        self.weights = mx.array(rng.normal(size=(1, self.length)).astype(np.float32))

    def loss_of_logps(self, lp: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        return (lp * self.weights).sum(), {}

    def autograd(self, model: nn.Module, stack: Stack) -> dict[str, mx.array]:
        """LoRA gradients by ``nn.value_and_grad`` over the model's own call."""
        with checkpointed_layers(stack):
            _, grads = nn.value_and_grad(model, lambda x: self.loss_of_logps(
                token_logps(model(x), self.targets))[0])(self.inputs)
            grads = dict(tree_flatten(grads))
            mx.eval(grads)
        return grads

    def segmented(self, model: nn.Module, stack: Stack) -> dict[str, mx.array]:
        """LoRA gradients by the engine's segmented backward, segments of one layer."""
        ones = np.ones((1, self.length), np.float32)
        batch = PairBatch(["check"], np.array(self.inputs), np.array(self.targets), ones, ones,
                          self.length)
        with silent_phases():
            _, _, grads = segmented_value_and_grad(model, stack, batch, self.loss_of_logps, 1)
        mx.eval(grads)
        return grads


def check_stack(model: nn.Module, stack: Stack, length: int | None = None) -> dict[str, float]:
    """Raise ValueError naming the model type unless ``stack`` reproduces ``model``'s
    logits (and, with LoRA attached, its gradients) at the tolerance of ``model``'s dtype;
    return the relative errors. ``check_model`` calls it on a float32 copy."""
    probe = CheckInputs(stack, length)
    theirs = model(probe.inputs)
    tol = TOLERANCE.get(theirs.dtype, 3e-2)
    errors = {"logits": _rel_err(stack.forward(probe.inputs), theirs)}
    del theirs
    where = (f"{stack.model_type} ({stack.family} decomposition, {probe.length} tokens, "
             f"windows {stack.windows or 'none'})")
    if not errors["logits"] <= tol:
        raise ValueError(f"{where}: the layer-stack forward differs from the model's own by "
                         f"{errors['logits']:.3g} (relative; tolerance {tol}); this "
                         "architecture cannot be trained exactly")
    refuse_lora_outside(model, stack)
    trainable = [k for k, _ in tree_flatten(model.trainable_parameters())]
    outside = [k for k in trainable if not k.startswith(f"{stack.layers_prefix}.")]
    if not trainable or outside:  # nothing trains, or an unfrozen model loaded to score
        return errors
    ref, got = probe.autograd(model, stack), probe.segmented(model, stack)
    if set(got) != set(ref):
        missing = sorted(set(ref) ^ set(got))[:4]
        raise ValueError(f"{where}: the segmented backward's trainable set differs from the "
                         f"model's ({missing} ...)")
    errors["grads"] = grad_distance(got, ref)
    if not errors["grads"] <= tol:
        raise ValueError(f"{where}: LoRA gradients through the layer stack differ from "
                         f"autograd over the model by {errors['grads']:.3g} (relative; "
                         f"tolerance {tol}); this architecture cannot be trained exactly")
    return errors


def refuse_lora_outside(model: nn.Module, stack: Stack) -> None:
    """ValueError naming a LoRA layer outside the transformer blocks (the engine trains the
    blocks only; the check's copy has no place for it)."""
    outside = [k for k, _ in tree_flatten(model.trainable_parameters())
               if "lora_" in k and not k.startswith(f"{stack.layers_prefix}.")]
    if outside:
        raise ValueError(f"LoRA outside the layer stack ({outside[0]}): the engine trains "
                         "LoRA in the transformer blocks only; drop it from lora_keys")


def tf32_active() -> bool:
    """Whether float32 matmuls on the default device lose precision (TF32: ~1e-3 per
    product, where float32 rounds to ~1e-7). MLX reads MLX_ENABLE_TF32 once, at its first
    float32 matmul, so the answer holds for the process."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((128, 128)).astype(np.float32) for _ in range(2))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    got = np.array(mx.matmul(mx.array(a), mx.array(b)), np.float64)
    return float(np.abs(got - exact).max() / np.abs(exact).max()) > 1e-5


def native_dtype(stack: Stack) -> mx.Dtype:
    """The dtype the model computes in (its embedding's output)."""
    return stack.embed(mx.array([[1]])).dtype


def check_model(model: nn.Module, stack: Stack) -> dict[str, Any]:
    """The load check (module docstring) on ``model``'s float32 structural copy; raise
    ValueError unless it passes; return its figures (errors, what was kept, seconds, its
    own peak memory: the peak is reset after, so a run's peak counts its steps)."""
    started = time.perf_counter()
    mx.reset_peak_memory()
    if mx.default_device() == mx.gpu and tf32_active():
        raise ValueError("float32 matmuls run as TF32 here (MLX_ENABLE_TF32=1 in the "
                         "environment): the load check needs full float32; unset it")
    refuse_lora_outside(model, stack)
    try:
        copy = structural_copy(model, stack)
    except (KeyError, IndexError, TypeError, ValueError) as err:  # a family's hooks
        raise ValueError(f"{stack.model_type}: the check's float32 copy could not be built "
                         f"({type(err).__name__}: {err}); report this as a Pomona bug") from err
    log.info("load check: %s (%s) on a float32 copy (%s) ...", stack.model_type,
             stack.family, copy.describe())
    mismatch = same_structure(copy, stack)
    if mismatch:
        raise ValueError(f"{stack.model_type}: the check's copy does not keep the model's "
                         f"structure ({mismatch}); report this as a Pomona bug")
    figures: dict[str, Any] = check_stack(copy.model, copy.stack)
    figures.update({"layers_checked": len(copy.keep), "layers": copy.layers,
                    "vocab_checked": copy.vocab, "tokens": check_length(copy.stack)})
    quantized = is_quantized(stack)
    reference = None if quantized else copy  # a quantized model has its own (below)
    del copy
    figures.update(native_distances(model, stack, reference, quantized))
    del reference
    mx.clear_cache()
    figures.update({"seconds": time.perf_counter() - started,
                    "peak_gb": mx.get_peak_memory() / 1e9})
    mx.reset_peak_memory()
    log.info("load check passed: %s", format_figures(figures))
    return figures


def native_distances(model: nn.Module, stack: Stack, reference: CheckCopy | None,
                     quantized: bool) -> dict[str, Any]:
    """How far the native dtype's gradients sit from float32's, for the segmented path and
    plain autograd alike (information; empty without LoRA, or for bf16 on a CPU, which has
    no fast half-precision path: minutes there). The reference is the float32 copy, or for
    a quantized model (``reference`` None) the float32 twin of its re-quantized copy: the
    same weights, computed in float32."""
    dtype = native_dtype(stack)
    if not any(hasattr(m, "lora_a") for _, m in stack.text.named_modules()) or (
            dtype == mx.float32 and not quantized):
        return {}
    if dtype != mx.float32 and mx.default_device() != mx.gpu:
        return {"native": f"{_name(dtype)} not measured on the CPU"}
    native = structural_copy(model, stack, native=True)
    ref = reference or structural_copy(native.model, native.stack, whole=True)
    ref.model.update(native.model.trainable_parameters())  # the same LoRA factors
    probe = CheckInputs(ref.stack)
    grads = probe.autograd(ref.model, ref.stack)
    return {"native": _name(dtype) + (" (quantized)" if quantized else ""),
            "native_segmented": grad_distance(probe.segmented(native.model, native.stack),
                                              grads),
            "native_autograd": grad_distance(probe.autograd(native.model, native.stack), grads)}


def _name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def format_figures(f: dict[str, Any]) -> str:
    """One line: what was checked, the float32 errors, the native distances."""
    line = (f"{f['layers_checked']} of {f['layers']} layers, {f['vocab_checked']} tokens of "
            f"vocabulary, {f['tokens']} positions: logits {f['logits']:.2g}"
            + (f", LoRA grads {f['grads']:.2g}" if "grads" in f else "")
            + f" (float32; tolerance {TOLERANCE[mx.float32]})")
    if "native_segmented" in f:
        line += (f"; {f['native']} vs float32: segmented {f['native_segmented']:.2g}, plain "
                 f"autograd {f['native_autograd']:.2g} (information)")
    elif "native" in f:
        line += f"; {f['native']}"
    return line + f"; {f['seconds']:.1f} s, peak {f['peak_gb']:.2f} GB"


def checked_stack(model: nn.Module) -> tuple[Stack, dict[str, Any]]:
    """The model's Stack (engine/model/arch) and the load check's figures; ValueError unless it
    reproduces the model's logits and LoRA gradients past its largest sliding window:
    training, probes and scoring all read the model through it."""
    kind = model_type(model)
    try:
        stack = make_stack(model)
        figures = check_model(model, stack)
    except Exception as err:  # an unlisted family fails in any way it likes: say so
        if kind in FAMILIES:
            raise
        raise ValueError(f"model_type {kind!r} has no Pomona adapter and the llama-like "
                         f"decomposition does not fit it ({type(err).__name__}: {err}); "
                         f"supported: {supported()}") from err
    return stack, figures


class VerifyFailed(RuntimeError):
    """``--verify``: the configured path's loss or gradients differ from the plain path's."""


def verify_paths(model: nn.Module, stack: Stack, batch: PairBatch | PrefixBatch,
                 spec: LossSpec, cfg: TrainConfig, rtol: float | None = None
                 ) -> dict[str, float]:
    """One step through the configured path and the plain dense two-forward path (whole
    MLPs); raise if they differ by more than ``rtol`` (default: the tolerance for the
    model's dtype, engine/check/load_check.py). A half-precision or quantized model is verified
    on its float32 structural copy (engine/check/check_copy.py; the batch's ids folded into its
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

    kl = kl_point(*batch_kl(model, stack, pairs, cfg.head_chunk)) if spec.needs_kl else None

    def fn(lp: mx.array) -> Any:
        return pair_loss(lp, resp, nll, spec, norms, refs, kl, pairs.label_array())

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
                               targets=batch.targets % vocab,
                               kl=batch.kl and fold_ids(batch.kl, vocab))
