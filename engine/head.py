"""The LM head: token log-probs, dense or bounded.

Dense: logits [N, T, V] exist at once (the plain path, and the reference).
Bounded (``head_chunk`` c): logits exist only for c tokens at a time, and only for the
tokens that carry loss; the backward is analytic, d log p(y)/d logits = onehot(y) − softmax,
times the incoming cotangent, evaluated chunk by chunk (lazy chunks inside one autograd
graph were measured to stay alive together in MLX, so each chunk is forced).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from engine.model import Stack

LogpLoss = Callable[[mx.array], tuple[mx.array, dict[str, mx.array]]]


def token_logps(logits: mx.array, targets: mx.array) -> mx.array:
    """log p(targets) under ``logits`` [..., V] (float32) → [...]."""
    logits = logits.astype(mx.float32)
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - mx.logsumexp(logits, axis=-1)


def dense_logps(stack: Stack, h: mx.array, targets: mx.array) -> mx.array:
    """Token log-probs from the last hidden state h [N, T, H] with full logits."""
    return token_logps(stack.head(h), targets)


def bounded_head_grad(
    stack: Stack,
    h: mx.array,
    targets: np.ndarray,
    active: np.ndarray,
    loss_of_logps: LogpLoss,
    chunk: int,
) -> tuple[mx.array, dict[str, mx.array], mx.array]:
    """Loss, metrics and dL/dh for h [N, T, H], never holding more than ``chunk`` logits rows.

    ``active`` [N, T] bool marks tokens whose log-prob the loss reads; the others get no
    head work and zero gradient.
    """
    n, t, width = h.shape
    flat_h = h.reshape(n * t, width)
    idx = np.flatnonzero(active.reshape(-1)).astype(np.int32)
    flat_targets = mx.array(targets.reshape(-1)[idx])
    spans = [(s, min(s + chunk, len(idx))) for s in range(0, len(idx), chunk)]

    pieces = []
    for s, e in spans:  # pass 1: log-probs, one chunk of logits alive at a time
        lp = token_logps(stack.head(flat_h[mx.array(idx[s:e])]), flat_targets[s:e])
        mx.eval(lp)
        pieces.append(lp)
    lp_active = mx.concatenate(pieces) if pieces else mx.zeros((0,), mx.float32)
    lp_full = mx.zeros((n * t,), mx.float32).at[mx.array(idx)].add(lp_active).reshape(n, t)

    (loss, metrics), g_full = mx.value_and_grad(loss_of_logps)(lp_full)
    g_active = g_full.reshape(-1)[mx.array(idx)]
    mx.eval(loss, metrics, g_active)

    grad_pieces = []
    for s, e in spans:  # pass 2: analytic softmax − onehot, then back through norm + project
        rows = mx.array(idx[s:e])
        h_c = flat_h[rows]
        logits = stack.head(h_c).astype(mx.float32)
        onehot = mx.arange(logits.shape[-1])[None, :] == flat_targets[s:e][:, None]
        g_logits = g_active[s:e][:, None] * (onehot.astype(mx.float32) - mx.softmax(logits, -1))
        _, (g_h,) = mx.vjp(lambda x: stack.head(x).astype(mx.float32), [h_c], [g_logits])
        mx.eval(g_h)
        grad_pieces.append(g_h)
    grad = mx.zeros_like(flat_h)
    if grad_pieces:
        grad = grad.at[mx.array(idx)].add(mx.concatenate(grad_pieces).astype(h.dtype))
    return loss, metrics, grad.reshape(n, t, width)
