"""Test helper: the parity check every optimised path is held to, and the LoRA models it
runs on (B drawn non-zero, so A gets gradients too).

Tolerance: max |g − g_ref| ≤ 1e-5 · max |g_ref| per tensor; loss to 1e-6 and metrics to
1e-5 relative, or 1e-6 of the log-probs' size absolute (float32: the paths reorder sums
only; a margin near zero is a difference of two such sums).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from engine.check.load_check import check_stack
from engine.data.batch import Pair, make_batch
from engine.model.arch import make_stack
from engine.model.load import LoraSpec, attach_lora, lora_modules

GRAD_RTOL, LOSS_RTOL = 1e-5, 1e-6
# A pack's adapters after a few AdamW steps against each trained alone, per tensor in norm:
# ‖w − w_alone‖ ≤ PACK_WEIGHT_RTOL · ‖w_alone‖. A pack batches its matmuls otherwise than a
# lone trial, and AdamW turns that rounding, where a gradient is near zero, into a step of
# up to the learning rate on that element: single elements drift far more than the tensor.
# On OpenBLAS 0.3.21's Haswell kernels (OPENBLAS_CORETYPE=Haswell, as this workplace's AMD
# EPYC machines set it) single elements reached 1.3e-3 of their tensor's largest and a small
# B 3.8e-4 in norm after 4 steps at lr 2e-3 (measured 2026-12-06), where the auto-detected
# kernel kept both within 1e-5. A trial given another's rate, clip or optimizer state moves
# B (zero at the start) by its whole update: a relative difference of order 1 in norm.
PACK_WEIGHT_RTOL = 1e-3


def assert_pack_weights(got: dict, want: dict, where: object = "") -> None:
    """Each tensor of ``got`` within PACK_WEIGHT_RTOL of ``want``'s in norm."""
    assert set(got) == set(want), where
    for name, w in want.items():
        norm = float(mx.linalg.norm(w.flatten()))
        diff = float(mx.linalg.norm((got[name] - w).flatten()))
        assert norm > 0 and diff <= PACK_WEIGHT_RTOL * norm, (where, name, diff / norm)


def with_lora(model, keys: tuple[str, ...] | None = None, dropout: float = 0.0,
              num_layers: int = -1):
    """``model`` with LoRA attached and B drawn non-zero (so A gets gradients too)."""
    attach_lora(model, LoraSpec(rank=4, scale=2.0, dropout=dropout, keys=keys,
                                num_layers=num_layers), seed=0)
    rng = np.random.default_rng(7)
    for _, m in lora_modules(model):
        m.lora_b = mx.array(rng.normal(0, 0.05, m.lora_b.shape).astype(np.float32))
    return model


def lora_model(path: Path, dropout: float = 0.0, num_layers: int = -1):
    """The model at ``path`` with LoRA (``with_lora``) and its checked stack."""
    model, _ = mlx_lm.load(str(path))
    with_lora(model, dropout=dropout, num_layers=num_layers)
    stack = make_stack(model)
    check_stack(model, stack)
    return model, stack


def with_reference(model, stack, pairs: Sequence[Pair], partners: bool = True) -> list[Pair]:
    """``pairs`` carrying reference log-probs (``Pair.ref``): each sequence's own summed
    response log-prob under ``model`` (one dense forward, engine/forward/scoring.py) moved by a
    deterministic offset per pair, so DPO's z = (Sw − Sr) − (Rw − Rr) is −(oc − or) ≠ 0,
    of either sign and a few units: the sigmoid is not saturated and the gradients are not
    zero. With ``partners``, each also carries its KL partner (engine/train/reference.kl_partners)
    with its own log-probs less 0.5 + 0.1·i as its reference: KTO's KL point is then about
    +0.6, not clamped at 0. Parity tests take both as the constants they are in training."""
    from engine.forward.scoring import forward_logps
    from engine.train.reference import kl_partners

    batch = make_batch(pairs, "full")
    lp = forward_logps(model, stack, batch)
    sums = (lp * mx.array(batch.resp_mask)).sum(axis=-1).tolist()
    b = len(pairs)
    out = [replace(p, ref=(sums[i] + ref_offset(i)[0], sums[b + i] + ref_offset(i)[1]))
           for i, p in enumerate(pairs)]
    if not partners:
        return out
    mates = with_reference(model, stack, kl_partners(pairs), partners=False)
    return [replace(p, kl=replace(q, ref=(q.ref[0] - ref_offset(i)[0] - 0.5 - 0.1 * i,
                                          q.ref[1] - ref_offset(i)[1] - 0.5 - 0.1 * i)))
            for i, (p, q) in enumerate(zip(out, mates, strict=True))]


def batch_loss(model, stack, pairs_batch, spec):
    """The loss of a token log-prob array [2B, T] for ``pairs_batch`` (a PairBatch) under
    ``spec``, as the trainer closes over it: its normalisers, its reference log-probs and,
    for a loss that reads one, its KL point (engine/backward/step.py: a constant to the
    gradient)."""
    from engine.data.batch import batch_norms
    from engine.forward.scoring import batch_kl, kl_point
    from engine.losses import pair_loss

    norms = batch_norms([pairs_batch])
    resp, nll = mx.array(pairs_batch.resp_mask), mx.array(pairs_batch.nll_mask)
    ref = pairs_batch.ref_array()
    kl = kl_point(*batch_kl(model, stack, pairs_batch)) if spec.needs_kl else None
    return lambda lp: pair_loss(lp, resp, nll, spec, norms, ref, kl)


def assert_finite_differences(grad: np.ndarray, loss_of: Callable[[np.ndarray], float],
                              lp: np.ndarray, mask: np.ndarray, eps: float = 1e-4) -> None:
    """``grad`` (a loss's gradient with respect to token log-probs ``lp``) equals central
    differences of the float64 reference ``loss_of`` at every position ``mask`` marks,
    within 1e-3 relative (the difference's own error at eps 1e-4) or 1e-6 absolute."""
    for i, j in zip(*np.nonzero(mask), strict=True):
        up, down = lp.astype(np.float64).copy(), lp.astype(np.float64).copy()
        up[i, j] += eps
        down[i, j] -= eps
        fd = (loss_of(up) - loss_of(down)) / (2 * eps)
        assert float(grad[i, j]) == pytest.approx(fd, rel=1e-3, abs=1e-6), (i, j)


def ref_offset(i: int) -> tuple[float, float]:
    """``with_reference``'s (chosen, rejected) offset of pair ``i``: z = −(oc − or)."""
    return 1.5 * (-1) ** i * (i + 1), -0.75 * (i + 1)


def assert_same(got, ref, grad_rtol: float = GRAD_RTOL, loss_abs: float = 0.0) -> None:
    """(loss, metrics, grads) of a path against the reference's, at the tolerances above
    (``grad_rtol``, ``loss_abs``: a caller's own, written down where it is used)."""
    loss, metrics, grads = got
    ref_loss, ref_metrics, ref_grads = ref
    assert set(grads) == set(ref_grads) and len(grads) > 0
    assert float(loss) == pytest.approx(float(ref_loss), rel=LOSS_RTOL, abs=loss_abs)
    # A margin is a difference of log-probs: no more exact than its terms, so the absolute
    # floor scales with them (|logps| 13.5 → 1.4e-5; AMD's OpenBLAS kernels reach 1.2e-6),
    # and with the caller's gradient tolerance (real weights: 1.7e-5 at |logps| 15).
    terms = [abs(float(v)) for k, v in ref_metrics.items() if k.startswith("logps/")]
    floor = grad_rtol / 10 * max([1.0, *terms])
    for k in ref_metrics:
        assert float(metrics[k]) == pytest.approx(float(ref_metrics[k]), rel=1e-5, abs=floor), k
    for name, g in ref_grads.items():
        scale = float(mx.abs(g).max())
        assert scale > 0, f"{name}: zero reference gradient makes the test vacuous"
        err = float(mx.abs(grads[name] - g).max())
        assert err <= grad_rtol * scale, f"{name}: {err:.3g} > {grad_rtol} × {scale:.3g}"
