"""Forward-only scoring: validation metrics and per-pair scores (``pomona score``).

Uses the same token log-probs as training (dense, or chunked when ``head_chunk`` > 0 so
evaluation never materialises [tokens, vocab] logits either).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.batch import Pair, PairBatch, batch_norms, make_batch
from engine.head import token_logps
from engine.losses import LossSpec, mean_logps, orpo_pair_terms, pair_loss
from engine.model import Stack


def forward_logps(model: nn.Module, stack: Stack, batch: PairBatch,
                  head_chunk: int = 0) -> mx.array:
    """Token log-probs [2B, T] of ``batch`` (no gradient)."""
    inputs, targets = mx.array(batch.inputs), mx.array(batch.targets)
    if head_chunk <= 0:
        return token_logps(model(inputs), targets)
    h = stack.hidden(inputs)
    n, t, width = h.shape
    flat_h, flat_t = h.reshape(n * t, width), targets.reshape(-1)
    pieces = []
    for s in range(0, n * t, head_chunk):
        lp = token_logps(stack.head(flat_h[s : s + head_chunk]), flat_t[s : s + head_chunk])
        mx.eval(lp)
        pieces.append(lp)
    return mx.concatenate(pieces).reshape(n, t)


def chunks(pairs: Sequence[Pair], size: int) -> list[list[Pair]]:
    return [list(pairs[i : i + size]) for i in range(0, len(pairs), size)]


def evaluate(model: nn.Module, stack: Stack, pairs: Sequence[Pair], spec: LossSpec,
             batch_size: int, pad_multiple: int = 0, head_chunk: int = 0,
             max_batches: int = 0) -> dict[str, float]:
    """Loss and TRL-named metrics over ``pairs`` (means over the pairs/tokens used)."""
    groups = chunks(pairs, batch_size)
    if max_batches > 0:
        groups = groups[:max_batches]
    if not groups:
        return {"rows": 0}
    batches = [make_batch(g, spec.nll_span, pad_multiple) for g in groups]
    norms = batch_norms(batches)
    total_loss, sums = 0.0, {}
    was_training = model.training
    model.eval()
    try:
        for b in batches:
            lp = forward_logps(model, stack, b, head_chunk)
            loss, metrics = pair_loss(lp, mx.array(b.resp_mask), mx.array(b.nll_mask),
                                      spec, norms)
            mx.eval(loss, metrics)
            total_loss += float(loss)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
    finally:
        model.train(was_training)
    out = {"loss": total_loss, "nll_loss": sums.pop("nll_sum") / norms.nll_tokens}
    out.update({k: v / norms.pairs for k, v in sums.items()})
    out["rows"] = int(norms.pairs)
    return out


def score_pairs(model: nn.Module, stack: Stack, pairs: Sequence[Pair], orpo_lambda: float,
                batch_size: int = 8, head_chunk: int = 0) -> list[dict]:
    """Per pair: id, chosen/rejected mean log-prob, full-span NLL, log-odds, ORPO loss."""
    rows: list[dict] = []
    model.eval()
    for group in chunks(pairs, batch_size):
        b = make_batch(group, "full")
        lp = forward_logps(model, stack, b, head_chunk)
        resp, nll_mask = mx.array(b.resp_mask), mx.array(b.nll_mask)
        logps = mean_logps(lp, resp)
        k = len(group)
        lw, lr = logps[:k], logps[k:]
        nll = -mean_logps(lp[:k], nll_mask[:k])
        log_odds, log_sig = orpo_pair_terms(lw, lr)
        loss = nll - orpo_lambda * log_sig
        mx.eval(lw, lr, nll, log_odds, loss)
        for i, p in enumerate(group):
            rows.append({"id": p.id, "chosen_logp_mean": float(lw[i]),
                         "rejected_logp_mean": float(lr[i]), "nll": float(nll[i]),
                         "log_odds": float(log_odds[i]), "orpo_loss": float(loss[i])})
    return rows


def preference_accuracy(rows: list[dict]) -> float:
    """Share of pairs whose chosen mean log-prob beats the rejected one."""
    return float(np.mean([r["chosen_logp_mean"] > r["rejected_logp_mean"] for r in rows]))
