"""Blockwise sliding-window attention against mlx-lm's dense windowed mask.

Tolerance: 1e-5 absolute on outputs and on the three input gradients (float32, values of
order 1); the blocks change which keys a softmax sums over only where the mask is False.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask

from engine.attention import windowed_attention

pytestmark = pytest.mark.unit


def sdpa(q, k, v, cache, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@pytest.mark.parametrize(("lq", "lk", "window"), [
    (37, 37, 8), (64, 64, 16), (16, 16, 16), (40, 100, 16), (33, 41, 8), (5, 70, 16),
    (70, 70, 1), (50, 50, 49), (48, 48, 7)])
def test_windowed_equals_dense_mask(lq: int, lk: int, window: int) -> None:
    """Catches a block that misses the window's earliest key, sees one too many, or whose
    key tiles' gradients are not summed over the two blocks that read them."""
    key = mx.random.key(lq * 1000 + lk)
    kq, kk, kv, kc = mx.random.split(key, 4)
    q = mx.random.normal((2, 4, lq, 8), key=kq)
    k = mx.random.normal((2, 2, lk, 8), key=kk)
    v = mx.random.normal((2, 2, lk, 8), key=kv)
    cot = mx.random.normal((2, 4, lq, 8), key=kc)
    dense = create_causal_mask(lq, offset=lk - lq, window_size=window)

    def ours(q, k, v):
        return windowed_attention(sdpa, q, k, v, None, 0.35, window)

    def ref(q, k, v):
        return sdpa(q, k, v, None, 0.35, dense)

    out, grads = mx.vjp(ours, [q, k, v], [cot])
    out_ref, grads_ref = mx.vjp(ref, [q, k, v], [cot])
    assert float(mx.abs(out[0] - out_ref[0]).max()) <= 1e-5
    for g, r in zip(grads, grads_ref, strict=True):
        assert float(mx.abs(g - r).max()) <= 1e-5
