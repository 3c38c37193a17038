"""Loss settings that cannot train (engine/losses): refused when the settings are made, one line
naming the setting, never found steps later as a non-finite loss blamed on the learning rate.

IPO's loss (CPO's and DPO's ``ipo``) is (margin − 1/(2β))²: a tiny β puts the target margin
1/(2β) beyond float32 once squared (β = 1e-30: 2.5e59). CPO's SimPO variant subtracts γ/β
from the margin, which overflows float32 for β below γ/3.4e38.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.losses import Norms, pair_loss, spec_of

pytestmark = pytest.mark.unit


def batch(b: int = 3, t: int = 6) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Token log-probs [2B, T], response and NLL masks, summed reference log-probs [2B]."""
    rng = np.random.default_rng(5)
    lp = -rng.uniform(0.1, 2.0, (2 * b, t)).astype(np.float32)
    resp = np.zeros((2 * b, t), np.float32)
    resp[:, 2:] = 1
    nll = resp.copy()
    nll[b:] = 0
    ref = (lp * resp).sum(-1) + rng.normal(0, 1, 2 * b).astype(np.float32)
    return mx.array(lp), mx.array(resp), mx.array(nll), mx.array(ref)


def loss_and_grad(spec) -> tuple[float, np.ndarray]:
    lp, resp, nll, ref = batch()
    norms = Norms(float(nll.sum()), lp.shape[0] / 2)
    ref = ref if spec.needs_reference else None

    def loss_of(x: mx.array) -> mx.array:
        return pair_loss(x, resp, nll, spec, norms, ref)[0]

    loss, grad = mx.value_and_grad(loss_of)(lp)
    return float(loss), np.array(grad)


@pytest.mark.parametrize("kind", ["cpo", "dpo"])
def test_an_ipo_beta_whose_target_margin_overflows_is_refused_by_name(kind: str) -> None:
    """β = 1e-30 under ipo was accepted and its first step's loss was inf ("lower the
    learning rate"); now the settings refuse it naming {kind}_beta. The smallest β allowed
    still gives a finite loss and gradient, and a tiny β where nothing divides by it (the
    sigmoid loss) is still accepted."""
    name = f"{kind}_beta"
    with pytest.raises(ValueError, match=rf"{name}=1e-30 with loss type ipo"):
        spec_of(kind, **{name: 1e-30, f"{kind}_loss_type": "ipo"})
    loss, grad = loss_and_grad(spec_of(kind, **{name: 1e-6, f"{kind}_loss_type": "ipo"}))
    assert np.isfinite(loss) and np.isfinite(grad).all()
    assert np.isfinite(loss_and_grad(spec_of(kind, **{name: 1e-30}))[0])


def test_a_cpo_simpo_beta_below_gamma_over_float32_max_gives_a_finite_loss() -> None:
    """β·(margin − γ/β) took γ/β = 5e39 to float32 (inf) and the loss was inf; written
    β·margin − γ, as SimPO's Eq. 6 reads, nothing overflows for any β > 0."""
    spec = spec_of("cpo", cpo_loss_type="simpo", cpo_beta=1e-40, cpo_simpo_gamma=0.5)
    loss, grad = loss_and_grad(spec)
    assert np.isfinite(loss) and np.isfinite(grad).all()
