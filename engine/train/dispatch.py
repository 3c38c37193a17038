"""Which trainer a run's loss takes (``python -m engine train``, a sweep's trial): a group
loss samples its groups (engine/train/grpo_trainer.py), a pair loss with ``pairs: online``
samples its pairs (engine/train/online_pairs.py), a pair loss reads its pairs
(engine/train/trainer.py)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.losses.sampled import samples_now
from engine.settings.config import TrainConfig
from engine.train import grpo_trainer, online_pairs, trainer
from engine.train.run_books import Callback
from engine.train.run_parts import TrainResult


def train_any(cfg: TrainConfig, callbacks: Sequence[Callback] = ()) -> TrainResult:
    """``cfg``'s run by the trainer its loss takes."""
    # each looked up when called: one patched where it lives is the one run
    if cfg.loss.on_groups:
        return grpo_trainer.train_groups(cfg, callbacks)
    if samples_now(cfg.loss):
        return online_pairs.train_online(cfg, callbacks)
    return trainer.train(cfg, callbacks)
