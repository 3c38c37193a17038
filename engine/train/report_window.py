"""The training metrics between two reports: sums, losses, gradient norms, tokens and
seconds, turned into one ``metrics.jsonl`` record per report."""

from __future__ import annotations

from typing import Any

import mlx.core as mx


class Window:
    """Accumulates training metrics between reports. Its peak memory is MLX's, reset with
    the window; ``shared`` (a pack's trials share one process): the largest peak the pack
    fed it (``saw``), MLX's counter left to the pack."""

    def __init__(self, shared: bool = False) -> None:
        self.shared = shared
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, float] = {}
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.tokens, self.seconds = 0, 0.0
        self.peak = 0.0
        if not self.shared:
            mx.reset_peak_memory()

    def saw(self, peak_bytes: float) -> None:
        """A pack step's peak (MLX's, read once for every trial of the pack)."""
        self.peak = max(self.peak, peak_bytes)

    def add(self, loss: float, sums: dict[str, float], grad_norm: float, tokens: int,
            seconds: float) -> None:
        for k, v in sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.losses.append(loss)
        self.norms.append(grad_norm)
        self.tokens += tokens
        self.seconds += seconds

    def record(self, step: int, lr: float) -> dict[str, Any]:
        s = dict(self.sums)
        pairs, nll_tokens = s.pop("pairs"), s.pop("nll_tokens")
        share = s.pop("shared_batches") / max(s.pop("micro_batches"), 1)
        rec: dict[str, Any] = {"step": step, "split": "train",
                               "loss": sum(self.losses) / len(self.losses),
                               "nll_loss": s.pop("nll_sum") / nll_tokens}
        rec.update({k: v / pairs for k, v in s.items()})
        rec.update({"grad_norm": sum(self.norms) / len(self.norms), "learning_rate": lr,
                    "prefix_share_rate": share,
                    "tokens_per_sec": self.tokens / max(self.seconds, 1e-9),
                    "peak_memory_gb": (self.peak if self.shared else mx.get_peak_memory()) / 1e9})
        return rec
