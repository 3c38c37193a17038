"""ORPO, SimPO and SFT loss maths against independent float64 numpy references (Hong et al.
2024; Meng et al. 2024)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from engine.losses import (
    LossSpec,
    Norms,
    log1mexp,
    orpo_pair_terms,
    pair_loss,
    per_pair_losses,
)

pytestmark = pytest.mark.unit


def np_log1mexp(x: np.ndarray) -> np.ndarray:
    return np.log(-np.expm1(x.astype(np.float64)))


def np_reference(lp, resp, nll_mask, lam, kind):
    """Float64 ORPO (Eq. 6–7) straight from the definitions, no shared code."""
    lp, resp, nll_mask = (a.astype(np.float64) for a in (lp, resp, nll_mask))
    b = lp.shape[0] // 2
    mean = (lp * resp).sum(1) / resp.sum(1)
    lw, lr = mean[:b], mean[b:]
    nll = -(lp * nll_mask).sum() / nll_mask.sum()
    if kind == "sft":
        return nll, lw, lr
    odds_w = np.exp(lw) / (1 - np.exp(lw))
    odds_r = np.exp(lr) / (1 - np.exp(lr))
    ratio = np.log(odds_w / odds_r)
    return nll + lam * np.mean(-np.log(1 / (1 + np.exp(-ratio)))), lw, lr


def np_simpo(lp, resp, nll_mask, beta, gamma, nll_weight):
    """Float64 SimPO (Eq. 6) from its definition: β/|y|·log π(y) over response tokens, the
    margin γ, and CPO's optional NLL term; returns (loss, reward margins β·ℓw − β·ℓr)."""
    lp, resp, nll_mask = (a.astype(np.float64) for a in (lp, resp, nll_mask))
    b = lp.shape[0] // 2
    scaled = beta / resp.sum(1) * (lp * resp).sum(1)  # β/|y| · log π(y)
    margin = scaled[:b] - scaled[b:] - gamma
    pair = np.log1p(np.exp(-margin))  # −log σ(m)
    nll = -(lp * nll_mask).sum() / nll_mask.sum()
    return nll_weight * nll + pair.mean(), scaled[:b] - scaled[b:]


@pytest.mark.parametrize("span", ["full", "response"])
@pytest.mark.parametrize("nll_weight", [0.0, 1.0])
def test_simpo_matches_float64_reference(span: str, nll_weight: float) -> None:
    """Loss within 1e-6 of float64; rewards β·ℓ and accuracies as TRL's CPOTrainer."""
    rng = np.random.default_rng(4)
    lp, resp, nll = _batch(rng, b=5, span=span)
    spec = LossSpec("simpo", nll_span=span, simpo_beta=2.5, simpo_gamma=1.4,
                    simpo_nll_weight=nll_weight)
    loss, metrics = pair_loss(mx.array(lp), mx.array(resp), mx.array(nll), spec,
                              Norms(float(nll.sum()), 5.0))
    want, margins = np_simpo(lp, resp, nll, 2.5, 1.4, nll_weight)
    assert float(loss) == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert float(metrics["rewards/margins"]) / 5 == pytest.approx(margins.mean(), rel=1e-5)
    assert float(metrics["rewards/accuracies"]) / 5 == pytest.approx(np.mean(margins > 0))
    assert "log_odds_ratio" not in metrics  # ORPO's own extras stay ORPO's


def test_per_pair_losses_are_the_batch_loss_one_pair_at_a_time() -> None:
    """Scoring's per-pair loss equals pair_loss on that pair alone, for every loss."""
    rng = np.random.default_rng(6)
    lp, resp, nll = _batch(rng, b=4)
    for spec in (LossSpec("orpo", 0.3), LossSpec("simpo", simpo_nll_weight=0.5),
                 LossSpec("sft")):
        means = (lp * resp).sum(1) / resp.sum(1)
        nll_means = -(lp * nll).sum(1)[:4] / nll.sum(1)[:4]
        got, _ = per_pair_losses(mx.array(means[:4]), mx.array(means[4:]),
                                 mx.array(nll_means), spec)
        for i in range(4):
            rows = [i, 4 + i]
            alone, _ = pair_loss(mx.array(lp[rows]), mx.array(resp[rows]), mx.array(nll[rows]),
                                 spec, Norms(float(nll[rows].sum()), 1.0))
            assert float(got[i]) == pytest.approx(float(alone), rel=1e-5), spec.kind


@pytest.mark.parametrize("x", [-1e-6, -1e-3, -0.1, -0.6931, -0.6932, -1.0, -5.0, -30.0, -80.0])
def test_log1mexp_matches_float64(x: float) -> None:
    got = float(log1mexp(mx.array([x], mx.float32))[0])
    want = float(np_log1mexp(np.array([np.float32(x)]))[0])
    assert got == pytest.approx(want, rel=2e-6, abs=1e-7)


def test_log1mexp_near_zero_is_finite_with_finite_gradient() -> None:
    for x in (0.0, -1e-12, -1e-9):
        val, grad = mx.value_and_grad(lambda v: log1mexp(v).sum())(mx.array([x]))
        assert math.isfinite(float(val[0] if val.ndim else val))
        assert math.isfinite(float(grad[0]))


def _batch(rng, b=3, t=9, span="full"):
    lp = -rng.gamma(2.0, 1.0, size=(2 * b, t)).astype(np.float32)
    resp = np.zeros((2 * b, t), np.float32)
    nll = np.zeros((2 * b, t), np.float32)
    for i in range(2 * b):
        p = int(rng.integers(1, t - 2))
        end = int(rng.integers(p + 1, t + 1))
        resp[i, p:end] = 1
        if i < b:
            nll[i, (0 if span == "full" else p):end] = 1
    return lp, resp, nll


@pytest.mark.parametrize("span", ["full", "response"])
@pytest.mark.parametrize("kind", ["orpo", "sft"])
def test_pair_loss_matches_reference(span: str, kind: str) -> None:
    rng = np.random.default_rng(0)
    lp, resp, nll = _batch(rng, span=span)
    spec = LossSpec(kind, 0.25, span)
    norms = Norms(float(nll.sum()), 3.0)
    loss, metrics = pair_loss(mx.array(lp), mx.array(resp), mx.array(nll), spec, norms)
    want, lw, lr = np_reference(lp, resp, nll, 0.25, kind)
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert float(metrics["logps/chosen"]) / 3 == pytest.approx(lw.mean(), rel=1e-5)
    if kind == "orpo":
        acc = float(metrics["rewards/accuracies"]) / 3
        assert acc == pytest.approx(np.mean(lw > lr))
        assert float(metrics["rewards/margins"]) / 3 == pytest.approx(0.25 * np.mean(lw - lr),
                                                                     rel=1e-4, abs=1e-6)


def test_equal_logps_give_log2_penalty_and_zero_odds() -> None:
    lw = mx.array([-0.7, -3.0, -1e-4])
    log_odds, log_sig = orpo_pair_terms(lw, lw)
    assert np.allclose(np.array(log_odds), 0.0)
    assert np.allclose(np.array(-log_sig), math.log(2), rtol=1e-6)


@pytest.mark.parametrize("lw,lr", [(-1e-5, -2e-5), (-60.0, -70.0), (-0.69, -0.70), (-1e-3, -40.0)])
def test_log_odds_extremes_match_float64(lw: float, lr: float) -> None:
    log_odds, _ = orpo_pair_terms(mx.array([lw]), mx.array([lr]))
    a, b = np.float64(np.float32(lw)), np.float64(np.float32(lr))
    want = (a - b) - (np_log1mexp(np.array([a]))[0] - np_log1mexp(np.array([b]))[0])
    assert float(log_odds[0]) == pytest.approx(want, rel=1e-4, abs=1e-4)


def test_gradient_matches_finite_differences_in_float64() -> None:
    """dL/dℓ through the mx graph vs central differences of the float64 reference."""
    rng = np.random.default_rng(1)
    lp, resp, nll = _batch(rng, b=2, t=6)
    spec, norms = LossSpec("orpo", 0.5, "full"), Norms(float(nll.sum()), 2.0)
    grad = mx.grad(lambda x: pair_loss(x, mx.array(resp), mx.array(nll), spec, norms)[0])(
        mx.array(lp))
    eps = 1e-6
    i, j = np.argwhere(resp > 0)[0]
    up, down = lp.astype(np.float64).copy(), lp.astype(np.float64).copy()
    up[i, j] += eps
    down[i, j] -= eps
    fd = (np_reference(up, resp, nll, 0.5, "orpo")[0]
          - np_reference(down, resp, nll, 0.5, "orpo")[0]) / (2 * eps)
    assert float(grad[i, j]) == pytest.approx(fd, rel=1e-3)


def test_bad_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="nll_span"):
        LossSpec("orpo", 0.1, "prompt")
    with pytest.raises(ValueError, match="kind"):
        LossSpec("dpo")
