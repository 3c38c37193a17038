"""Issue 56's parity on every family: a pack of two trials (ORPO and CPO: the one loss the
llama pack tests leave out) on each supported architecture's tiny model, with its hard
features on (sliding windows, shared K/V, PLE, MoE), takes each trial's lone steps.

Tolerance, float32, after three steps: 1e-5 relative on each step's loss and gradient
norm, and tests/parity.py's PACK_WEIGHT_RTOL on each adapter tensor, ‖w − w_alone‖ ≤ 1e-3 ·
‖w_alone‖. On the auto-detected OpenBLAS kernel single elements stayed within 8.7e-6 of
their tensor's largest (gemma4) and Gemma 4 MoE's, whose expert dispatch sums a pack's
stacked tokens in another order, within 8.9e-5; on the Haswell kernels this workplace sets,
AdamW carrying the rounding where a gradient is near zero, up to 1.3e-3 (parity.py says
why), so the tensors are compared in norm.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.data.batch import make_batch
from engine.model.packed_lora import adapter_of
from engine.settings.config import TrainConfig
from tasks.models.model_factory import init_model
from tests.family_specs import MOE, SPECS, family_pairs
from tests.parity import assert_pack_weights
from tests.test_pack_steps import STEPS, alone, pack_steps

pytestmark = pytest.mark.integration
FAMILIES = {**SPECS, **MOE}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_pack_takes_each_trials_lone_steps_on_every_family(family: str,
                                                             tmp_path: Path) -> None:
    path = init_model(FAMILIES[family], tmp_path / family)
    base = TrainConfig(model=str(path), data="d", steps=STEPS, batch_size=2, grad_accum=2,
                       seed=3, lora_rank=4, learning_rate=2e-3, warmup_steps=1, val_every=0)
    cfgs = [base, base.replace(loss="cpo", cpo_alpha=0.5, lora_rank=8, learning_rate=4e-3)]
    pairs = family_pairs(4 * STEPS, seed=5)
    micro = [[make_batch(pairs[4 * s + 2 * m: 4 * s + 2 * m + 2], "full") for m in (0, 1)]
             for s in range(STEPS)]
    model, packed = pack_steps(path, cfgs, micro)
    for i, cfg in enumerate(cfgs):
        lone, weights = alone(path, cfg, micro)
        for got, want in zip([d[i] for d in packed], lone, strict=True):
            assert got.loss == pytest.approx(want.loss, rel=1e-5), (family, i, got.step)
            assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-5), (family, i)
        assert_pack_weights(adapter_of(model, i), weights, (family, i))
