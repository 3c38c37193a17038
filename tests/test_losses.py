"""ORPO, SimPO, DPO/IPO and SFT loss maths against independent float64 numpy references
(Hong et al. 2024; Meng et al. 2024; Rafailov et al. 2023; Azar et al. 2023)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from engine.losses import (
    Norms,
    log1mexp,
    orpo_pair_terms,
    pair_logps,
    pair_loss,
    per_pair_losses,
    spec_of,
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
    spec = spec_of("simpo", nll_span=span, simpo_beta=2.5, simpo_gamma=1.4,
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
    ref = (lp * resp).sum(1) + rng.normal(0, 1, 8).astype(np.float32)
    for spec in (spec_of("orpo", orpo_lambda=0.3), spec_of("simpo", simpo_nll_weight=0.5),
                 spec_of("sft"), spec_of("dpo", rpo_alpha=0.5),
                 spec_of("dpo", dpo_loss_type="ipo")):
        nll_means = -(lp * nll).sum(1)[:4] / nll.sum(1)[:4]
        got, _ = per_pair_losses(pair_logps(mx.array(lp), mx.array(resp), mx.array(ref)),
                                 mx.array(nll_means), spec)
        for i in range(4):
            rows = [i, 4 + i]
            alone, _ = pair_loss(mx.array(lp[rows]), mx.array(resp[rows]), mx.array(nll[rows]),
                                 spec, Norms(float(nll[rows].sum()), 1.0), mx.array(ref[rows]))
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
    spec = spec_of(kind, span, **({"orpo_lambda": 0.25} if kind == "orpo" else {}))
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
    spec, norms = spec_of("orpo", "full", orpo_lambda=0.5), Norms(float(nll.sum()), 2.0)
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
        spec_of("orpo", "prompt", orpo_lambda=0.1)
    with pytest.raises(ValueError, match="loss='nonesuch'"):
        spec_of("nonesuch")


def np_dpo(lp, resp, nll_mask, ref, beta, smoothing=0.0, kind="sigmoid", rpo_alpha=0.0):
    """Float64 DPO (Rafailov et al. Eq. 7; cDPO's label smoothing) and IPO (Azar et al.
    Eq. 17) from their definitions: summed response log-probs (IPO: per-token means, as
    TRL), the reference's likewise; returns (loss, chosen rewards, rejected rewards)."""
    lp, resp, nll_mask, ref = (a.astype(np.float64) for a in (lp, resp, nll_mask, ref))
    b = lp.shape[0] // 2
    policy = (lp * resp).sum(1)
    if kind == "ipo":
        policy, ref = policy / resp.sum(1), ref / resp.sum(1)
    ratio_w, ratio_r = policy[:b] - ref[:b], policy[b:] - ref[b:]
    z = ratio_w - ratio_r
    if kind == "ipo":
        pair = (z - 1 / (2 * beta)) ** 2
    else:
        pair = (1 - smoothing) * np.log1p(np.exp(-beta * z)) + smoothing * np.log1p(
            np.exp(beta * z))
    nll = -(lp * nll_mask).sum() / nll_mask.sum()
    return pair.mean() + rpo_alpha * nll, beta * ratio_w, beta * ratio_r


@pytest.mark.parametrize("kind,smoothing,rpo", [("sigmoid", 0.0, 0.0), ("sigmoid", 0.2, 0.0),
                                                ("sigmoid", 0.0, 0.7), ("ipo", 0.0, 0.0)])
def test_dpo_matches_float64_reference(kind: str, smoothing: float, rpo: float) -> None:
    """DPO's loss within 1e-5 of float64, its rewards β·(S − R), accuracies and margins
    as TRL's DPOTrainer logs them, logps/* its summed (IPO: averaged) log-probs, and
    logps/accuracies the mean-log-prob preference every loss reports."""
    rng = np.random.default_rng(8)
    lp, resp, nll = _batch(rng, b=5, span="response")
    ref = (lp * resp).sum(1) + rng.normal(0, 2, 10).astype(np.float32)
    spec = spec_of("dpo", nll_span="response", dpo_beta=0.3, dpo_label_smoothing=smoothing,
                    dpo_loss_type=kind, rpo_alpha=rpo)
    loss, metrics = pair_loss(mx.array(lp), mx.array(resp), mx.array(nll), spec,
                              Norms(float(nll.sum()), 5.0), mx.array(ref))
    want, chosen, rejected = np_dpo(lp, resp, nll, ref, 0.3, smoothing, kind, rpo)
    assert float(loss) == pytest.approx(want, rel=1e-5)
    mean = {k: float(v) / 5 for k, v in metrics.items()}
    assert mean["rewards/chosen"] == pytest.approx(chosen.mean(), rel=1e-5, abs=1e-6)
    assert mean["rewards/rejected"] == pytest.approx(rejected.mean(), rel=1e-5, abs=1e-6)
    assert mean["rewards/margins"] == pytest.approx((chosen - rejected).mean(), rel=1e-4,
                                                    abs=1e-6)
    assert mean["rewards/accuracies"] == pytest.approx(np.mean(chosen > rejected))
    sums = (lp.astype(np.float64) * resp).sum(1)
    logps = sums / resp.sum(1) if kind == "ipo" else sums
    assert mean["logps/chosen"] == pytest.approx(logps[:5].mean(), rel=1e-5)
    means = sums / resp.sum(1)
    assert mean["logps/accuracies"] == pytest.approx(np.mean(means[:5] > means[5:]))


def test_dpo_gradient_matches_finite_differences_in_float64() -> None:
    """dL/d log π through the mx graph vs central differences of the float64 DPO."""
    rng = np.random.default_rng(9)
    lp, resp, nll = _batch(rng, b=2, t=6)
    ref = (lp * resp).sum(1) + rng.normal(0, 1, 4).astype(np.float32)
    spec, norms = spec_of("dpo", dpo_beta=0.5, rpo_alpha=0.3), Norms(float(nll.sum()), 2.0)
    grad = mx.grad(lambda x: pair_loss(x, mx.array(resp), mx.array(nll), spec, norms,
                                       mx.array(ref))[0])(mx.array(lp))
    eps = 1e-6
    for i, j in np.argwhere(resp > 0)[:4]:
        up, down = lp.astype(np.float64).copy(), lp.astype(np.float64).copy()
        up[i, j] += eps
        down[i, j] -= eps
        fd = (np_dpo(up, resp, nll, ref, 0.5, rpo_alpha=0.3)[0]
              - np_dpo(down, resp, nll, ref, 0.5, rpo_alpha=0.3)[0]) / (2 * eps)
        assert float(grad[i, j]) == pytest.approx(fd, rel=1e-3, abs=1e-6)


def test_dpo_without_a_reference_and_bad_settings_are_refused() -> None:
    lp, resp, nll = _batch(np.random.default_rng(0), b=1)
    with pytest.raises(ValueError, match="reference log-probs"):
        pair_loss(mx.array(lp), mx.array(resp), mx.array(nll), spec_of("dpo"),
                  Norms(1.0, 1.0))
    for bad in ({"dpo_beta": 0.0}, {"dpo_beta": -1.0}, {"dpo_beta": float("nan")},
                {"dpo_label_smoothing": 0.5}, {"dpo_loss_type": "nonesuch"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            spec_of("dpo", **bad)
