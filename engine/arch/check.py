"""The load-time check: a Stack must reproduce the model's own logits and LoRA gradients.

It runs at a length beyond the model's largest sliding window (an 8-token check cannot
see a window), compares the stack's logits with ``model(tokens)`` and, when LoRA is
attached, the segmented backward's gradients (segment size 1, so every boundary and every
cross-segment state is crossed) with ``nn.value_and_grad`` over the model's own call,
its blocks checkpointed, so the check needs about what a training step needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from engine.arch.stack import Stack
from engine.batch import PairBatch
from engine.inflight import silent_phases

# Relative tolerances by activation dtype: the stack calls the same modules in the same
# order, so float32 agrees to rounding; half precision rounds each op's output.
# A structural mistake (a lost window, scale or state) shows as an error of order 1; a
# random-init model with saturated attention rounds to ~1e-3 in float32 on its own.
TOLERANCE = {mx.float32: 1e-3, mx.bfloat16: 3e-2, mx.float16: 1e-2}
MIN_LENGTH = 64


def check_length(stack: Stack) -> int:
    """Tokens the check runs on: past the largest sliding window, by a margin (for an
    unlisted family, past every window its config declares, mapped or not)."""
    windows = stack.windows + ([] if stack.listed else stack.declared_windows)
    return max(MIN_LENGTH, max(windows, default=0) + 32)


def _tokens(vocab: int, length: int) -> mx.array:
    rng = np.random.default_rng(0)  # a fixed probe: the check is deterministic
    return mx.array(rng.integers(5, max(vocab, 6), size=(1, length)).astype(np.int32))


def _rel_err(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.abs(a - b).max()) / max(float(mx.abs(b).max()), 1e-12)


@contextmanager
def checkpointed_layers(stack: Stack) -> Iterator[None]:
    """Inside: the model's own blocks recompute their activations in the backward (mlx-lm's
    ``grad_checkpoint`` pattern, undone after), so the reference gradient holds one layer's
    activations, not the whole stack's, and the check costs less than a training step."""
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


def _gradient_errors(model: nn.Module, stack: Stack, inputs: mx.array, targets: mx.array,
                     where: str) -> float:
    """The segmented backward's LoRA grads (segment size 1) against autograd over the
    model's own call, for a fixed random weighting of the token log-probs."""
    from engine.head import token_logps
    from engine.segmented import segmented_value_and_grad  # the engine's own path

    length = inputs.shape[1]
    weights = mx.array(np.random.default_rng(1).normal(size=(1, length)).astype(np.float32))

    def loss_of_logps(lp: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        return (lp * weights).sum(), {}

    with checkpointed_layers(stack):
        _, ref = nn.value_and_grad(
            model, lambda x: loss_of_logps(token_logps(model(x), targets))[0])(inputs)
        ref = dict(tree_flatten(ref))
        mx.eval(ref)
    ones = np.ones((1, length), np.float32)
    batch = PairBatch(["check"], np.array(inputs), np.array(targets), ones, ones, length)
    with silent_phases():
        _, _, got = segmented_value_and_grad(model, stack, batch, loss_of_logps, 1)
    if set(got) != set(ref):
        missing = sorted(set(ref) ^ set(got))[:4]
        raise ValueError(f"{where}: the segmented backward's trainable set differs from the "
                         f"model's ({missing} ...)")
    scale = max(float(mx.abs(g).max()) for g in ref.values())
    return max(float(mx.abs(got[k].astype(mx.float32) - ref[k].astype(mx.float32)).max())
               for k in ref) / max(scale, 1e-12)


def check_stack(model: nn.Module, stack: Stack, length: int | None = None) -> dict[str, float]:
    """Raise ValueError naming the model type unless ``stack`` reproduces ``model``'s
    logits (and, with LoRA attached, its gradients); return the relative errors."""
    length = length or check_length(stack)
    tokens = _tokens(stack.inner.embed_tokens.weight.shape[0], length + 1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    theirs = model(inputs)
    tol = TOLERANCE.get(theirs.dtype, 3e-2)
    errors = {"logits": _rel_err(stack.forward(inputs), theirs)}
    del theirs
    where = (f"{stack.model_type} ({stack.family} decomposition, {length} tokens, windows "
             f"{stack.windows or 'none'})")
    if not errors["logits"] <= tol:
        raise ValueError(f"{where}: the layer-stack forward differs from the model's own by "
                         f"{errors['logits']:.3g} (relative; tolerance {tol}); this "
                         "architecture cannot be trained exactly")
    trainable = [k for k, _ in tree_flatten(model.trainable_parameters())]
    outside = [k for k in trainable if not k.startswith(f"{stack.layers_prefix}.")]
    if any("lora_" in k for k in outside):
        raise ValueError(f"LoRA outside the layer stack ({outside[0]}): the engine trains "
                         "LoRA in the transformer blocks only; drop it from lora_keys")
    if not trainable or outside:  # nothing trains, or an unfrozen model loaded to score
        return errors
    errors["grads"] = _gradient_errors(model, stack, inputs, targets, where)
    if not errors["grads"] <= tol:
        raise ValueError(f"{where}: LoRA gradients through the layer stack differ from "
                         f"autograd over the model by {errors['grads']:.3g} (relative; "
                         f"tolerance {tol}); this architecture cannot be trained exactly")
    return errors
