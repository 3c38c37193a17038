"""Forward-only scoring: validation metrics and per-pair scores (``pomona score``).

Uses the same token log-probs as training (dense, or chunked when ``head_chunk`` > 0 so
evaluation never materialises [tokens, vocab] logits either) and the same layouts: a
``Layout`` may return a PrefixBatch, scored in one shared forward like training's. Pairs
are batched by length (scores are per row, so order is free and pads are the waste).
The demo's validation split (211 pairs, CPU, `score_pairs`): 23.1 s in data order, 7.0 s
by length, 4.4 s by length and shared. The head runs only where a metric reads (response
and NLL spans): over every position a real 49k vocabulary took 30% of an evaluation
(SmolLM2, 40 validation pairs of a short-answer task, CPU: 23.3 → 16.4 s).
``is_score_file`` recognises a score file it wrote (the only file ``pomona score --out``
replaces: engine/host/outputs.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.data.batch import Pair, PairBatch, batch_norms, make_batch
from engine.data.pairs import pair_length
from engine.forward.prefix import PrefixBatch, pair_batch, to_pair_layout
from engine.forward.prefix_patch import layout_masks
from engine.losses import LossSpec, mean_logps, pair_logps, pair_loss, per_pair_losses
from engine.model.arch.stack import Stack
from engine.model.head import dense_logps, token_logps

# How a group of pairs is laid out for the forward (layout_policy.choose_layout, or make_batch).
Layout = Callable[[list[Pair]], PairBatch | PrefixBatch]


def forward_logps(model: nn.Module, stack: Stack, batch: PairBatch | PrefixBatch,
                  head_chunk: int = 0, active: np.ndarray | None = None) -> mx.array:
    """Token log-probs [2B, T] of ``batch`` in the two-forward layout (no gradient).

    ``active`` [2B, T]: the positions the caller reads (its masks' union); the head runs
    on those alone and the rest are 0, as training's bounded head skips tokens without
    loss (prompt and pad positions are most of an evaluation's rows).
    """
    pairs = pair_batch(batch)
    targets = mx.array(pairs.targets)
    if isinstance(batch, PrefixBatch):
        with layout_masks(model, batch) as mask:
            h = to_pair_layout(stack.hidden(mx.array(batch.inputs), mask), batch)
    else:
        h = stack.hidden(mx.array(pairs.inputs))
    if head_chunk <= 0 and active is None:
        return dense_logps(stack, h, targets)
    n, t, width = h.shape
    flat_h, flat_t = h.reshape(n * t, width), targets.reshape(-1)
    if active is not None:
        idx = mx.array(np.flatnonzero(np.asarray(active).reshape(-1)).astype(np.int32))
        flat_h, flat_t = flat_h[idx], flat_t[idx]
    step = head_chunk if head_chunk > 0 else max(flat_t.size, 1)
    pieces = []
    for s in range(0, flat_t.size, step):
        lp = token_logps(stack.head(flat_h[s : s + step]), flat_t[s : s + step])
        mx.eval(lp)
        pieces.append(lp)
    lp = mx.concatenate(pieces) if pieces else mx.zeros((0,), mx.float32)
    if active is None:
        return lp.reshape(n, t)
    return mx.zeros((n * t,), mx.float32).at[idx].add(lp).reshape(n, t)


def batch_kl(model: nn.Module, stack: Stack, batch: PairBatch, head_chunk: int = 0
             ) -> tuple[float, int]:
    """The parts of a KL reference point from ``batch``'s KL partners (``PairBatch.kl``):
    Σ over their rows of the policy's summed response log-prob minus the reference's
    (TRL's ``policy_KL_logps − reference_KL_logps``), and how many rows (no gradient)."""
    partners = batch.kl
    if partners is None or partners.ref is None:
        raise ValueError("this loss needs KL partners with reference log-probs "
                         "(engine/train/reference.py): none were attached to this batch")
    resp = mx.array(partners.resp_mask)
    lp = forward_logps(model, stack, partners, head_chunk, partners.resp_mask > 0)
    total = ((lp * resp).sum(axis=-1) - mx.array(partners.ref)).sum()
    return float(total), 2 * partners.pairs


def kl_point(total: float, rows: float) -> mx.array:
    """KTO's z0: the mean policy-to-reference log-ratio of mismatched pairs, clamped at 0
    (Ethayarajh et al. 2024, Eq. 7; TRL's ``.clamp(min=0)``), a constant to the gradient."""
    return mx.array(max(total / max(rows, 1.0), 0.0), mx.float32)


def group_kl(model: nn.Module, stack: Stack, two: PairBatch, spec: LossSpec,
             head_chunk: int) -> mx.array | None:
    """One scored group's KL reference point where ``spec``'s loss reads one, else None."""
    return kl_point(*batch_kl(model, stack, two, head_chunk)) if spec.needs_kl else None


def read_positions(*masks: np.ndarray) -> np.ndarray:
    """The positions any of ``masks`` reads: ``forward_logps``' ``active``."""
    return np.logical_or.reduce([np.asarray(m) != 0 for m in masks])


def length_groups(pairs: Sequence[Pair], size: int) -> list[list[int]]:
    """Indices of ``pairs`` in groups of ``size``, sorted by length (stable), as
    training's buckets (engine/data/pairs.py)."""
    order = sorted(range(len(pairs)), key=lambda i: pair_length(pairs[i]))
    return [order[i : i + size] for i in range(0, len(order), size)]


def forward_groups(model: nn.Module, stack: Stack, pairs: Sequence[Pair], batch_size: int,
                   layout: Layout, head_chunk: int = 0, nll: bool = True
                   ) -> Iterator[tuple[list[int], PairBatch, mx.array]]:
    """The one forward-only loop (evaluation, ``score``, DPO's reference): ``pairs`` in
    length groups of ``batch_size``, each laid out by ``layout``; per group its indices,
    its two-forward batch and the log-probs at the positions its response (and, with
    ``nll``, its NLL) mask reads. The model runs in eval mode; its mode is put back after."""
    was_training = model.training
    model.eval()
    try:
        for idx in length_groups(pairs, batch_size):
            b = layout([pairs[i] for i in idx])
            two = pair_batch(b)
            masks = (two.resp_mask, two.nll_mask) if nll else (two.resp_mask,)
            yield idx, two, forward_logps(model, stack, b, head_chunk, read_positions(*masks))
    finally:
        model.train(was_training)


def evaluate(model: nn.Module, stack: Stack, pairs: Sequence[Pair], spec: LossSpec,
             batch_size: int, head_chunk: int = 0, layout: Layout | None = None,
             per_pair: dict[str, float] | None = None) -> dict[str, float]:
    """Loss and TRL-named metrics over ``pairs`` (means over the pairs/tokens used).

    ``layout``: how a group of pairs becomes a batch (the trainer's, with its padding and
    prefix sharing; None: two plain rows a pair, unpadded). ``per_pair``, when given, is
    filled with each pair's id → 1.0 where its chosen mean log-prob beats the rejected
    one, else 0.0 (``logps/accuracies`` is their mean): what a paired test against another
    model reads.
    """
    if not pairs:
        return {"rows": 0}
    layout = layout or (lambda g: make_batch(g, spec.nll_span))
    norms = batch_norms([make_batch([pairs[i] for i in g], spec.nll_span)
                         for g in length_groups(pairs, batch_size)])
    total_loss, sums = 0.0, {}
    for idx, two, lp in forward_groups(model, stack, pairs, batch_size, layout, head_chunk):
        loss, metrics = pair_loss(lp, mx.array(two.resp_mask), mx.array(two.nll_mask),
                                  spec, norms, two.ref_array(),
                                  group_kl(model, stack, two, spec, head_chunk),
                                  two.label_array())
        mx.eval(loss, metrics)
        if per_pair is not None:
            _record_wins(per_pair, [pairs[i] for i in idx], lp, mx.array(two.resp_mask))
        total_loss += float(loss)
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    out = {"loss": total_loss, "nll_loss": sums.pop("nll_sum") / norms.nll_tokens}
    out.update({k: v / norms.pairs for k, v in sums.items()})
    out["rows"] = int(norms.pairs)
    return out


def _record_wins(per_pair: dict[str, float], group: list[Pair], lp: mx.array,
                 resp: mx.array) -> None:
    """Each pair of ``group``: 1.0 where ℓw > ℓr (mean response log-probs), as
    ``logps/accuracies`` counts it (engine/losses/spec.py)."""
    k = len(group)
    won = np.asarray(mean_logps(lp[:k], resp[:k]) > mean_logps(lp[k:], resp[k:]))
    per_pair.update({p.id: float(w) for p, w in zip(group, won, strict=True)})


def score_pairs(model: nn.Module, stack: Stack, pairs: Sequence[Pair], spec: LossSpec,
                batch_size: int = 8, head_chunk: int = 0,
                layout: Layout | None = None) -> list[dict]:
    """Per pair, in ``pairs``' order: id, chosen/rejected mean log-prob, full-span NLL,
    its loss under ``spec`` (``per_pair_losses``, with the full-span NLL) and the loss's
    extras (ORPO: log_odds_ratio, log_odds_chosen). ``layout`` must lay pairs out with
    ``nll_span`` full."""
    layout = layout or (lambda g: make_batch(g, "full"))
    rows: list[dict] = [{} for _ in pairs]
    for idx, two, lp in forward_groups(model, stack, pairs, batch_size, layout, head_chunk):
        resp, nll_mask = mx.array(two.resp_mask), mx.array(two.nll_mask)
        logps = pair_logps(lp, resp, two.ref_array(), group_kl(model, stack, two, spec,
                                                               head_chunk), two.label_array())
        k = len(idx)
        nll = -mean_logps(lp[:k], nll_mask[:k])
        loss, terms = per_pair_losses(logps, nll, spec)
        extra = dict(terms.extra)
        if spec.needs_reference:  # DPO's implicit rewards β·(S − R), as TRL logs them
            extra.update(chosen_reward=terms.chosen_rewards,
                         rejected_reward=terms.rejected_rewards)
        mx.eval(logps.chosen, logps.rejected, nll, loss, extra)
        for j, i in enumerate(idx):
            rows[i] = {"id": pairs[i].id, "chosen_logp_mean": float(logps.chosen[j]),
                       "rejected_logp_mean": float(logps.rejected[j]), "nll": float(nll[j]),
                       "loss": float(loss[j]),
                       **{name: float(v[j]) for name, v in extra.items()}}
    return rows


SCORE_KEYS = ("id", "chosen_logp_mean", "rejected_logp_mean")  # in every row score_pairs makes


def is_score_file(path: Path) -> bool:
    """Whether ``path`` is a file ``pomona score`` wrote: JSON lines, each an object with a
    pair's scores (its mark: a user's data never holds these keys on every line)."""
    try:
        with Path(path).open(encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
    except (OSError, ValueError):
        return False
    return bool(rows) and all(isinstance(r, dict) and all(k in r for k in SCORE_KEYS)
                              for r in rows)


def preference_accuracy(rows: list[dict]) -> float:
    """Share of pairs whose chosen mean log-prob beats the rejected one."""
    return float(np.mean([r["chosen_logp_mean"] > r["rejected_logp_mean"] for r in rows]))
