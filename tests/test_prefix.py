"""Prefix-shared forward vs two forwards: same loss, same LoRA gradients.

Tolerance as tests/test_segmented.py: max |g − g_ref| ≤ 1e-5 · max |g_ref| per tensor
(float32); the shared path changes which positions attention sums over, never the values.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.batch import Pair, batch_norms, make_batch
from engine.losses import LossSpec, pair_loss
from engine.prefix import split_prefix_batch
from engine.segmented import value_and_grad
from tests.pairs import tokenized_pairs
from tests.test_segmented import assert_same, lora_model

pytestmark = pytest.mark.integration


def run(model, stack, batch, pairs_batch, spec, k=0, chunk=0):
    norms = batch_norms([pairs_batch])
    resp, nll = mx.array(pairs_batch.resp_mask), mx.array(pairs_batch.nll_mask)
    return value_and_grad(model, stack, batch, lambda lp: pair_loss(lp, resp, nll, spec, norms),
                          k, chunk)


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_q4"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("span", ["full", "response"])
def test_shared_equals_two_forwards(fixture: str, n: int, span: str, request) -> None:
    path = request.getfixturevalue(fixture)
    model, stack = lora_model(path)
    pairs = tokenized_pairs(path, n, seed=5 + n)  # ragged prompts and responses
    two = make_batch(pairs, span)
    shared = split_prefix_batch(pairs, span)
    assert shared is not None and shared.fed < two.tokens
    spec = LossSpec("orpo", 0.3, span)
    ref = run(model, stack, two, two, spec)
    for k, chunk in ((0, 0), (0, 16), (1, 0), (1, 16), (2, 0), (2, 16)):
        assert_same(run(model, stack, shared, shared.pairs, spec, k, chunk), ref)


def test_rope_positions_and_mask_really_matter(tiny_model: Path) -> None:
    """Guard against a vacuous pass: a wrong layout must change the loss."""
    model, stack = lora_model(tiny_model)
    pairs = tokenized_pairs(tiny_model, 2, seed=9)
    two = make_batch(pairs, "full")
    shared = split_prefix_batch(pairs, "full")
    spec = LossSpec()
    ref_result = run(model, stack, two, two, spec)
    ref = float(ref_result[0])
    leaky = shared.mask.copy()
    leaky[:, 0] = np.tril(np.ones(leaky.shape[-2:], bool))  # rejected may see chosen
    broken = type(shared)(shared.pairs, shared.inputs, leaky, shared.rejected, shared.shift,
                          shared.gather, shared.fed)
    assert float(run(model, stack, broken, broken.pairs, spec)[0]) != pytest.approx(ref,
                                                                                    rel=1e-5)
    unshifted = type(shared)(shared.pairs, shared.inputs, shared.mask, shared.rejected,
                             np.zeros_like(shared.shift), shared.gather, shared.fed)
    # A random tiny model attends almost uniformly, so positions barely move the loss;
    # the parity tolerance (tests/test_segmented.py) still catches the difference.
    with pytest.raises(AssertionError):
        assert_same(run(model, stack, unshifted, unshifted.pairs, spec), ref_result)


@pytest.mark.unit
def test_mismatched_prompts_fall_back() -> None:
    pairs = [Pair("a", [1, 2], [3], [4]), Pair("b", [1, 5], [6], [7])]
    assert split_prefix_batch(pairs, prompts=[([1, 2], [1, 2]), ([1, 5], [1, 5])]) is not None
    assert split_prefix_batch(pairs, prompts=[([1, 2], [1, 2]), ([1, 5], [1, 9])]) is None


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_qwen2"])
@pytest.mark.parametrize("pad", [1, 16])
def test_split_attention_equals_two_forwards(fixture: str, pad: int, request) -> None:
    """Two fused causal calls per layer (one row) give the two-forward loss and grads."""
    path = request.getfixturevalue(fixture)
    model, stack = lora_model(path)
    pairs = tokenized_pairs(path, 1, seed=11)
    two = make_batch(pairs, "full")
    spec = LossSpec()
    ref = run(model, stack, two, two, spec)
    shared = split_prefix_batch(pairs, "full", pad_multiple=pad, attention="split")
    for k, chunk in ((0, 0), (1, 16), (2, 0)):
        assert_same(run(model, stack, shared, shared.pairs, spec, k, chunk), ref)
    assert shared.mask is None  # split attention never builds the [L, L] array
    masked = split_prefix_batch(pairs, "full", pad_multiple=pad, attention="mask")
    assert masked.mask is not None
    assert_same(run(model, stack, masked, masked.pairs, spec), ref)
    with pytest.raises(ValueError, match="one-row"):
        bad = split_prefix_batch(tokenized_pairs(path, 2, seed=1), attention="split")
        run(model, stack, bad, bad.pairs, spec)


def test_cuda_never_takes_split_attention(monkeypatch) -> None:
    """Split attention's shapes crashed MLX's CUDA attention backward: mask there, or refuse."""
    from engine import trainer

    assert trainer.resolve_prefix_attention("split") == "split"  # CPU: as asked
    monkeypatch.setattr(trainer, "_is_cuda", lambda: True)
    assert trainer.resolve_prefix_attention("auto") == "mask"
    assert trainer.resolve_prefix_attention("mask") == "mask"
    with pytest.raises(ValueError, match="prefix_attention=split is not safe on CUDA"):
        trainer.resolve_prefix_attention("split")
