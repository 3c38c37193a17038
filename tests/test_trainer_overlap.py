"""The trainer's overlap (next step's batches built on a thread, the update compiled and
evaluated with its gradient norm in one barrier) changes no number: metrics and adapter equal the
synchronous loop's, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import pytest

from engine.backward.segmented import grads_to_tree
from engine.settings.config import TrainConfig
from engine.train import steps, trainer

pytestmark = pytest.mark.integration
TIMING = {"tokens_per_sec", "peak_memory_gb"}


class SyncPrefetch:
    """The old loop: each step's batches built when the step starts, on this thread."""

    def __init__(self, make, steps, ahead=True):
        self.make = make

    def next(self):
        return self.make()


def sync_update(model, optimizer, clip):
    """The old update, uncompiled: the norm read on the host before the update is built."""

    def update(grads):
        tree = grads_to_tree(grads)
        if clip > 0:
            tree, norm = optim.clip_grad_norm(tree, clip)
        else:
            _, norm = optim.clip_grad_norm(tree, float("inf"))
        value = float(norm)
        optimizer.update(model, tree)
        mx.eval(model.trainable_parameters(), optimizer.state)
        return value

    return update


def run(cfg: TrainConfig) -> tuple[list[dict], bytes]:
    trainer.train(cfg)
    out = Path(cfg.out)
    rows = [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, (out / "adapters.safetensors").read_bytes()


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_overlapped_loop_equals_the_synchronous_one(tiny_model: Path, tiny_data: Path,
                                                    tmp_path: Path, monkeypatch,
                                                    clip: float) -> None:
    """Catches a prefetch that skips, repeats or reorders a batch, and an update that
    clips differently (or not at all) once the norm is no longer read first or once it
    is compiled (a schedule frozen at its first step, a state compile does not write)."""
    cfg = TrainConfig(model=str(tiny_model), data=str(tiny_data), steps=7, batch_size=4,
                      grad_accum=2, segment_size=2, head_chunk=16, report_every=2,
                      val_every=3, learning_rate=1e-3, grad_clip=clip, lora_dropout=0.1)
    fast = run(cfg.replace(out=str(tmp_path / "fast")))
    monkeypatch.setattr(steps, "Prefetch", SyncPrefetch)
    monkeypatch.setattr(trainer, "make_update", sync_update)
    slow = run(cfg.replace(out=str(tmp_path / "slow")))
    assert fast[0] == slow[0] and len(fast[0]) > 4
    assert fast[1] == slow[1]
