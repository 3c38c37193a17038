"""Blockwise attention (sliding windows; full layers with recompute) against mlx-lm's
dense masks.

Tolerance: 1e-5 absolute on outputs and on the three input gradients (float32, values of
order 1); the blocks change which keys a softmax sums over only where the mask is False.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask

from engine.model import attention
from engine.model.attention import blockwise_attention

pytestmark = pytest.mark.unit


def sdpa(q, k, v, cache, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def inputs(lq: int, lk: int, seed: int, rows: int = 1) -> list[mx.array]:
    """Random q [rows, 4, lq, 8], k and v [rows, 2, lk, 8] (GQA), and a cotangent like q."""
    kq, kk, kv, kc = mx.random.split(mx.random.key(seed), 4)
    return [mx.random.normal((rows, 4, lq, 8), key=kq), mx.random.normal((rows, 2, lk, 8), key=kk),
            mx.random.normal((rows, 2, lk, 8), key=kv), mx.random.normal((rows, 4, lq, 8), key=kc)]


def assert_same_attention(ours, mask, q, k, v, cot) -> None:
    """Output and the three input gradients of ``ours`` equal dense ``sdpa`` under ``mask``
    within 1e-5."""
    out, grads = mx.vjp(ours, [q, k, v], [cot])
    ref, grads_ref = mx.vjp(lambda q, k, v: sdpa(q, k, v, None, 0.35, mask), [q, k, v], [cot])
    assert float(mx.abs(out[0] - ref[0]).max()) <= 1e-5
    for g, r in zip(grads, grads_ref, strict=True):
        assert float(mx.abs(g - r).max()) <= 1e-5


@pytest.mark.parametrize("blocked", [True, False])
@pytest.mark.parametrize(("lq", "lk", "window"), [
    (37, 37, 8), (64, 64, 16), (16, 16, 16), (40, 100, 16), (33, 41, 8), (5, 70, 16),
    (70, 70, 1), (50, 50, 49), (48, 48, 7)])
def test_windowed_equals_dense_mask(lq: int, lk: int, window: int, blocked: bool) -> None:
    """Catches a block that misses the window's earliest key, sees one too many, or whose
    key tiles' gradients are not summed over the two blocks that read them; and, whole
    (scores under the budget), keys trimmed to the windows or a mask offset for queries
    that end the keys."""
    q, k, v, cot = inputs(lq, lk, lq * 1000 + lk, rows=2)
    dense = create_causal_mask(lq, offset=lk - lq, window_size=window)
    with attention.whole_scores(10**9 if blocked else 1):  # a budget of 0 bytes, or 256 MiB
        assert_same_attention(lambda q, k, v: attention.attend(sdpa, q, k, v, None, 0.35,
                                                               window), dense, q, k, v, cot)


@pytest.mark.parametrize(("lq", "lk", "block"), [(37, 37, 8), (64, 64, 16), (20, 50, 8),
                                                (9, 9, 4), (40, 40, 40)])
def test_blocked_full_attention_with_recompute(lq: int, lk: int, block: int) -> None:
    """Wide-head full layers on a GPU: query blocks over every earlier key tile, each
    recomputed in the backward; catches a block that drops the prefix keys."""
    q, k, v, cot = inputs(lq, lk, lq + 7 * lk)
    assert_same_attention(
        lambda q, k, v: blockwise_attention(sdpa, q, k, v, None, 0.35, None, block,
                                            recompute=True),
        "causal", q, k, v, cot)


@pytest.mark.parametrize(("lq", "lk", "window", "block"), [
    (64, 64, 40, 16), (50, 90, 33, 8), (100, 100, 64, 16), (17, 17, 9, 4)])
def test_windows_wider_than_a_block(lq: int, lk: int, window: int, block: int) -> None:
    """A window over several key tiles (Mistral's 4096 in 512-row blocks): catches a block
    that reads only the tile before its own."""
    q, k, v, cot = inputs(lq, lk, lq * 31 + window)
    dense = create_causal_mask(lq, offset=lk - lq, window_size=window)
    for recompute in (False, True):
        assert_same_attention(
            lambda q, k, v, r=recompute: blockwise_attention(sdpa, q, k, v, None, 0.35, window,
                                                             block, recompute=r),
            dense, q, k, v, cot)


@pytest.mark.parametrize("window", [None, 16])
def test_one_call_only_inside_a_segment_and_its_budget(window: int | None, monkeypatch) -> None:
    """One call while [B, H, Lq, Lk] float32 scores fit the segment's share of
    ``WHOLE_SCORES_BYTES`` (a window's keys trimmed to what it reaches); blocks past it, and
    outside a segment, where a graph over every layer would keep every layer's scores."""
    monkeypatch.setattr(attention, "full_block", lambda q: 16)
    calls: list[tuple] = []

    def counting(q, k, v, cache, scale, mask):
        calls.append(k.shape)
        return sdpa(q, k, v, cache, scale, mask)

    q, k, v, _ = inputs(48, 100, 5)  # 48 queries ending 100 keys: 3 blocks of 16
    reach = 100 if window is None else 48 + window - 1  # the keys 16-wide windows reach
    budget = 4 * 48 * reach * 4  # exactly those scores, for one layer
    for limit, layers, expected in ((budget, 1, 1), (budget - 1, 1, None), (2 * budget, 2, 1),
                                    (2 * budget, 3, None), (10**12, None, None)):
        monkeypatch.setattr(attention, "WHOLE_SCORES_BYTES", limit)
        calls.clear()
        if layers is None:  # outside any segment
            mx.eval(attention.attend(counting, q, k, v, None, 0.35, window))
        else:
            with attention.whole_scores(layers):
                mx.eval(attention.attend(counting, q, k, v, None, 0.35, window))
        if expected:
            assert calls == [(1, 2, reach, 8)], (limit, layers, calls)
        else:
            assert len(calls) > 1, (limit, layers, calls)


def test_full_layers_block_only_wide_heads_on_a_gpu() -> None:
    wide, narrow = mx.zeros((1, 1, 4096, 256)), mx.zeros((1, 1, 4096, 128))
    on_gpu = mx.default_device() == mx.gpu
    assert attention.full_block(narrow) == 0
    assert attention.full_block(wide) == (attention.FULL_BLOCK if on_gpu else 0)


def test_recomputed_takes_one_input_or_several() -> None:
    """A one-input piece (an MLP with no LoRA) comes to the vjp as a bare array: iterating
    it as a list of inputs split its rows (a shape error at any chunk size)."""
    from engine.model.recompute import recomputed

    w = mx.random.normal((8, 8), key=mx.random.key(1))
    x = mx.random.normal((1, 5, 8), key=mx.random.key(2))
    one = recomputed(lambda h: mx.tanh(h @ w))
    two = recomputed(lambda h, m: mx.tanh(h @ m))
    g1 = mx.grad(lambda h: one(h).sum())(x)
    g2 = mx.grad(lambda h: two(h, w).sum())(x)
    ref = mx.grad(lambda h: mx.tanh(h @ w).sum())(x)
    assert mx.allclose(g1, ref, atol=1e-6) and mx.allclose(g2, ref, atol=1e-6)
