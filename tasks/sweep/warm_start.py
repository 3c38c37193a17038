"""The short SFT warm start a GRPO run begins from (``pomona demo --online``'s, ``bench
grpo-learn``'s and ``bench online-pairs``'s): ``loss: sft`` on the train split's chosen
answers, stopped while its greedy answers are still partly wrong (80 steps: 0.644 of the
parity task's test prompts right), so the verifier meets right and wrong samples alike.
From a start that answers one word for every prompt, GRPO learned nothing
(docs/performance.md, GRPO from a verifier alone)."""

from __future__ import annotations

from pathlib import Path

SFT = {"loss": "sft", "batch_size": 16, "lora_rank": 16, "learning_rate": 1e-3,
       "nll_span": "response", "val_every": 0, "segment_size": 2, "head_chunk": 256}
STEPS = 80


def sft_warm_start(model: Path, data: Path, out: Path, steps: int = STEPS) -> Path:
    """The SFT adapter in ``out`` (trained once: an adapter there is kept), seed 0, rank 16
    (what the runs that start from it must take)."""
    from engine.settings.config import TrainConfig
    from engine.train.trainer import train

    if not (out / "adapters.safetensors").exists():
        train(TrainConfig(model=str(model), data=str(data), out=str(out), steps=steps,
                          seed=0).replace(**SFT))
    return out
