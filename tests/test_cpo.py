"""CPO (engine/losses/cpo.py) against TRL's CPOTrainer maths in float64, its refusals, and a
real run of it through ``pomona train`` with every lever on.

The float64 reference transcribes trl/experimental/cpo/cpo_trainer.py (huggingface/trl at
0146ea62): ``get_batch_logps`` (summed, or averaged for ipo and simpo), ``cpo_loss`` and
``get_batch_loss_metrics`` (``losses.mean() + cpo_alpha * nll_loss``, the NLL a token mean
of the chosen completion's cross-entropy: Pomona's ``nll_span: response``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.losses import Norms, pair_loss, spec_of
from tests.parity import assert_finite_differences

TOL = 1e-4  # relative, float32 against float64 (the acceptance's TRL parity)


def log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def trl_cpo(lp: np.ndarray, resp: np.ndarray, nll_mask: np.ndarray, beta: float,
            alpha: float, smoothing: float, loss_type: str, gamma: float
            ) -> tuple[float, dict[str, float]]:
    """TRL's CPO loss and logged metrics of a [2B, T] batch (rows 0..B−1 chosen), float64."""
    lp = lp.astype(np.float64)
    sums, counts = (lp * resp).sum(-1), resp.sum(-1)
    logps = sums / counts if loss_type in ("ipo", "simpo") else sums
    b = len(lp) // 2
    chosen, rejected = logps[:b], logps[b:]
    logits = chosen - rejected
    if loss_type == "simpo":
        logits = logits - gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        losses = (-log_sigmoid(beta * logits) * (1 - smoothing)
                  - log_sigmoid(-beta * logits) * smoothing)
    elif loss_type == "hinge":
        losses = np.maximum(1 - beta * logits, 0.0)
    else:
        losses = (logits - 1 / (2 * beta)) ** 2
    nll = -(lp * nll_mask).sum() / nll_mask.sum() if alpha else 0.0
    cr, rr = beta * chosen, beta * rejected
    return float(losses.mean() + alpha * nll), {
        "rewards/chosen": cr.mean(), "rewards/rejected": rr.mean(),
        "rewards/accuracies": (cr > rr).mean(), "rewards/margins": (cr - rr).mean(),
        "logps/chosen": chosen.mean(), "logps/rejected": rejected.mean(), "nll_loss": nll}


def batch(seed: int, b: int = 4, t: int = 9) -> tuple[np.ndarray, ...]:
    """Token log-probs [2B, T], response masks of ragged lengths, the chosen NLL mask."""
    rng = np.random.default_rng(seed)
    lp = -rng.uniform(0.05, 2.5, (2 * b, t)).astype(np.float32)
    resp = np.zeros((2 * b, t), np.float32)
    for i in range(2 * b):
        start = int(rng.integers(1, t - 3))
        resp[i, start:int(rng.integers(start + 1, t + 1))] = 1
    nll = resp.copy()
    nll[b:] = 0
    return lp, resp, nll


CASES = [("sigmoid", 0.1, 1.0, 0.0), ("sigmoid", 0.3, 0.0, 0.2), ("hinge", 0.2, 1.0, 0.0),
         ("ipo", 0.5, 0.5, 0.0), ("simpo", 2.0, 0.0, 0.0), ("simpo", 2.5, 1.0, 0.1)]


@pytest.mark.unit
@pytest.mark.parametrize("loss_type,beta,alpha,smoothing", CASES)
def test_cpo_equals_trls_maths(loss_type: str, beta: float, alpha: float,
                               smoothing: float) -> None:
    lp, resp, nll = batch(sum(map(ord, loss_type)) + int(beta * 10))
    b = len(lp) // 2
    gamma = {"cpo_simpo_gamma": 1.4} if loss_type == "simpo" else {}  # only simpo reads it
    spec = spec_of("cpo", "response", cpo_beta=beta, cpo_alpha=alpha,
                   cpo_label_smoothing=smoothing, cpo_loss_type=loss_type, **gamma)
    loss, sums = pair_loss(mx.array(lp), mx.array(resp), mx.array(nll), spec,
                           Norms(float(nll.sum()), float(b)))
    want, metrics = trl_cpo(lp, resp, nll, beta, alpha, smoothing, loss_type, 1.4)
    assert float(loss) == pytest.approx(want, rel=TOL)
    for name, value in metrics.items():
        got = (float(sums["nll_sum"]) / nll.sum() if name == "nll_loss"
               else float(sums[name]) / b)
        if name == "nll_loss" and not alpha:
            continue  # TRL logs 0 when the term is off; Pomona logs the NLL it did not add
        assert got == pytest.approx(value, rel=TOL, abs=1e-6), name


@pytest.mark.unit
@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_cpo_gradient_equals_finite_differences_of_the_reference(loss_type: str) -> None:
    lp, resp, nll = batch(7)
    b = len(lp) // 2
    spec = spec_of("cpo", "response", cpo_loss_type=loss_type, cpo_beta=0.5)

    def loss_of(x: mx.array) -> mx.array:
        return pair_loss(x, mx.array(resp), mx.array(nll), spec, Norms(float(nll.sum()), b))[0]

    assert_finite_differences(np.array(mx.grad(loss_of)(mx.array(lp))),
                              lambda x: trl_cpo(x, resp, nll, 0.5, 1.0, 0.0, loss_type, 0.5)[0],
                              lp, resp)


@pytest.mark.unit
def test_bad_cpo_settings_are_refused_by_name() -> None:
    for bad, why in (({"cpo_beta": 0.0}, "cpo_beta"), ({"cpo_alpha": -1.0}, "cpo_alpha"),
                     ({"cpo_label_smoothing": 0.5}, "cpo_label_smoothing"),
                     ({"cpo_loss_type": "kto"}, "cpo_loss_type"),
                     ({"cpo_loss_type": "hinge", "cpo_label_smoothing": 0.1}, "no label")):
        with pytest.raises(ValueError, match=why):
            spec_of("cpo", **bad)


@pytest.mark.unit
@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
def test_a_simpo_gamma_where_no_loss_type_reads_it_is_refused(loss_type: str) -> None:
    """cpo_simpo_gamma set away from its default (TRL's 0.5) on a loss type that never reads
    it, or set below 0, is one line naming it; the default passes with every loss type
    (nothing says whether 0.5 was typed or defaulted, and it changes nothing there)."""
    with pytest.raises(ValueError, match=f"cpo_simpo_gamma=1.0 with loss type {loss_type}"):
        spec_of("cpo", cpo_loss_type=loss_type, cpo_simpo_gamma=1.0)
    kept = spec_of("cpo", cpo_loss_type=loss_type, cpo_simpo_gamma=0.5)  # the default
    assert kept.loss.fields()["cpo_simpo_gamma"] == 0.5
    with pytest.raises(ValueError, match=r"cpo_simpo_gamma=-0\.5: must be >= 0"):
        spec_of("cpo", cpo_loss_type="simpo", cpo_simpo_gamma=-0.5)
    no_margin = spec_of("cpo", cpo_loss_type="simpo", cpo_simpo_gamma=0.0)  # SimPO's ablation
    assert no_margin.loss.fields()["cpo_simpo_gamma"] == 0.0


@pytest.mark.integration
def test_pomona_train_trains_cpo_with_every_lever(tiny_model: Path, tiny_data: Path,
                                                  tmp_path: Path) -> None:
    """``pomona train --loss cpo`` (the SimPO variant, segmented, bounded head, shared
    prefix, verified against the plain path first): the adapter records its loss and
    settings, and the validation loss falls, its NLL term most (12 steps move the tiny
    model's preference margin by less than its noise: tests/test_demo.py ranks on that)."""
    out = tmp_path / "cpo"
    cmd = [sys.executable, "-m", "cli.main", "train", "--model", str(tiny_model), "--data",
           str(tiny_data), "--out", str(out), "--loss", "cpo", "--cpo-loss-type", "simpo",
           "--cpo-beta", "2.0", "--nll-span", "response", "--steps", "12", "--batch-size", "8",
           "--learning-rate", "2e-3", "--lora-rank", "8", "--segment-size", "2",
           "--head-chunk", "16", "--prefix-share", "on", "--val-every", "12", "--verify",
           "--best-metric", "val/logps/margin", "--best-mode", "max"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    block = json.loads((out / "adapter_config.json").read_text())["pomona"]
    assert block["loss"] == "cpo" and block["cpo_loss_type"] == "simpo"
    assert block["cpo_beta"] == 2.0 and "orpo_lambda" not in block
    vals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = [r for r in vals if "val/loss" in r]
    assert last["val/loss"] < first["val/loss"] - 0.5, (first, last)
    assert last["val/nll_loss"] < first["val/nll_loss"] - 0.5, (first, last)
