"""GRPO (Shao et al. 2024) and the losses that renormalise it: Dr. GRPO (Liu et al. 2025),
DAPO (Yu et al. 2025) and BNPO, as TRL's GRPOTrainer ``_compute_loss``.

Per completion token t of completion i, with ρ = exp(logp − old) (1 at μ = 1) and Â_i its
group advantage (engine/losses/group.py):
    ℓ_{i,t} = −min(ρ·Â_i, clip(ρ, 1 − ε, 1 + ε_high)·Â_i) + β·KL_{i,t}      (Eq. 3)
    KL_{i,t} = exp(ref − logp) − (ref − logp) − 1                          (Eq. 4, k3)
and the loss, over the completion mask M:
    grpo:    mean_i( Σ_t M·ℓ / Σ_t M )            each completion's token mean, then the mean
    bnpo:    Σ M·ℓ / Σ M                          the micro-batch's token mean
    dapo:    Σ M·ℓ / (the batch's tokens)         token mean over the whole optimizer batch
    dr_grpo: Σ M·ℓ / (N · max_completion_length)  a constant normaliser: no length bias
Metrics (TRL's): ``kl`` (the token mean of KL, when β > 0), ``clip_ratio/region_mean`` (the
share of tokens whose clipped term was taken), ``clip_ratio/low_mean`` (ρ < 1 − ε, Â < 0)
and ``clip_ratio/high_mean`` (ρ > 1 + ε_high, Â > 0).

Its rollout and reward settings are TRL's names unprefixed (``num_generations``,
``temperature``, ``top_p``, ``max_completion_length``, ``reward``, ``reward_weights``),
declared in engine/losses/sampled.py, which a pair loss's online pairs read too.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.losses.base import setting
from engine.losses.group import GroupLogps, GroupLossSettings, GroupTerms
from engine.losses.sampled import Sampled

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")


@dataclass(frozen=True)
class Grpo(GroupLossSettings, Sampled):
    kind = "grpo"
    summary = "grpo (G sampled completions per prompt, rewarded by a verifier)"
    extras = ("kl", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean")

    grpo_beta: float = setting(0.0, "GRPO: β, the KL penalty against the reference (TRL's "
                                    "beta; 0 skips the reference pass).", minimum=0)
    grpo_epsilon: float = setting(0.2, "GRPO: ε, the ratio's lower clip 1 − ε (TRL's "
                                       "epsilon).", above=0, below=1)
    grpo_epsilon_high: float = setting(0.0, "GRPO: the ratio's upper clip 1 + ε_high (TRL's "
                                            "epsilon_high; 0: ε, DAPO's clip-higher above "
                                            "it).", minimum=0)
    grpo_loss_type: str = setting("dapo", "GRPO: dapo (token mean over the batch), grpo "
                                          "(each completion's token mean), dr_grpo "
                                          "(a constant normaliser) or bnpo (TRL's "
                                          "loss_type).", choices=LOSS_TYPES)
    grpo_num_iterations: int = setting(1, "GRPO: μ, updates per batch of rollouts, against "
                                          "their sampling log-probs (TRL's num_iterations).",
                                       minimum=1)
    grpo_max_resample_rounds: int = setting(3, "GRPO, loss type dapo: rounds a group whose G "
                                               "rewards are all equal is sampled again "
                                               "(DAPO's dynamic sampling; 0: off).",
                                            minimum=0)
    grpo_scale_rewards: str = setting("group", "GRPO: divide advantages by the group's std "
                                               "(group), the batch's (batch) or not (none, "
                                               "Dr. GRPO) (TRL's scale_rewards).",
                                      choices=("group", "batch", "none"))

    @property
    def epsilon_high(self) -> float:
        return self.grpo_epsilon_high or self.grpo_epsilon

    def group_terms(self, gl: GroupLogps, max_completion_length: int,
                    batch_tokens: float | None = None) -> GroupTerms:
        """The loss of the micro-batch ``gl`` (module docstring); ``batch_tokens``: dapo's
        normaliser, the optimizer batch's completion tokens (None: this micro-batch's)."""
        logps, mask = gl.logps.astype(mx.float32), gl.mask.astype(mx.float32)
        adv = gl.advantages.astype(mx.float32)[:, None]  # [N, 1]
        old = mx.stop_gradient(logps) if gl.old_logps is None else gl.old_logps
        # A padding position's log-probs are of no token (the bounded head leaves them 0):
        # kept out of every exp, where 0 − old could overflow and 0 · inf poison the sums.
        live = mask > 0
        ratio = mx.exp(mx.where(live, logps - old, 0.0))
        low, high = 1 - self.grpo_epsilon, 1 + self.epsilon_high
        per_token = -mx.minimum(ratio * adv, mx.clip(ratio, low, high) * adv)
        tokens = mx.maximum(mask.sum(), 1.0)
        metrics: dict[str, mx.array] = {}
        if self.grpo_beta > 0:
            if gl.ref_logps is None:
                raise ValueError("loss grpo with grpo_beta > 0 needs reference log-probs: "
                                 "none were attached to this batch")
            delta = mx.where(live, gl.ref_logps.astype(mx.float32) - logps, 0.0)
            kl = mx.exp(delta) - delta - 1
            per_token = per_token + self.grpo_beta * kl
            metrics["kl"] = mx.stop_gradient((kl * mask).sum() / tokens)
        masked = per_token * mask
        loss = self._reduce(masked, mask, max_completion_length, batch_tokens)
        below = (ratio < low) & (adv < 0)
        above = (ratio > high) & (adv > 0)
        metrics.update({
            "clip_ratio/region_mean": ((below | above) * mask).sum() / tokens,
            "clip_ratio/low_mean": (below * mask).sum() / tokens,
            "clip_ratio/high_mean": (above * mask).sum() / tokens})
        return GroupTerms(loss, {k: mx.stop_gradient(v) for k, v in metrics.items()})

    def _reduce(self, masked: mx.array, mask: mx.array, max_completion_length: int,
                batch_tokens: float | None) -> mx.array:
        kind = self.grpo_loss_type
        if kind == "grpo":
            return (masked.sum(axis=-1) / mx.maximum(mask.sum(axis=-1), 1.0)).mean()
        if kind == "dr_grpo":
            return masked.sum() / (masked.shape[0] * max_completion_length)
        if kind == "dapo" and batch_tokens is not None:
            return masked.sum() / max(batch_tokens, 1.0)
        return masked.sum() / mx.maximum(mask.sum(), 1.0)  # bnpo; dapo over one micro-batch
