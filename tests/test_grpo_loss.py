"""Issue 68, step 1: the GRPO loss family (engine/losses/grpo.py) and group advantages
(engine/losses/group.py) against a float64 numpy reference of TRL's GRPOTrainer formulas,
within 1e-6; and each loss type's gradient equal to the policy-gradient estimator it stands
for, on a hand-made group under a softmax policy.

Tolerances: the loss in float32 against float64, 1e-6 absolute and relative (measured
2026-12-06 on CPU: below 2e-7); the gradient, 1e-6 (measured: below 1e-7).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.losses.group import GroupLogps, group_advantages
from engine.losses.grpo import LOSS_TYPES, Grpo

pytestmark = pytest.mark.unit
G, GROUPS, T, MAX_LEN = 4, 3, 7, 9


def reference_advantages(r: np.ndarray, g: int, scale: str) -> np.ndarray:
    """TRL's: r − the group's mean, over its std (ddof 1, torch's) + 1e-4."""
    grouped = r.reshape(-1, g)
    adv = grouped - grouped.mean(axis=1, keepdims=True)
    if scale == "group":
        adv = adv / (grouped.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    elif scale == "batch":
        adv = adv / (r.std(ddof=1) + 1e-4)
    return adv.reshape(-1)


def reference_loss(logps, old, ref, mask, adv, beta, eps, eps_high, kind, batch_tokens=None):
    """TRL's ``_compute_loss`` in float64 (module docstring of engine/losses/grpo.py)."""
    ratio = np.exp(logps - old)
    a = adv[:, None]
    per_token = -np.minimum(ratio * a, np.clip(ratio, 1 - eps, 1 + eps_high) * a)
    kl = np.exp(ref - logps) - (ref - logps) - 1
    per_token = per_token + beta * kl
    masked = per_token * mask
    if kind == "grpo":
        loss = (masked.sum(-1) / np.maximum(mask.sum(-1), 1)).mean()
    elif kind == "dr_grpo":
        loss = masked.sum() / (mask.shape[0] * MAX_LEN)
    else:
        loss = masked.sum() / (batch_tokens or mask.sum())
    low = (ratio < 1 - eps) & (a < 0)
    high = (ratio > 1 + eps_high) & (a > 0)
    share = [(m * mask).sum() / mask.sum() for m in (low | high, low, high)]
    return loss, (kl * mask).sum() / mask.sum(), share


def batch(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = G * GROUPS
    lengths = rng.integers(1, T + 1, n)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
    logps = -rng.exponential(1.0, (n, T))
    return {"logps": logps, "old": logps + rng.normal(0, 0.3, (n, T)),  # ratios past the clip
            "ref": logps + rng.normal(0, 0.2, (n, T)), "mask": mask,
            "rewards": rng.integers(0, 3, n).astype(np.float64)}


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls(scale: str) -> None:
    b = batch(0)
    rewards = b["rewards"].copy()
    rewards[:G] = 1.0  # one group of equal rewards: no signal, counted
    got, metrics = group_advantages(mx.array(rewards), G, scale)
    want = reference_advantages(rewards, G, scale)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-6, atol=1e-6)
    # TRL's metrics: the groups' std, or under scale_rewards batch the batch's
    stds = (np.full(GROUPS, rewards.std(ddof=1)) if scale == "batch"
            else rewards.reshape(-1, G).std(axis=1, ddof=1))
    assert float(metrics["frac_reward_zero_std"]) == pytest.approx(np.mean(stds == 0))
    assert float(metrics["reward"]) == pytest.approx(rewards.mean(), rel=1e-6)
    assert float(metrics["reward_std"]) == pytest.approx(stds.mean(), rel=1e-6)
    with pytest.raises(ValueError, match="num_generations=5"):
        group_advantages(mx.array(rewards), 5, scale)


@pytest.mark.parametrize("kind", LOSS_TYPES)
@pytest.mark.parametrize("eps_high", [0.0, 0.28])
def test_each_loss_type_is_trls_formula_in_float64(kind: str, eps_high: float) -> None:
    """Would catch: a wrong normaliser (per completion, per batch, constant), the clip on
    the wrong side or with ε for ε_high, the KL's sign or estimator, a mask left out."""
    for seed in (1, 2):
        b = batch(seed)
        adv = reference_advantages(b["rewards"], G, "group")
        loss = Grpo(grpo_beta=0.04, grpo_epsilon=0.2, grpo_epsilon_high=eps_high,
                    grpo_loss_type=kind)
        tokens = b["mask"].sum() * 2.5 if kind == "dapo" else None  # a batch of micro-batches
        gl = GroupLogps(*(mx.array(b[k].astype(np.float32)) for k in ("logps", "mask")),
                        mx.array(adv.astype(np.float32)), mx.array(b["old"].astype(np.float32)),
                        mx.array(b["ref"].astype(np.float32)))
        terms = loss.group_terms(gl, MAX_LEN, tokens)
        want, kl, clip = reference_loss(b["logps"], b["old"], b["ref"], b["mask"], adv, 0.04,
                                        0.2, eps_high or 0.2, kind, tokens)
        assert float(terms.loss) == pytest.approx(want, rel=1e-6, abs=1e-6), (kind, seed)
        assert float(terms.metrics["kl"]) == pytest.approx(kl, rel=1e-6, abs=1e-6)
        for name, share in zip(("region", "low", "high"), clip, strict=True):
            assert float(terms.metrics[f"clip_ratio/{name}_mean"]) == pytest.approx(
                share, abs=1e-6), name
        assert 0 < clip[1] < clip[0] and 0 < clip[2] < clip[0]  # both sides of the clip


def softmax_policy_grads(kind: str) -> tuple[np.ndarray, np.ndarray, float]:
    """A policy π = softmax(θ) over 5 tokens and one group of G completions of its tokens;
    the loss's gradient in θ by MLX, and by hand the policy-gradient estimator it stands for
    (μ = 1: ρ = 1; β = 0): −Σ_i Â_i Σ_t w_{i,t} ∇θ log π(o_{i,t}), with w the loss type's
    weight of a token (grpo 1/(N|o_i|), dapo and bnpo 1/Σ|o|, dr_grpo 1/(N·L))."""
    theta = np.array([0.3, -0.2, 0.5, 0.0, -0.7])
    tokens = [[0, 2, 2], [1], [4, 3, 0, 2], [2, 2]]  # one group, lengths 3, 1, 4, 2
    rewards = np.array([1.0, 0.0, 0.0, 1.0])
    adv = reference_advantages(rewards, G, "group")
    n, t = len(tokens), max(map(len, tokens))
    ids = np.zeros((n, t), np.int32)
    mask = np.zeros((n, t), np.float32)
    for i, seq in enumerate(tokens):
        ids[i, :len(seq)], mask[i, :len(seq)] = seq, 1
    loss = Grpo(grpo_loss_type=kind)

    def value(th: mx.array) -> mx.array:
        logp = th - mx.logsumexp(th)
        per_token = logp[mx.array(ids)]  # [N, T]
        gl = GroupLogps(per_token, mx.array(mask), mx.array(adv.astype(np.float32)))
        return loss.group_terms(gl, MAX_LEN).loss

    got = np.array(mx.grad(value)(mx.array(theta.astype(np.float32))))
    pi = np.exp(theta - np.log(np.exp(theta).sum()))
    weight = {"grpo": lambda i: 1 / (n * len(tokens[i])), "dr_grpo": lambda i: 1 / (n * MAX_LEN),
              "dapo": lambda i: 1 / mask.sum(), "bnpo": lambda i: 1 / mask.sum()}[kind]
    want = np.zeros_like(theta)
    for i, seq in enumerate(tokens):
        for tok in seq:
            want -= adv[i] * weight(i) * (np.eye(5)[tok] - pi)  # ∇θ log π(tok) = e_tok − π
    return got, want, float(value(mx.array(theta.astype(np.float32))))


@pytest.mark.parametrize("kind", LOSS_TYPES)
def test_each_loss_types_gradient_is_its_policy_gradient(kind: str) -> None:
    """At μ = 1 the ratio is 1 and the loss's gradient is the policy gradient; for grpo the
    loss itself is 0 (each group's advantages sum to 0), its gradient not. Would catch: a
    ratio whose old log-probs are not detached (its gradient would vanish), a normaliser
    other than the loss type's, advantages of the wrong sign."""
    got, want, value = softmax_policy_grads(kind)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.abs(want).max() > 1e-2  # a gradient worth comparing
    if kind == "grpo":
        assert value == pytest.approx(0.0, abs=1e-7)


def test_settings_are_refused_by_name() -> None:
    for bad, named in (({"grpo_epsilon": 1.5}, "grpo_epsilon=1.5"),
                       ({"grpo_loss_type": "ppo"}, "grpo_loss_type='ppo'"),
                       ({"grpo_num_iterations": 0}, "grpo_num_iterations=0"),
                       ({"grpo_beta": -0.1}, "grpo_beta=-0.1"),
                       ({"grpo_scale_rewards": "std"}, "grpo_scale_rewards='std'")):
        with pytest.raises(ValueError, match=named):
            Grpo(**bad)
    assert Grpo().epsilon_high == 0.2 and Grpo(grpo_epsilon_high=0.28).epsilon_high == 0.28
    gl = GroupLogps(mx.zeros((4, 2)), mx.ones((4, 2)), mx.zeros((4,)))
    with pytest.raises(ValueError, match="needs reference log-probs"):
        Grpo(grpo_beta=0.1).group_terms(gl, 2)


@pytest.mark.unit
@pytest.mark.parametrize("kind", LOSS_TYPES)
def test_padding_log_probs_far_from_the_old_ones_stay_out_of_the_loss(kind: str) -> None:
    """A padding position whose log-prob is 0 (the bounded head's) against an old or
    reference log-prob of −200 (exp(200) overflows float32): the loss and its gradient
    are finite and those of the same batch with the padding's log-probs equal."""
    logps = mx.array([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = mx.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    far = mx.array([[-1.2, -1.9, -200.0], [-0.4, -200.0, -200.0]])
    near = mx.where(mask > 0, far, logps)
    loss = Grpo(grpo_loss_type=kind, grpo_beta=0.04, grpo_num_iterations=2)

    def value(lp, old):
        gl = GroupLogps(lp, mask, mx.array([1.0, -1.0]), old, old)
        return loss.group_terms(gl, 4).loss

    got, grad = mx.value_and_grad(value)(logps, far)
    want, want_grad = mx.value_and_grad(value)(logps, near)
    assert np.isfinite(float(got)) and float(got) == pytest.approx(float(want), rel=1e-6)
    assert np.allclose(np.array(grad), np.array(want_grad), atol=1e-7)
