"""Issue 68, rollouts (engine/forward/rollouts.py): G sampled completions of each prompt,
the prompt prefilled once for its group, reproducible from the seed alone, and at a
vanishing temperature the greedy completion of the naive path (one prompt, token by
token: ``greedy_one``)."""

from __future__ import annotations

from pathlib import Path

import mlx_lm
import pytest

import engine.forward.generation as generation
from engine.forward.generation import greedy_batch, greedy_one
from engine.forward.rollouts import RolloutSettings, sample_groups

pytestmark = pytest.mark.integration
PROMPTS = [[1, 17, 3, 250, 99], [1, 4, 42], [1, 7, 300, 12, 8, 511, 64]]


@pytest.fixture(scope="module")
def loaded(tiny_model: Path):
    return mlx_lm.load(str(tiny_model))


def test_groups_are_reproducible_from_the_seed_and_prefilled_once(
        loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    """Would catch: a sampler on the global RNG (another run's draws change these), the
    groups out of order, a prompt prefilled once per row instead of once per group."""
    model, tokenizer = loaded
    prefills = []
    real = generation.shared_prefix_caches

    def counted(model, rows, least=8):
        shared, caches = real(model, rows, least)
        prefills.append((len(rows), shared))
        return shared, caches

    monkeypatch.setattr(generation, "shared_prefix_caches", counted)
    settings = RolloutSettings(num_generations=4, temperature=1.0, max_completion_length=6,
                               seed=3)
    first = sample_groups(model, tokenizer, PROMPTS, settings)
    assert prefills == [(4, len(p) - 1) for p in PROMPTS]  # one prefill a group, all shared
    assert len(first.tokens) == 12 and first.generated > 0 and first.tokens_per_sec > 0
    again = sample_groups(model, tokenizer, PROMPTS, settings)
    assert again.tokens == first.tokens and again.stopped == first.stopped
    other = sample_groups(model, tokenizer, PROMPTS,
                          RolloutSettings(4, 1.0, 1.0, 6, seed=4))
    assert other.tokens != first.tokens
    # a group's completions differ from one another (sampled, not one greedy answer x4)
    assert any(len({tuple(t) for t in first.tokens[i:i + 4]}) > 1 for i in (0, 4, 8))
    assert 0 <= first.clipped_ratio <= 1
    assert first.mean_length == sum(map(len, first.tokens)) / 12


def test_a_vanishing_temperature_is_the_greedy_path(loaded) -> None:
    """The decode shared with greedy evaluation (``decode_groups``), at temperature 1e-4
    with top_p, gives each row the naive path's greedy tokens; greedy_batch still does."""
    model, tokenizer = loaded
    cold = sample_groups(model, tokenizer, PROMPTS,
                         RolloutSettings(2, 1e-4, 0.9, 8, seed=0))
    for i, prompt in enumerate(PROMPTS):
        want = greedy_one(model, tokenizer, prompt, 8)
        assert cold.tokens[2 * i] == cold.tokens[2 * i + 1] == want, i
    assert greedy_batch(model, tokenizer, PROMPTS, 8).tokens == [
        greedy_one(model, tokenizer, p, 8) for p in PROMPTS]


@pytest.mark.unit
def test_rollout_settings_are_refused_by_name() -> None:
    for bad, named in (({"num_generations": 1}, "num_generations=1"),
                       ({"temperature": 0.0}, "temperature=0.0"),
                       ({"top_p": 0.0}, "top_p=0.0"),
                       ({"max_completion_length": 0}, "max_completion_length=0")):
        with pytest.raises(ValueError, match=named):
            RolloutSettings(**bad)


@pytest.mark.unit
def test_the_nucleus_is_taken_on_the_tempered_distribution() -> None:
    """TRL (HF's warpers, vLLM) applies the temperature, then top_p: at T = 2 the
    distribution (.5, .3, .2) flattens to (.41, .32, .26), whose top 0.8 holds all three
    tokens; top_p first would keep two. Would catch the reverse order (mlx-lm's)."""
    import math

    import mlx.core as mx

    from engine.forward.rollouts import Rollouts, keyed_sampler

    logprobs = mx.log(mx.array([[0.5, 0.3, 0.2]] * 4000))
    drawn = keyed_sampler(2.0, 0.8, seed=0)(logprobs).tolist()
    share = drawn.count(2) / len(drawn)
    want = math.sqrt(0.2) / sum(map(math.sqrt, (0.5, 0.3, 0.2)))
    assert share == pytest.approx(want, abs=0.03), share
    assert keyed_sampler(1.0, 0.8, seed=0)(logprobs).tolist().count(2) == 0  # .5 + .3 = .8
    # TRL's completions/mean_length counts the stop token (its mask holds the first EOS)
    assert Rollouts([[1, 2], [3]], [5, None], 4, 1.0).mean_length == 2.0  # (2 + 1 + 1) / 2
