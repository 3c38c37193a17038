"""The optimizer and its update: AdamW (bias-corrected by default, as torch/TRL) on a linear
warmup then cosine (or constant) schedule, and global-norm clipping plus one AdamW step
compiled into ONE function over the trainable arrays alone, queued without a wait."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from engine.backward.segmented import Grads, grads_to_tree
from engine.settings.config import TrainConfig


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
    compiled = mx.compile(clip_and_step(optimizer, clip), inputs=optimizer.state,
                          outputs=optimizer.state)

    def update(grads: Grads) -> mx.array:
        tree = grads_tree.fill(grads) if grads.keys() == grads_tree.paths.keys() else (
            grads_to_tree(grads))  # grads for a subset: the tree they name
        norm, new = compiled(tree, params.fill(params.read(model)))
        params.write(model, new, grads)
        mx.async_eval(norm, optimizer.state, new)
        return norm

    return update


def clip_and_step(optimizer: optim.AdamW, clip: float
                  ) -> Callable[[dict, dict], tuple[mx.array, dict]]:
    """``step(grads, params) → (norm, new params)``: the global norm clipped to ``clip``
    (0: not clipped), then one AdamW step: what a lone run and each adapter of a pack run."""
    def step(tree: dict, current: dict) -> tuple[mx.array, dict]:
        clipped, norm = optim.clip_grad_norm(tree, clip if clip > 0 else float("inf"))
        return norm, optimizer.apply_gradients(clipped if clip > 0 else tree, current)

    return step


def make_adapter_update(model: nn.Module, at: Callable[[], int], optimizer: optim.AdamW,
                        clip: float) -> Callable[[Grads], mx.array]:
    """``update(grads) → norm`` for one adapter of a pack (engine/model/packed_lora.py),
    the one at position ``at()`` (a trial that leaves the pack moves the ones after it):
    its grads, named as a lone adapter's, clipped by their own norm and stepped by its own
    optimizer (its learning rate and schedule), as ``make_update`` steps a lone run."""
    from engine.model.packed_lora import adapter_of, packed_layers, set_adapter

    layers = packed_layers(model)  # once: a step reads and writes them, walks no modules
    optimizer.init(tree_unflatten(list(adapter_of(layers, at()).items())))
    compiled = mx.compile(clip_and_step(optimizer, clip), inputs=optimizer.state,
                          outputs=optimizer.state)

    def update(grads: Grads) -> mx.array:
        # The grads' tree in their own order: filled in the layers' order instead, the
        # DPO pack left its lone run's weights by 3.5e-5 relative (tests/test_pack_trainer.py)
        where = at()
        current = tree_unflatten(list(adapter_of(layers, where).items()))
        norm, new = compiled(grads_to_tree(grads), current)
        flat = dict(tree_flatten(new))
        set_adapter(layers, where, flat)
        mx.async_eval(norm, optimizer.state, list(flat.values()))
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
