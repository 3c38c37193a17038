"""The short SFT warm start a GRPO run begins from (``pomona demo --online``'s, ``bench
grpo-learn``'s and ``bench online-pairs``'s): ``loss: sft`` on the train split's chosen
answers, stopped while its greedy answers are still partly wrong (80 steps: 0.644 of the
parity task's test prompts right), so the verifier meets right and wrong samples alike.
From a start that answers one word for every prompt, GRPO learned nothing
(docs/performance.md, GRPO from a verifier alone)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

SFT = {"loss": "sft", "batch_size": 16, "lora_rank": 16, "learning_rate": 1e-3,
       "nll_span": "response", "val_every": 0, "segment_size": 2, "head_chunk": 256}
STEPS = 80
LORA_SHAPE = ("lora_rank", "lora_keys", "lora_layers")  # what a run starting from it shares


def sft_warm_start(model: Path, data: Path, out: Path, steps: int = STEPS,
                   shape: dict[str, Any] | None = None) -> Path:
    """The SFT adapter in ``out`` (trained once: an adapter there is kept), seed 0, rank 16
    unless ``shape`` (LORA_SHAPE's settings) says otherwise: the runs that start from it
    must take its LoRA shape."""
    from engine.settings.config import TrainConfig
    from engine.train.trainer import train

    if not (out / "adapters.safetensors").exists():
        train(TrainConfig(model=str(model), data=str(data), out=str(out), steps=steps,
                          seed=0).replace(**{**SFT, **(shape or {})}))
    return out


def start_key(model: str, data: Path, steps: int, shape: dict[str, Any]) -> str:
    """What a pipeline's warm start is trained from: the model's bytes, the tokenized
    data's fingerprint, the steps and the LoRA shape (its folder's name: another of any
    of them trains another start, never reuses an old one)."""
    from engine.model.content_key import model_fingerprint
    from tasks.data.dataset_dir import read_manifest

    manifest = read_manifest(data) or {}
    body = json.dumps([model_fingerprint(model), manifest.get("fingerprint"), steps, shape,
                       SFT], sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]
