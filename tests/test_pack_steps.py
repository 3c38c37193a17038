"""A pack's steps (engine/train/pack_steps.py) against each trial's lone run through the
trainer's own Stepper: per step the same loss, metric sums and gradient norm, and after
three steps the same adapter, for trials that differ in loss (ORPO, SimPO, SFT), learning
rate and schedule, warm-up, clip (one clipping), weight decay, LoRA rank, scale and dropout.

Tolerance: tests/parity.py's PACK_WEIGHT_RTOL on the weights, ‖w − w_alone‖ ≤ 1e-3 ·
‖w_alone‖ per tensor (the kernels' rounding, carried by AdamW: its comment), and 1e-5
relative on each step's loss and norm (float32; the pack's batched matmuls block their sums
otherwise, and AdamW carries that through 3 steps).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx_lm
import pytest

from engine.backward.distributed import SINGLE
from engine.backward.update import make_adapter_update, make_optimizer, make_update
from engine.data.batch import make_batch
from engine.forward.prefix import split_prefix_batch
from engine.model.arch import make_stack
from engine.model.load import attach_lora, lora_modules
from engine.model.packed_lora import adapter_of, pack_lora
from engine.settings.config import TrainConfig
from engine.train.pack_steps import SHARED, PackStepper, check_pack
from engine.train.prepared import lora_spec
from engine.train.steps import Stepper
from tests.pairs import tokenized_pairs
from tests.parity import assert_pack_weights

pytestmark = pytest.mark.integration
STEPS = 3


def configs(model: Path) -> list[TrainConfig]:
    base = TrainConfig(model=str(model), data="d", steps=STEPS, batch_size=2, grad_accum=2,
                       seed=3, lora_rank=4, lora_scale=2.0, learning_rate=2e-3,
                       warmup_steps=1, val_every=0)
    return [base,
            base.replace(loss="simpo", simpo_beta=2.0, learning_rate=5e-3, lora_rank=8,
                         lr_schedule="constant", grad_clip=0.05, weight_decay=0.1),
            base.replace(loss="sft", lora_scale=1.0, lora_dropout=0.2, warmup_steps=0,
                         min_lr_ratio=0.5)]


def step_batches(model: Path) -> list[list]:
    """Each step's two micro-batches: one in the shared layout (mask), one in two forwards."""
    pairs = tokenized_pairs(model, 4 * STEPS, seed=9)
    return [[split_prefix_batch(pairs[4 * s: 4 * s + 2], "full", attention="mask"),
             make_batch(pairs[4 * s + 2: 4 * s + 4], "full")] for s in range(STEPS)]


def alone(model_path: Path, cfg: TrainConfig, micro: list[list]):
    model, _ = mlx_lm.load(str(model_path))
    attach_lora(model, lora_spec(cfg), cfg.seed)
    model.train()
    stepper = Stepper(model, make_stack(model), cfg.loss_spec(), cfg, SINGLE,
                      make_update(model, make_optimizer(cfg), cfg.grad_clip))
    done = list(stepper.steps(iter(micro).__next__, 1, STEPS))
    weights = {f"{n}.{f}": getattr(m, f) for n, m in lora_modules(model)
               for f in ("lora_a", "lora_b")}
    return done, weights


def pack_steps(model_path: Path, cfgs: list[TrainConfig], micro: list[list]):
    """``cfgs`` trained as one pack over ``micro``'s steps: the model and each step's
    results, one per adapter."""
    check_pack(cfgs)
    model, _ = mlx_lm.load(str(model_path))
    pack_lora(model, [lora_spec(c) for c in cfgs], cfgs[0].seed)
    model.train()
    updates = [make_adapter_update(model, lambda i=i: i, make_optimizer(c), c.grad_clip)
               for i, c in enumerate(cfgs)]
    return model, list(PackStepper(model, make_stack(model), cfgs, updates).steps(
        iter(micro).__next__, 1, STEPS))


def test_each_adapter_of_a_pack_takes_its_lone_steps(tiny_model: Path) -> None:
    """Would catch: one adapter's clip, rate, schedule or optimizer state applied to
    another, a norm over the whole pack, a loss of another kind on a copy, or metric sums
    mixed up between adapters."""
    cfgs, micro = configs(tiny_model), step_batches(tiny_model)
    model, packed = pack_steps(tiny_model, cfgs, micro)
    clipped = 0
    for i, cfg in enumerate(cfgs):
        lone, weights = alone(tiny_model, cfg, micro)
        for got, want in zip([d[i] for d in packed], lone, strict=True):
            assert got.loss == pytest.approx(want.loss, rel=1e-5), (i, got.step)
            assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-5), (i, got.step)
            assert set(got.sums) == set(want.sums)
            for name, v in want.sums.items():
                assert got.sums[name] == pytest.approx(v, rel=1e-5, abs=1e-6), (i, name)
            clipped += i == 1 and want.grad_norm > cfg.grad_clip
            assert got.sums["shared_batches"] == want.sums["shared_batches"] == 1
        assert_pack_weights(adapter_of(model, i), weights, i)
    assert clipped >= 1  # the clip was live for the adapter that sets a small one (1)


def test_a_pack_refuses_trials_that_do_not_share_its_steps(tiny_model: Path) -> None:
    cfgs, model = configs(tiny_model), tiny_model
    assert set(SHARED) <= {f.name for f in dataclasses.fields(TrainConfig)}
    with pytest.raises(ValueError, match="share batch_size"):
        check_pack([cfgs[0], cfgs[1].replace(batch_size=4)])
    with pytest.raises(ValueError, match="share nll_span"):  # one batch's masks for all
        check_pack([cfgs[0], cfgs[1].replace(nll_span="response")])
    dpo = cfgs[0].replace(loss="dpo")
    check_pack([cfgs[0], dpo, dpo.replace(dpo_beta=0.3), cfgs[0].replace(loss="kto")])
    with pytest.raises(ValueError, match="read a reference share reference"):
        check_pack([dpo, dpo.replace(reference=str(model))])
