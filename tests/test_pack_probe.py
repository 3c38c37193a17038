"""The pack probe (engine/train/pack_probe.py): packs of 1, 2, 3 trials measured as they
train, in one process, up from one and no further than the budget allows."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.settings.config import TrainConfig
from engine.train.pack_probe import largest_pack, probe_packs

pytestmark = pytest.mark.integration


def _pack(model: Path, data: Path) -> list[TrainConfig]:
    """Three trials that pack: ORPO, DPO (a reference's placeholders) and KTO (KL partners
    too), ranks 8, 4, 4."""
    base = TrainConfig(model=str(model), data=str(data), steps=2, batch_size=4, lora_rank=4,
                       val_every=0, out="unused")
    return [base.replace(lora_rank=8), base.replace(loss="dpo", out="unused-2"),
            base.replace(loss="kto", out="unused-3")]


def test_probed_peaks_grow_with_the_pack_and_stop_at_the_budget(tiny_model: Path,
                                                                 tiny_data: Path) -> None:
    """Would catch: every size measured as one adapter (no growth), a pack past the budget
    loaded anyway (under that budget as MLX's limit: the live set goes over it)."""
    cfgs = _pack(tiny_model, tiny_data)
    rows = probe_packs(cfgs)
    assert [r["pack"] for r in rows] == [1, 2, 3] and not any("error" in r for r in rows)
    peaks = [r["peak_gb"] for r in rows]
    assert peaks[0] < peaks[1] < peaks[2], peaks
    assert all(r["tokens"] > 0 and r["step_s"] > 0 for r in rows)
    budget = (peaks[0] + peaks[1]) / 2  # a pack of one fits, not two
    stopped = probe_packs([c.replace(memory_limit_gb=budget) for c in cfgs], budget)
    assert [r["pack"] for r in stopped] == [1, 2]  # the first over the budget, then no more
    assert largest_pack(stopped, budget) == 1
    assert largest_pack(rows, peaks[2]) == 3
    assert largest_pack(rows, peaks[0] * 0.99) == 0  # one alone is over it
