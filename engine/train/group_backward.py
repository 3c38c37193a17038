"""GRPO's update through the segmented backward and the bounded head
(engine/backward/segmented.py): the rows, or the group layout's one row a group, run
``segment_size`` layers at a time, only segment boundaries kept, and the head runs on the
completion tokens alone, at the rollouts' temperature, ``head_chunk`` of them at a time
(never [tokens, vocab] logits for a whole micro-batch). Its loss and LoRA gradients are
the plain update's (``group_objective``; tests/test_group_forward.py).

The head's input is gathered from the last hidden state at each completion token's
predicting position (``predictors``); its cotangent goes back by the gather's vjp, a
scatter-add into the hidden state, which the segments then carry down.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.backward.segmented import HeadGrad, grads_to_tree, staged_value_and_grad
from engine.forward.prefix_patch import layout_masks
from engine.host.inflight import InFlight
from engine.losses.group import GroupLogps
from engine.losses.grpo import Grpo
from engine.model.arch.stack import Stack
from engine.model.head import bounded_head_grad, token_logps
from engine.model.masks import CausalMasks
from engine.settings.config import TrainConfig
from engine.train.group_steps import GroupBatch, group_objective, predictors


def objective_for(model: nn.Module, stack: Stack, loss: Grpo, cfg: TrainConfig
                  ) -> Callable[..., Any]:
    """The update's ``f(batch, batch_tokens, scale) → ((loss, metrics), grads)``: plain
    autograd where ``segment_size`` and ``head_chunk`` are both 0, else the staged one."""
    if cfg.segment_size <= 0 and cfg.head_chunk <= 0:
        return group_objective(model, stack, loss)
    return staged_group_objective(model, stack, loss, cfg.segment_size, cfg.head_chunk,
                                  cfg.inflight)


def group_head(stack: Stack, batch: GroupBatch, loss_of_logps: Callable[..., Any],
               temperature: float, head_chunk: int, inflight: int) -> HeadGrad:
    """The staged backward's head for ``batch``: the completion tokens' hidden states
    gathered, their log-probs at ``temperature`` (dense, or ``head_chunk`` rows at a time)
    and the loss, its cotangent scattered back to the last hidden state."""
    def head(x: mx.array) -> mx.array:
        logits = stack.head(x)
        return logits / temperature if temperature != 1 else logits

    where = predictors(batch)
    targets = np.take_along_axis(np.array(batch.ids), np.array(batch.at) + 1, axis=1)

    def grad(h_last: mx.array, flight: InFlight) -> tuple[mx.array, dict, mx.array]:
        rows, length, width = h_last.shape
        idx = mx.array(where.reshape(-1).astype(np.int32))
        h = h_last.reshape(rows * length, width)[idx].reshape(*where.shape, width)
        if head_chunk <= 0:
            tg = mx.array(targets)
            (loss, metrics), cot = mx.value_and_grad(
                lambda x: loss_of_logps(token_logps(head(x), tg)))(h)
        else:
            loss, metrics, cot = bounded_head_grad(head, h, targets, np.array(batch.mask) > 0,
                                                   loss_of_logps, head_chunk, inflight, flight)
        full = mx.zeros((rows * length, width), h_last.dtype).at[idx].add(
            cot.reshape(-1, width).astype(h_last.dtype))
        flight.push(loss, metrics, full)
        return loss, metrics, full.reshape(rows, length, width)

    return grad


def staged_group_objective(model: nn.Module, stack: Stack, loss: Grpo, segment_size: int,
                           head_chunk: int, inflight: int = 2) -> Callable[..., Any]:
    """``group_objective``'s function, its gradient taken segment by segment."""
    def objective(batch: GroupBatch, batch_tokens: float, scale: float
                  ) -> tuple[tuple[mx.array, dict[str, mx.array]], dict]:
        def loss_of_logps(logps: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
            terms = loss.group_terms(GroupLogps(logps, batch.mask, batch.advantages,
                                                batch.old, batch.ref),
                                     loss.max_completion_length, batch_tokens)
            return terms.loss * scale, terms.metrics

        layout = batch.layout
        tokens = mx.array(layout.inputs) if layout is not None else batch.ids[:, :-1]
        head = group_head(stack, batch, loss_of_logps, loss.temperature, head_chunk, inflight)
        with layout_masks(model, layout) if layout is not None else nullcontext(
                CausalMasks()) as masks:
            value, metrics, grads = staged_value_and_grad(stack, tokens, masks, head,
                                                          segment_size, inflight)
            mx.eval(value, metrics, grads)  # every vjp recomputed under the layout's ropes
        return (value, metrics), grads_to_tree(grads)

    return objective
