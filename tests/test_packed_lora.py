"""A pack of adapters over one base (engine/model/packed_lora.py) against each adapter
trained alone: the same loss, metrics and LoRA gradients, through plain autograd, the
segmented backward and the bounded head, in the two-forward and both shared layouts, with
ranks, scales and dropout that differ.

Tolerance (tests/parity.py): max |g − g_alone| ≤ 1e-5 · max |g_alone| per tensor, loss to
1e-6 relative (float32: a pack's batched matmuls block their sums otherwise than one
adapter's matmul; nothing else differs).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from engine.backward.segmented import value_and_grad
from engine.data.batch import make_batch
from engine.forward.prefix import pair_batch, repeat_layout, split_prefix_batch
from engine.losses import spec_of
from engine.model.arch import make_stack
from engine.model.load import LoraSpec, attach_lora, lora_modules, set_dropout_seed
from engine.model.packed_lora import PackedLoRALinear, adapter_of, pack_lora
from tests.pairs import tokenized_pairs
from tests.parity import assert_same, batch_loss

pytestmark = pytest.mark.integration

SPECS = [LoraSpec(rank=4, scale=2.0), LoraSpec(rank=8, scale=0.5),
         LoraSpec(rank=4, scale=1.0, dropout=0.3)]
SEED = 3


def drawn_b(i: int, shapes: list[tuple[int, int]]) -> list[mx.array]:
    """Adapter ``i``'s B, drawn non-zero (so A gets gradients too), the same alone or packed."""
    rng = np.random.default_rng(100 + i)
    return [mx.array(rng.normal(0, 0.05, s).astype(np.float32)) for s in shapes]


def alone(path: Path, i: int):
    """The tiny model with adapter ``i`` attached as a lone trial's is."""
    model, _ = mlx_lm.load(str(path))
    attach_lora(model, SPECS[i], SEED)
    modules = [m for _, m in lora_modules(model)]
    for m, b in zip(modules, drawn_b(i, [m.lora_b.shape for m in modules]), strict=True):
        m.lora_b = b
    return model, make_stack(model)


def packed(path: Path):
    model, _ = mlx_lm.load(str(path))
    pack_lora(model, SPECS, SEED)
    layers = [m for _, m in model.named_modules() if isinstance(m, PackedLoRALinear)]
    for i in range(len(SPECS)):
        for m, b in zip(layers, drawn_b(i, [m.lora_b[i].shape for m in layers]), strict=True):
            m.lora_b[i] = b
    return model, make_stack(model)


def pack_loss(model, stack, batch, spec, k: int):
    """The pack's loss: the sum of each copy's own loss; its metrics, each copy's apart."""
    one = batch_loss(model, stack, batch, spec)

    def loss(lp: mx.array):
        parts = [one(part) for part in mx.split(lp, k)]
        metrics = {f"{i}/{n}": v for i, (_, m) in enumerate(parts) for n, v in m.items()}
        return sum(p[0] for p in parts), {**metrics, "losses": mx.stack([p[0] for p in parts])}

    return loss


def layout(pairs: list, kind: str):
    """The pairs in the two-forward layout, or the shared one (split attention or mask)."""
    if kind == "two":
        return make_batch(pairs, "full")
    return split_prefix_batch(pairs, "full", attention=kind)


@pytest.mark.parametrize("segment_size, head_chunk, kind", [
    (0, 0, "two"), (2, 0, "two"), (1, 16, "two"), (0, 0, "mask"), (1, 16, "mask"),
    (0, 0, "split"), (2, 0, "split"), (1, 16, "split")])
def test_each_adapter_of_a_pack_trains_as_it_would_alone(tiny_model: Path, segment_size: int,
                                                        head_chunk: int, kind: str) -> None:
    """Would catch: copies mixed up (a reshape over the wrong axis, a shared layout's
    gather reading another copy's rows), a rank's padding that leaks, a scale or dropout
    mask of another adapter, or one adapter's gradient reaching another's parameters."""
    spec = spec_of("orpo")
    batch = layout(tokenized_pairs(tiny_model, 3, seed=5), kind)
    model, stack = packed(tiny_model)
    model.train()  # dropout live (adapter 2's)
    set_dropout_seed(model, 11)
    k = len(SPECS)
    two = pair_batch(batch)
    loss, metrics, grads = value_and_grad(
        model, stack, repeat_layout(batch, k), pack_loss(model, stack, two, spec, k),
        segment_size, head_chunk, inflight=1)
    for i in range(k):
        lone, lone_stack = alone(tiny_model, i)
        lone.train()
        set_dropout_seed(lone, 11)
        want = value_and_grad(lone, lone_stack, batch, batch_loss(lone, lone_stack, two, spec),
                              segment_size, head_chunk, inflight=1)
        mine = {n.removesuffix(f".{i}"): g for n, g in grads.items() if n.endswith(f".{i}")}
        got = (metrics["losses"][i], {n.split("/", 1)[1]: v for n, v in metrics.items()
                                      if n.startswith(f"{i}/")}, mine)
        assert_same(got, want)
    assert float(loss) == pytest.approx(float(metrics["losses"].sum()), rel=1e-6)
    model.eval()  # adapter 2's dropout was live: without it only its loss moves
    still = value_and_grad(model, stack, repeat_layout(batch, k),
                           pack_loss(model, stack, two, spec, k), segment_size, head_chunk,
                           inflight=1)[1]["losses"]
    moved = [float(a) != pytest.approx(float(b), rel=1e-6)
             for a, b in zip(still, metrics["losses"], strict=True)]
    assert moved == [False, False, True]


def test_a_packed_adapter_saves_as_a_lone_one(tiny_model: Path) -> None:
    """Adapter i's weights carry a lone adapter's names and shapes (its own rank), the
    first draws equal to a lone trial's of the same seed. Would catch: the padded factors
    saved, or another adapter's draw."""
    model, _ = mlx_lm.load(str(tiny_model))
    pack_lora(model, SPECS, SEED)
    for i, spec in enumerate(SPECS):
        lone, _ = mlx_lm.load(str(tiny_model))
        attach_lora(lone, spec, SEED)
        want = {f"{n}.{f}": getattr(m, f) for n, m in lora_modules(lone)
                for f in ("lora_a", "lora_b")}
        got = adapter_of(model, i)
        assert set(got) == set(want)
        for name, w in want.items():  # lora_a drawn alike, lora_b zero at its own rank
            assert got[name].shape == w.shape and mx.array_equal(got[name], w), name


def test_a_pack_refuses_adapters_of_other_projections(tiny_model: Path) -> None:
    model, _ = mlx_lm.load(str(tiny_model))
    with pytest.raises(ValueError, match="one set of projections"):
        pack_lora(model, [LoraSpec(), LoraSpec(num_layers=1)], SEED)
