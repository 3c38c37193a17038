"""Whether a dataset fits the model that reads it: the tokenizer it was made with, and the
vocabulary its ids must stay inside.

Ids from another tokenizer index the wrong embeddings (the run trains towards NaN or
nonsense); ids past the vocabulary read outside the embedding table. The trainer, the
probe, scoring and evaluation all load a model and then its data through
``load_pairs_for``: a dataset directory's manifest fingerprint (``tokenizer_hash``, written
by ``pomona data tokenize``) is compared with the model's own, and every id is checked
against the model's vocabulary (engine/data/token_ids.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.data.pairs import PairSet, load_pairs
from engine.host.digests import tokenizer_hash
from engine.model.source import model_dir

MISMATCH_FLAG = "--allow-tokenizer-mismatch"


def model_vocab(stack: Any) -> int:
    """Ids the model can read: the rows of its embedding table, or of its head where an
    untied head has fewer (a target id indexes the head's logits)."""
    rows = int(stack.inner.embed_tokens.weight.shape[0])
    head = getattr(stack.text, "lm_head", None)
    weight = getattr(head, "weight", None)
    return min(rows, int(weight.shape[0])) if weight is not None else rows


def tokenizer_problem(data: str | Path, model: str) -> str | None:
    """Why ``data`` was tokenized for another tokenizer than ``model``'s, or None (a file
    without a manifest, or a model without local tokenizer files, cannot tell)."""
    try:
        manifest = json.loads((Path(data) / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    theirs = manifest.get("tokenizer_hash") if isinstance(manifest, dict) else None
    if not theirs:
        return None
    try:
        local = model_dir(model)
    except FileNotFoundError:  # no local tokenizer files to compare with
        return None
    ours = tokenizer_hash(local)
    if ours == theirs:
        return None
    return (f"{data}: tokenized with another tokenizer ({manifest.get('tokenizer', '?')}, "
            f"fingerprint {theirs[:12]}) than the model {model}'s ({ours[:12]}); its ids would "
            f"index the wrong embeddings. Re-tokenize with `pomona data tokenize --model "
            f"{model}`, or pass {MISMATCH_FLAG} if both share one vocabulary")


def load_pairs_for(data: str | Path, model: str, stack: Any,
                   allow_tokenizer_mismatch: bool = False) -> PairSet:
    """``data``'s pairs for ``model`` (loaded, its ``stack`` checked): ValueError when the
    dataset's tokenizer is not the model's (unless allowed), ids outside the model's
    vocabulary counted as bad rows (engine/data/pairs.py: load_pairs)."""
    problem = tokenizer_problem(data, model)
    if problem and not allow_tokenizer_mismatch:
        raise ValueError(problem)
    return load_pairs(data, vocab=model_vocab(stack))
