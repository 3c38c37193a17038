"""How a forward pass over pairs runs outside the training step: the one value that
training's DPO reference pass, ``python -m engine score``, the pipeline's evaluation and
``reference_needs`` take (issue 53: four shapes of it had drifted apart).

    options = cfg.forward(ranks)     # a TrainConfig's (engine/settings/config.py)
    ensure_reference(spec, None, options)

Its defaults are TrainConfig's (tests/test_trial_plan.py holds them equal).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardOptions:
    """Pairs per forward, LM-head chunk (0: dense logits), prefix sharing (on, off, auto)
    and whether data tokenized for another tokenizer is allowed (engine/data/data_fit.py)."""

    batch_size: int = 4
    head_chunk: int = 0
    prefix_share: str = "auto"
    allow_tokenizer_mismatch: bool = False
