"""Issue 70, step 4: DPO's loss types (engine/losses/dpo_types.py) against float64 numpy
references written from TRL's ``dpo_loss`` (each type's paper in the module's docstring),
their gradients against central differences of those references, and the refusals.

Tolerances: the loss within 1e-6 relative of float64 (Pomona's sums are float32, over
response log-probs of tens of nats: measured ≤ 1.5e-7, sppo_hard's squares the largest,
2026-12-07); the gradient within 1e-3 relative
(abs 1e-6) of a central difference at h = 1e-6, as tests/test_losses.py holds DPO's.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.losses import Norms, pair_loss, spec_of
from engine.losses.dpo import LOSS_TYPES
from engine.losses.dpo_types import EXO_EPS

pytestmark = pytest.mark.unit
BETA, TAU = 0.3, 0.05
TYPES = [t for t in LOSS_TYPES if t not in ("bco_pair", "sft")]


def logsig(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def sig(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def np_types(kind: str, lp, resp, ref, eps: float = 0.0) -> float:
    """The mean loss of type ``kind`` in float64, from TRL's formulas: summed response
    log-probs (ipo: per-token means, as TRL divides them)."""
    lp, resp, ref = (a.astype(np.float64) for a in (lp, resp, ref))
    b = lp.shape[0] // 2
    s = (lp * resp).sum(1)
    if kind == "ipo":
        s, ref = s / resp.sum(1), ref / resp.sum(1)
    sw, sr, rw, rr = s[:b], s[b:], ref[:b], ref[b:]
    z, cw, cr = (sw - sr) - (rw - rr), sw - rw, sr - rr
    x = BETA * z
    smooth = lambda d: -(1 - eps) * logsig(BETA * d) - eps * logsig(-BETA * d)  # noqa: E731
    exo = eps or EXO_EPS
    losses = {
        "sigmoid": smooth(z),
        "robust": (-(1 - eps) * logsig(x) + eps * logsig(-x)) / (1 - 2 * eps),
        "exo_pair": sig(x) * (logsig(x) - np.log(1 - exo)) + sig(-x) * (logsig(-x)
                                                                        - np.log(exo)),
        "hinge": np.maximum(0.0, 1 - x),
        "ipo": (z - 1 / (2 * BETA)) ** 2,
        "sppo_hard": (cw - 0.5 / BETA) ** 2 + (cr + 0.5 / BETA) ** 2,
        "nca_pair": -logsig(BETA * cw) - 0.5 * logsig(-BETA * cw) - 0.5 * logsig(-BETA * cr),
        "aot_pair": smooth(np.sort(cw) - np.sort(cr)),
        "aot": smooth(np.sort(sw - sr) - np.sort(rw - rr)),
        "apo_zero": (1 - sig(BETA * cw)) + sig(BETA * cr),
        "apo_down": sig(BETA * cw) + (1 - sig(BETA * (cw - cr))),
        "discopop": -logsig(x) * (1 - sig(x / TAU)) + np.exp(-x) * sig(x / TAU)}[kind]
    return float(losses.mean())


def batch(rng: np.random.Generator, b: int, t: int = 8):
    """Log-probs [2B, T] with ragged response masks, and reference sums near the
    policy's (so z and each ratio have both signs, the sorts reorder)."""
    lp = -rng.uniform(0.05, 3.0, (2 * b, t)).astype(np.float32)
    resp = np.zeros((2 * b, t), np.float32)
    for i in range(2 * b):
        resp[i, int(rng.integers(1, 4)):int(rng.integers(5, t + 1))] = 1
    ref = ((lp * resp).sum(1) + rng.normal(0, 2, 2 * b)).astype(np.float32)
    return lp, resp, ref


def spec(kind: str | list[str], eps: float = 0.0, **extra):
    if "discopop" in kind:
        extra["dpo_discopop_tau"] = TAU
    return spec_of("dpo", "response", dpo_beta=BETA, dpo_loss_type=kind,
                   dpo_label_smoothing=eps, **extra)


def loss_of(kind: str | list[str], lp, resp, ref, eps: float = 0.0, **extra) -> mx.array:
    nll = resp.copy()
    nll[lp.shape[0] // 2:] = 0  # the chosen responses: TRL's NLL term (sft, rpo_alpha)
    return pair_loss(lp if isinstance(lp, mx.array) else mx.array(lp), mx.array(resp),
                     mx.array(nll), spec(kind, eps, **extra),
                     Norms(float(nll.sum()), lp.shape[0] // 2), mx.array(ref))[0]


@pytest.mark.parametrize("kind", TYPES)
def test_each_dpo_type_matches_its_float64_reference(kind: str) -> None:
    rng = np.random.default_rng(11)
    lp, resp, ref = batch(rng, b=6)
    eps = 0.1 if kind in ("sigmoid", "robust", "exo_pair", "aot", "aot_pair") else 0.0
    for smoothing in sorted({0.0, eps}):
        got = float(loss_of(kind, lp, resp, ref, smoothing))
        assert got == pytest.approx(np_types(kind, lp, resp, ref, smoothing), rel=1e-6,
                                    abs=1e-7), (kind, smoothing)


@pytest.mark.parametrize("kind", TYPES)
def test_each_dpo_types_gradient_matches_finite_differences(kind: str) -> None:
    """d loss / d log π through the mx graph (the sorts' included) against central
    differences of the float64 reference."""
    rng = np.random.default_rng(12)
    lp, resp, ref = batch(rng, b=3, t=6)
    grad = mx.grad(lambda x: loss_of(kind, x, resp, ref))(mx.array(lp))
    h = 1e-6
    for i, j in np.argwhere(resp > 0)[::3]:
        up, down = lp.astype(np.float64), lp.astype(np.float64).copy()
        up = up.copy()
        up[i, j] += h
        down[i, j] -= h
        fd = (np_types(kind, up, resp, ref) - np_types(kind, down, resp, ref)) / (2 * h)
        assert float(grad[i, j]) == pytest.approx(fd, rel=1e-3, abs=1e-6), (kind, i, j)


def test_discopop_stays_finite_where_its_exponential_overflows() -> None:
    """At βz = −100, exp(−βz) passes float32's range while its weight σ(βz/τ) is 0: the
    loss is the logistic term alone (TRL's form would give 0·inf = NaN)."""
    lp, resp = np.full((2, 1), -1.0, np.float32), np.ones((2, 1), np.float32)
    ref = np.array([-1.0 + 100 / BETA, -1.0], np.float32)  # z = −100/β
    got = float(loss_of("discopop", lp, resp, ref))
    assert got == pytest.approx(-float(logsig(np.array(-100.0))), rel=1e-6)


def test_types_needing_what_pomona_lacks_and_stray_settings_are_refused() -> None:
    for bad, message in (({"dpo_loss_type": "bco_pair"}, "dpo_loss_type=bco_pair: it needs "
                                                         "a running mean of the rewards"),
                         ({"dpo_loss_type": "hinge", "dpo_label_smoothing": 0.1},
                          "loss type hinge: it has no label smoothing"),
                         ({"dpo_loss_type": "sigmoid", "dpo_discopop_tau": 0.1},
                          "dpo_discopop_tau=0.1 with loss type sigmoid: only discopop"),
                         ({"dpo_loss_type": "nonesuch"}, "dpo_loss_type")):
        with pytest.raises(ValueError, match=r"^[^\n]*$") as err:
            spec_of("dpo", **bad)
        assert message in str(err.value), (bad, err.value)


def test_a_mixture_is_the_weighted_sum_of_its_types_and_sft_is_the_nll_term() -> None:
    """TRL's ``loss_type: [sigmoid, hinge]`` with ``loss_weights`` is Σ w·L (float64
    references as above); ``[sigmoid, sft]`` at weights (1, 0.5) is sigmoid with
    ``rpo_alpha`` 0.5; an older config's single name reads as a list of one."""
    rng = np.random.default_rng(13)
    lp, resp, ref = batch(rng, b=5)
    got = float(loss_of(["sigmoid", "hinge", "apo_zero"], lp, resp, ref,
                        dpo_loss_weights=[0.7, 0.3, 0.2]))
    want = sum(w * np_types(k, lp, resp, ref) for k, w in
               (("sigmoid", 0.7), ("hinge", 0.3), ("apo_zero", 0.2)))
    assert got == pytest.approx(want, rel=1e-6)
    mixed = float(loss_of(["sigmoid", "sft"], lp, resp, ref, dpo_loss_weights=[1.0, 0.5]))
    assert mixed == pytest.approx(float(loss_of("sigmoid", lp, resp, ref, rpo_alpha=0.5)),
                                  rel=1e-6)
    assert mixed > float(loss_of("sigmoid", lp, resp, ref))  # the NLL term is there
    assert spec_of("dpo", dpo_loss_type="ipo").loss.dpo_loss_type == ("ipo",)


def test_mixtures_pomona_cannot_train_as_trl_means_are_refused() -> None:
    for bad, message in (({"dpo_loss_type": ["ipo", "sigmoid"]}, "ipo reads length-averaged"),
                         ({"dpo_loss_type": ["sigmoid", "sft"], "rpo_alpha": 0.5},
                          "both are the chosen NLL term"),
                         ({"dpo_loss_type": ["sigmoid", "hinge"], "dpo_loss_weights": [1.0]},
                          "dpo_loss_weights=[1.0]: one weight >= 0 per loss type"),
                         ({"dpo_loss_type": ["sigmoid", "hinge"],
                           "dpo_loss_weights": [1.0, -1.0]}, "one weight >= 0"),
                         ({"dpo_loss_type": ["hinge", "hinge"]}, "each once"),
                         ({"dpo_loss_type": ["sigmoid", "bco_pair"]}, "bco_pair: it needs"),
                         ({"dpo_loss_type": ["sigmoid", "nonesuch"]},
                          "'nonesuch' is not one of")):
        with pytest.raises(ValueError, match=r"^[^\n]*$") as err:
            spec_of("dpo", **bad)
        assert message in str(err.value), (bad, err.value)


def test_a_checkpoint_that_recorded_one_loss_type_by_name_resumes(monkeypatch) -> None:
    """Checkpoints before lists recorded ``dpo_loss_type: "sigmoid"``: the same run
    resumes from them; another type is still refused."""
    from pathlib import Path

    from engine.settings.config import TrainConfig
    from engine.train import resume

    cfg = TrainConfig(model="m", data="d", loss="dpo", steps=4)
    recorded = {"dpo_loss_type": "sigmoid", "dpo_beta": 0.1}
    state = {"step": 2, "settings": recorded}
    ours = {"dpo_loss_type": ["sigmoid"], "dpo_beta": 0.1}
    monkeypatch.setattr(resume, "run_settings", lambda _cfg: ours)  # no files to digest
    resume.check_resume(cfg, Path("ckpt"), state)
    ours["dpo_loss_type"] = ["hinge"]
    with pytest.raises(ValueError, match="dpo_loss_type was 'sigmoid' there"):
        resume.check_resume(cfg, Path("ckpt"), state)
