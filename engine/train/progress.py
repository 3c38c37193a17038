"""A training record as one line a person reads: the trainer's CLI prints it, a sweep's
trial logs it on its Prefect task run, so the terminal and the UI say the same thing.

    t-983b step 50/100 loss 5.76 acc 0.58 lr 3.6e-4 4.9k tok/s 0.03 GB
    t-983b step 50/100 valid loss 5.80 acc 0.61

The whole record stays in ``metrics.jsonl``; a line carries the few figures a run is
watched by: the loss, the preference accuracy (the loss's own reward accuracy where it
has one, else the log-prob one; GRPO's mean reward), the learning rate, throughput and peak memory.
"""

from __future__ import annotations

from typing import Any


def _accuracy(record: dict[str, Any], prefix: str) -> float | None:
    for name in ("rewards/accuracies", "logps/accuracies"):
        if f"{prefix}{name}" in record:
            return record[f"{prefix}{name}"]
    return None


def _short(value: float) -> str:
    """3.6e-4, not 3.6e-04; 0 as 0."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return "0" if value == 0 else f"{mantissa}e{int(exponent)}"


def _rate(value: float) -> str:
    return f"{value / 1000:.1f}k" if value >= 1000 else f"{value:.0f}"


def progress_line(record: dict[str, Any], steps: int | None = None, name: str = "") -> str:
    """``record`` (a train or valid record of metrics.jsonl) as one line; ``steps``: the
    run's total, ``name``: the trial's id, both shown when given."""
    where = f"step {record.get('step')}" + (f"/{steps}" if steps else "")
    parts = [name, where] if name else [where]
    prefix = "val/" if record.get("split") == "valid" else ""
    if prefix:
        parts.append("valid")
    if f"{prefix}loss" in record:
        parts.append(f"loss {record[f'{prefix}loss']:.3g}")
    if (acc := _accuracy(record, prefix)) is not None:
        parts.append(f"acc {acc:.2f}")
    if f"{prefix}reward" in record:  # a group loss's (GRPO): its completions' mean reward
        parts.append(f"reward {record[f'{prefix}reward']:.3f}")
    if not prefix:
        if "learning_rate" in record:
            parts.append(f"lr {_short(record['learning_rate'])}")
        if "tokens_per_sec" in record:
            parts.append(f"{_rate(record['tokens_per_sec'])} tok/s")
        if "peak_memory_gb" in record:
            parts.append(f"{record['peak_memory_gb']:.2f} GB")
    return " ".join(parts)
