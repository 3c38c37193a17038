"""The LM head: token log-probs, dense or bounded.

Dense: logits [N, T, V] exist at once (the plain path, and the reference).
Bounded (``head_chunk`` c): logits exist only for c tokens at a time, and only for the
tokens that carry loss; the backward is analytic, d log p(y)/d logits = onehot(y) − softmax,
evaluated chunk by chunk (lazy chunks inside one autograd graph were measured to stay alive
together in MLX, so each chunk is forced).

One pass suffices: token t's log-prob depends on h_t alone, so J_t = d log p_t / d h_t is
computed with the logits ([A, H], the size of the gradient itself) and the loss's cotangent
g_t, known only once every log-prob is, scales it afterwards: dL/dh_t = g_t · J_t. The head
then costs one forward and one backward matmul, like the dense path, never a recompute.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from engine.host.inflight import InFlight
from engine.model.arch.stack import Stack

LogpLoss = Callable[[mx.array], tuple[mx.array, dict[str, mx.array]]]


def token_logps(logits: mx.array, targets: mx.array) -> mx.array:
    """log p(targets) under ``logits`` [..., V] (float32) → [...]."""
    logits = logits.astype(mx.float32)
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - mx.logsumexp(logits, axis=-1)


def dense_logps(stack: Stack, h: mx.array, targets: mx.array) -> mx.array:
    """Token log-probs from the last hidden state h [N, T, H] with full logits."""
    return token_logps(stack.head(h), targets)


@mx.compile
def _logit_grads(logits: mx.array, y: mx.array) -> tuple[mx.array, mx.array]:
    """log p(y) and d log p(y) / d logits = onehot(y) − softmax, in the logits' dtype.

    Compiled: the softmax, one-hot and difference fuse into one kernel instead of four
    [c, V] float32 temporaries.
    """
    z = logits.astype(mx.float32)
    lse = mx.logsumexp(z, axis=-1, keepdims=True)
    lp = mx.take_along_axis(z, y[:, None], axis=-1)[:, 0] - lse[:, 0]
    hit = mx.arange(z.shape[-1])[None, :] == y[:, None]
    return lp, (hit.astype(mx.float32) - mx.exp(z - lse)).astype(logits.dtype)


def bounded_head_grad(
    head: Callable[[mx.array], mx.array],
    h: mx.array,
    targets: np.ndarray,
    active: np.ndarray,
    loss_of_logps: LogpLoss,
    chunk: int,
    inflight: int = 2,
    flight: InFlight | None = None,
) -> tuple[mx.array, dict[str, mx.array], mx.array]:
    """Loss, metrics and dL/dh for h [N, T, H], never holding more than ``chunk`` logits rows.
``head``: hidden states to logits (a stack's ``head``; GRPO's over its temperature).

    ``active`` [N, T] bool marks tokens whose log-prob the loss reads; the others get no
    head work and zero gradient. ``inflight`` pieces of ``chunk / inflight`` rows are
    evaluated at once, so the device never waits on Python and ``chunk`` still bounds
    the logits alive. ``flight``: the caller's queue (the segmented backward's), which the
    head joins without draining it: the result is returned queued, not evaluated.
    """
    n, t, width = h.shape
    own = flight is None
    if own:
        flight = InFlight(inflight)
    idx = mx.array(np.flatnonzero(active.reshape(-1)).astype(np.int32))
    h_act = h.reshape(n * t, width)[idx]  # [A, H]: only tokens the loss reads
    flat_targets = mx.array(targets.reshape(-1))[idx]
    flight.push(h_act, flat_targets)  # a leaf before the chunks slice it
    piece = max(1, -(-chunk // inflight))
    spans = [(s, min(s + piece, idx.size)) for s in range(0, idx.size, piece)]

    lps, jacs = [], []
    for s, e in spans:  # at most ``chunk`` rows of logits alive at a time
        h_c, y = h_act[s:e], flat_targets[s:e]
        lp, cot = _logit_grads(head(h_c), y)
        _, (jac,) = mx.vjp(head, [h_c], [cot])
        flight.push(lp, jac)
        lps.append(lp)
        jacs.append(jac)
    lp_active = mx.concatenate(lps) if lps else mx.zeros((0,), mx.float32)
    lp_full = mx.zeros((n * t,), mx.float32).at[idx].add(lp_active).reshape(n, t)

    (loss, metrics), g_full = mx.value_and_grad(loss_of_logps)(lp_full)
    grad = mx.zeros((n * t, width), h.dtype)
    if jacs:
        g_active = g_full.reshape(-1)[idx][:, None]
        grad = grad.at[idx].add((g_active * mx.concatenate(jacs)).astype(h.dtype))
    flight.push(loss, metrics, grad)
    if own:
        flight.drain()
    return loss, metrics, grad.reshape(n, t, width)
