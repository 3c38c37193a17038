"""Evaluate an adapter (or the untrained base) on the held-out split.

Metrics, each over the validation pairs: ``eval/orpo_loss`` (full-span NLL − λ·log σ(log
odds), per pair, as ``pomona score``), ``eval/nll``, ``eval/accuracy`` (share of pairs
with ℓw > ℓr, mean response log-probs), ``eval/margin`` (mean ℓw − ℓr) and
``eval/log_odds``. Optionally the first N held-out prompts are continued with the adapter
(``mlx_lm.generate``, greedy) and stored beside their chosen and rejected responses in
``generations.jsonl`` for side-by-side reading. Runs where it is called: the sweep runs
it in a Ray task on a trial's placement, so models load on GPUs, not on the driver.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def evaluate_adapter(model: str, adapter: str | None, data: str, orpo_lambda: float = 0.1,
                     batch_size: int = 8, head_chunk: int = 0, generations: int = 0,
                     out: str | None = None, max_tokens: int = 64,
                     prefix_share: str = "auto") -> dict[str, Any]:
    """The held-out metrics of ``adapter`` (None: the base model) on ``data``;
    ``prefix_share`` as in training (one forward per pair where it pays)."""
    from engine.adapters import atomic_write_text
    from engine.data import load_pairs
    from engine.layout_policy import scoring_layout
    from engine.model import checked_stack, load_model
    from engine.scoring import preference_accuracy, score_pairs

    loaded, tokenizer = load_model(model, adapter)
    stack = checked_stack(loaded)
    pairs = load_pairs(data).valid
    if not pairs:
        raise ValueError(f"{data}: no validation split to evaluate on")
    rows = score_pairs(loaded, stack, pairs, orpo_lambda, batch_size, head_chunk,
                       scoring_layout(prefix_share, tokenizer.pad_token_id or 0))
    metrics: dict[str, Any] = {
        "eval/orpo_loss": float(np.mean([r["orpo_loss"] for r in rows])),
        "eval/nll": float(np.mean([r["nll"] for r in rows])),
        "eval/accuracy": preference_accuracy(rows),
        "eval/margin": float(np.mean([r["chosen_logp_mean"] - r["rejected_logp_mean"]
                                      for r in rows])),
        "eval/log_odds": float(np.mean([r["log_odds"] for r in rows])),
        "eval/rows": len(rows)}
    if generations and out:
        texts = generate_samples(loaded, tokenizer, pairs[:generations], max_tokens)
        path = Path(out) / "generations.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, "".join(json.dumps(t) + "\n" for t in texts))
        metrics["generations"] = str(path)
    return metrics


def generate_samples(model, tokenizer, pairs: list, max_tokens: int) -> list[dict[str, str]]:
    """Greedy continuations of each pair's prompt, next to its chosen and rejected text."""
    import mlx_lm

    out = []
    for p in pairs:
        text = mlx_lm.generate(model, tokenizer, prompt=list(p.prompt), max_tokens=max_tokens,
                               verbose=False)
        out.append({"id": p.id, "prompt": tokenizer.decode(list(p.prompt)),
                    "chosen": tokenizer.decode(list(p.chosen)),
                    "rejected": tokenizer.decode(list(p.rejected)), "generated": text})
    return out
