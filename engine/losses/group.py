"""The group losses' protocol, beside the pair losses' (engine/losses/base.py): what a loss
over G sampled completions per prompt reads (``GroupLogps``), returns (``GroupTerms``) and
how rewards become advantages (``group_advantages``), with TRL's GRPOTrainer names.

A group is the G completions of one prompt, its rows consecutive: rows g·G … g·G + G − 1.
Per-token log-probs are of the completion tokens only ([N, T], N = groups × G, T the longest
completion, ``mask`` 1 on real tokens). ``old_logps`` are the log-probs the completions were
sampled under (μ > 1 updates per batch of rollouts); None at μ = 1, where they are the
policy's own, detached, and the ratio is 1. ``ref_logps`` are the reference's (β > 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from engine.losses.base import LossSettings

SCALE_REWARDS = ("group", "batch", "none")  # TRL's scale_rewards
STD_EPS = 1e-4  # TRL's: Â = (r − mean) / (std + 1e-4)


@dataclass(frozen=True)
class GroupLogps:
    """One micro-batch of groups: per-token log-probs [N, T] (float32), their mask [N, T],
    each completion's advantage [N], and the old and reference log-probs [N, T] or None."""

    logps: mx.array
    mask: mx.array
    advantages: mx.array
    old_logps: mx.array | None = None
    ref_logps: mx.array | None = None


@dataclass(frozen=True)
class GroupTerms:
    """A group loss's outputs: the scalar loss and its metrics (scalars, TRL's names)."""

    loss: mx.array
    metrics: dict[str, mx.array] = field(default_factory=dict)


class GroupLossSettings(LossSettings):
    """A loss over groups of sampled completions (GRPO's family): its settings validated as
    a pair loss's are, its maths ``group_terms``."""

    on_groups = True
    mean_rewards = False  # its val/ metrics are rewards of completions, not of pairs

    def group_terms(self, gl: GroupLogps, max_completion_length: int,
                    batch_tokens: float | None = None) -> GroupTerms:
        raise NotImplementedError(f"loss {self.kind} has no group terms")


def group_advantages(rewards: mx.array, num_generations: int,
                     scale_rewards: str = "group") -> tuple[mx.array, dict[str, mx.array]]:
    """Each completion's advantage [N] from its reward [N] (GRPO, Shao et al. 2024, Eq. 3 of
    its outcome supervision): Â_i = r_i − mean(r of its group), divided by the group's std
    + 1e-4 (``group``), the batch's (``batch``) or nothing (``none``: Dr. GRPO). The std is
    Bessel-corrected, as torch's. Returns the advantages and TRL's reward metrics:
    ``reward`` (the mean), ``reward_std`` (the groups' mean std; the batch's under
    ``batch``), ``frac_reward_zero_std`` (groups whose G rewards are equal: no signal;
    under ``batch``, 1 where the whole batch's are)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: expected one of {SCALE_REWARDS}")
    n = rewards.shape[0]
    if num_generations < 2 or n % num_generations:
        raise ValueError(f"num_generations={num_generations}: a group needs at least 2 "
                         f"completions, and {n} rewards are not whole groups of it")
    r = rewards.astype(mx.float32).reshape(-1, num_generations)  # [groups, G]
    mean = r.mean(axis=1, keepdims=True)
    std = mx.sqrt(((r - mean) ** 2).sum(axis=1, keepdims=True) / (num_generations - 1))
    advantages = r - mean
    if scale_rewards == "batch":  # TRL then logs the batch's std, and its zero, too
        flat = r.reshape(-1)
        std = mx.broadcast_to(mx.sqrt(((flat - flat.mean()) ** 2).sum() / max(n - 1, 1)),
                              std.shape)
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    metrics = {"reward": r.mean(), "reward_std": std.mean(),
               # torch.isclose(std, 0)'s atol, as TRL counts them
               "frac_reward_zero_std": (std[:, 0] <= 1e-8).astype(mx.float32).mean()}
    return advantages.reshape(-1), metrics
