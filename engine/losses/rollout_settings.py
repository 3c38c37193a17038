"""How a group loss samples its completions (TRL's GRPOConfig names): ``RolloutSettings``,
valid by construction, what engine/forward/rollouts.py samples with and GRPO's settings
make (engine/losses/grpo.py ``rollout``)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RolloutSettings:
    """How completions are sampled (TRL's GRPOConfig names), valid by construction."""

    num_generations: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_completion_length: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ValueError(f"num_generations={self.num_generations}: a group needs at "
                             "least 2 completions (its advantages compare them)")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature={self.temperature}: must be > 0 (GRPO samples; "
                             "0 would give G equal completions)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.max_completion_length < 1:
            raise ValueError(f"max_completion_length={self.max_completion_length}: must be "
                             ">= 1")
