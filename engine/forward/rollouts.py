"""GRPO's rollouts: G completions of each prompt sampled from the policy as it trains (the
base with its adapter, in eval mode: no LoRA dropout), batched with mlx-lm's decoder
(engine/forward/generation.py), each prompt prefilled once for its group and its KV cache
copied to the G rows, as training shares the prompt.

Sampling is TRL's: logits at ``temperature``, then ``top_p`` (nucleus) on the tempered
distribution, each decode step's draw for the whole batch from an explicit key split off
``seed``'s (no global RNG): the same seed, prompts, policy and ``batch_size`` (a row's draws
depend on the rows decoded beside it) give the same completions on one mlx-lm version.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.forward.generation import decode_groups
from engine.losses.rollout_settings import RolloutSettings

__all__ = ["RolloutSettings", "Rollouts", "keyed_sampler", "sample_groups"]


@dataclass(frozen=True)
class Rollouts:
    """The completions of each prompt's group, group after group ([P·G] rows): their token
    ids (the stop token left out), the stop token each ended at (None: cut at
    ``max_completion_length``), and the work it took."""

    tokens: list[list[int]]
    stop_tokens: list[int | None]  # the stop token each ended at, None where cut at the limit
    generated: int
    seconds: float

    @property
    def stopped(self) -> list[bool]:
        return [t is not None for t in self.stop_tokens]

    @property
    def tokens_per_sec(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else 0.0

    @property
    def clipped_ratio(self) -> float:
        """TRL's ``completions/clipped_ratio``: the share cut at the length limit."""
        return 1 - sum(self.stopped) / max(len(self.stopped), 1)

    @property
    def mean_length(self) -> float:
        """TRL's ``completions/mean_length``: its stop token counted (TRL's completion mask
        holds the first EOS: the policy learns to end)."""
        return (sum(map(len, self.tokens)) + sum(self.stopped)) / max(len(self.tokens), 1)


def keyed_sampler(temperature: float, top_p: float, seed: int
                  ) -> Callable[[mx.array], mx.array]:
    """A sampler of log-probs [B, V] → tokens [B] at ``temperature`` and ``top_p``, each
    call drawing with the next key split off ``seed``'s."""
    from mlx_lm.sample_utils import apply_top_p

    key = [mx.random.key(seed)]

    def sample(logprobs: mx.array) -> mx.array:
        key[0], draw = mx.random.split(key[0])
        scaled = logprobs * (1.0 / temperature)  # temperature first, then the nucleus: TRL's
        if top_p < 1:
            scaled = apply_top_p(scaled - mx.logsumexp(scaled, axis=-1, keepdims=True), top_p)
        return mx.random.categorical(scaled, key=draw)

    return sample


def sample_groups(model: nn.Module, tokenizer, prompts: Sequence[Sequence[int]],
                  settings: RolloutSettings, batch_size: int = 32) -> Rollouts:
    """``settings.num_generations`` sampled completions of each of ``prompts`` (token ids),
    ``batch_size`` rows decoded at a time."""
    g = settings.num_generations
    groups = [[list(map(int, p))] * g for p in prompts]  # one prefill a group: least=1
    sampler = keyed_sampler(settings.temperature, settings.top_p, settings.seed)
    tokens, stops, generated, seconds = decode_groups(
        model, tokenizer, groups, settings.max_completion_length, batch_size, sampler, least=1)
    return Rollouts(tokens, stops, generated, seconds)
