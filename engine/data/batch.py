"""Preference pairs → padded arrays for the two-forward path.

A pair is (prompt_ids, chosen_ids, rejected_ids); responses hold response tokens only.
Rows 0..B−1 of a batch are prompt+chosen, rows B..2B−1 prompt+rejected, right-padded:
under a causal mask real tokens never attend to trailing pads, so ``mask="causal"`` stays
exact and pads only need leaving out of the loss (docs/design.md, fused attention and padding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.losses import Norms


@dataclass(frozen=True)
class Pair:
    """One tokenized preference pair."""

    id: str
    prompt: Sequence[int]
    chosen: Sequence[int]
    rejected: Sequence[int]
    ref: tuple[float, float] | None = None  # reference summed log-probs (DPO: reference.py)
    kl: Pair | None = None  # its KL partner, with its reference (KTO: reference.kl_partners)
    label: bool | None = None  # an unpaired row's (engine/data/unpaired.py): desirable or not

    def problem(self) -> str | None:
        """Why this pair cannot be trained on, or None (empty responses give NaN means)."""
        if len(self.chosen) == 0:
            return "empty chosen response"
        if len(self.rejected) == 0:
            return "empty rejected response"
        if len(self.prompt) == 0:
            return "empty prompt"
        return None


@dataclass(frozen=True)
class PairBatch:
    """Arrays of one micro-batch (numpy; turned into mx arrays at the step).

    inputs, targets: [2B, T] int32 — targets[j] = inputs[j + 1] of the unpadded row;
    resp_mask: [2B, T] float32 — target is a response token;
    nll_mask: [2B, T] float32 — target is in the chosen row's NLL span;
    tokens: real (non-pad) tokens of both sequences of every pair (for tokens/s);
    ref: [2B] float32 reference summed log-probs, same row order, when every pair has one;
    kl: the pairs' KL partners as a batch of their own, when every pair has one (KTO);
    labels: [B] float32, 1 where an unpaired row's completion is desirable, 0 where not
    (its second branch its KL partner: engine/data/unpaired.py); None for pairs.
    """

    ids: list[str]
    inputs: np.ndarray
    targets: np.ndarray
    resp_mask: np.ndarray
    nll_mask: np.ndarray
    tokens: int
    ref: np.ndarray | None = None
    kl: PairBatch | None = None
    labels: np.ndarray | None = None

    @property
    def pairs(self) -> int:
        return len(self.ids)

    def ref_array(self) -> mx.array | None:
        return None if self.ref is None else mx.array(self.ref)

    def label_array(self) -> mx.array | None:
        return None if self.labels is None else mx.array(self.labels)


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (no-op when multiple <= 1)."""
    return n if multiple <= 1 else -(-n // multiple) * multiple


def make_batch(pairs: Sequence[Pair], nll_span: str = "full", pad_multiple: int = 0,
               pad_id: int = 0) -> PairBatch:
    """Pad ``pairs`` into one [2B, T] batch; T is rounded up to ``pad_multiple``."""
    seqs = [list(p.prompt) + list(p.chosen) for p in pairs]
    seqs += [list(p.prompt) + list(p.rejected) for p in pairs]
    prompt_lens = [len(p.prompt) for p in pairs] * 2
    width = round_up(max(len(s) for s in seqs) - 1, pad_multiple)
    n = len(seqs)
    inputs = np.full((n, width), pad_id, np.int32)
    targets = np.full((n, width), pad_id, np.int32)
    resp = np.zeros((n, width), np.float32)
    nll = np.zeros((n, width), np.float32)
    for i, (seq, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
        m = len(seq) - 1
        inputs[i, :m] = seq[:-1]
        targets[i, :m] = seq[1:]
        resp[i, p - 1 : m] = 1.0  # target j is token j+1: responses start at target p−1
        if i < len(pairs):
            nll[i, (0 if nll_span == "full" else p - 1) : m] = 1.0
    refs = None
    if all(p.ref is not None for p in pairs):
        refs = np.array([p.ref[0] for p in pairs] + [p.ref[1] for p in pairs], np.float32)
    partners = [p.kl for p in pairs]
    kl = (make_batch(partners, "full", pad_multiple, pad_id)
          if all(q is not None for q in partners) else None)
    labels = (np.array([p.label for p in pairs], np.float32)
              if all(p.label is not None for p in pairs) else None)
    return PairBatch([p.id for p in pairs], inputs, targets, resp, nll,
                     tokens=sum(len(s) for s in seqs), ref=refs, kl=kl, labels=labels)


def batch_norms(batches: Sequence[PairBatch]) -> Norms:
    """Normalisers over all micro-batches of one optimizer step."""
    return Norms(nll_tokens=float(max(sum(b.nll_mask.sum() for b in batches), 1.0)),
                 pairs=float(sum(b.pairs for b in batches)))


def repeat_rows(batch: PairBatch, k: int) -> PairBatch:
    """``batch`` with its rows repeated ``k`` times, copy after copy: the batch of a pack of
    ``k`` adapters (engine/model/packed_lora.py), copy i the rows adapter i trains on. Its
    KL partners (KTO) stay as they are: each adapter's KL point is its own pass over them
    (engine/train/pack_steps.py)."""
    rows = {f: np.concatenate([getattr(batch, f)] * k)
            for f in ("inputs", "targets", "resp_mask", "nll_mask")}
    ref = None if batch.ref is None else np.concatenate([batch.ref] * k)
    labels = None if batch.labels is None else np.concatenate([batch.labels] * k)
    return dataclasses.replace(batch, **rows, ref=ref, ids=list(batch.ids) * k,
                               tokens=batch.tokens * k, labels=labels)
