"""`pomona bench train --pack`: the same trials alone and as one pack, and ``--pack auto``'s
probe and pick, through the real pack trainer."""

from __future__ import annotations

import gc
import itertools
import json

import mlx.core as mx
import pytest

pytestmark = pytest.mark.integration

PACK_SHAPE = ["--seq", "48", "--pairs", "2", "--layers", "2", "--hidden", "64", "--heads",
              "4", "--kv-heads", "2", "--intermediate", "128", "--vocab", "512", "--dtype",
              "float32", "--warmup", "1", "--steps", "2", "--head-chunk", "32"]


@pytest.fixture
def packs(monkeypatch) -> list[int]:
    """The size of each pack ``train_pack`` trains, as it trains it."""
    from engine.train import pack_trainer

    sizes: list[int] = []
    real = pack_trainer.train_pack
    monkeypatch.setattr(pack_trainer, "train_pack",
                        lambda cfgs, *a, **k: sizes.append(len(cfgs)) or real(cfgs, *a, **k))
    return sizes


def test_train_bench_packs_the_same_trials(tmp_path, capsys, packs) -> None:
    """`pomona bench train --pack 1,2`: the same two trials alone and as one pack, each
    size's wall time and steady tokens/s (every adapter's) side by side, and the ratio;
    each trial really trained, in its own folder, the pack row as one pack. A bad size is
    one line."""
    from benchmarks.train_bench import main

    args = [*PACK_SHAPE, "--work", str(tmp_path)]
    assert main([*args, "--pack", "1,2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["pack"], r["trials"]) for r in out["rows"]] == [(1, 2), (2, 2)]
    assert all(r["wall_s"] > 0 and r["tokens_per_s"] > 0 for r in out["rows"])
    assert out["ratios"]["pack2_vs_alone"] == pytest.approx(
        out["rows"][1]["wall_s"] / out["rows"][0]["wall_s"])
    for size in (1, 2):
        for trial in ("t0", "t1"):
            assert (tmp_path / f"pack{size}" / trial / "adapters.safetensors").exists()
    assert packs == [2]  # the pack row trained its two trials as one pack
    # each packed trial against itself alone: float32 on CPU, the pack's parity (1e-5)
    assert "adapter_rel_diff" not in out["rows"][0]
    assert out["rows"][1]["adapter_rel_diff"] <= 1e-5, out["rows"][1]
    assert out["rows"][1]["loss_rel_diff"] <= 1e-5, out["rows"][1]
    assert main([*args, "--pack", "0,2"]) == 2
    assert "--pack 0,2: sizes are at least 1" in capsys.readouterr().err


def _garbage_cycle(array: mx.array) -> None:
    """Leave ``array`` held only by a reference cycle: alive until the collector runs."""
    mx.eval(array)
    holder: dict = {"array": array}
    holder["self"] = holder


def test_train_bench_pack_auto_trains_the_probes_pick(tmp_path, capsys, packs) -> None:
    """`pomona bench train --pack auto --memory-limit-gb G`: the probe's rows (peaks
    growing with the pack), its pick within G, and that pack trained as one. Without a
    limit: one line. Would catch: a pick the probe did not measure, the pick not trained,
    or an earlier test's arrays left in a reference cycle counted in the first pack's peak
    (the flake CI met: a pack of one above a pack of two)."""
    from benchmarks.train_bench import main

    args = [*PACK_SHAPE, "--work", str(tmp_path), "--pack", "auto"]
    assert main(args) == 2
    assert "--pack auto: give --memory-limit-gb" in capsys.readouterr().err
    gc.disable()  # the garbage stays until the probe itself collects
    try:
        _garbage_cycle(mx.zeros((1 << 20,), mx.float32))  # 4 MiB, above a step of the pack
        assert main([*args, "--memory-limit-gb", "100", "--json"]) == 0
    finally:
        gc.enable()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    peaks = [r["peak_gb"] for r in out["probe"]]
    assert len(peaks) == 8 and all(a < b for a, b in itertools.pairwise(peaks))
    assert out["pick"] == 8 and packs == [8] and out["trained"]["peak_gib"] > 0
