"""Prefix-shared forward vs two forwards: same loss, same LoRA gradients.

Tolerance as tests/test_segmented.py: max |g − g_ref| ≤ 1e-5 · max |g_ref| per tensor
(float32); the shared path changes which positions attention sums over, never the values.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.backward.segmented import value_and_grad
from engine.data.batch import Pair, batch_norms, make_batch
from engine.forward.prefix import PrefixBatch, split_prefix_batch
from engine.losses import PAIR_LOSSES, LossSpec, pair_loss, spec_of
from tests.pairs import tokenized_pairs
from tests.parity import assert_same, batch_loss, lora_model, with_reference

pytestmark = pytest.mark.integration


def run(model, stack, batch, pairs_batch, spec, k=0, chunk=0):
    return value_and_grad(model, stack, batch, batch_loss(model, stack, pairs_batch, spec),
                          k, chunk)


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_q4"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("span", ["full", "response"])
def test_shared_equals_two_forwards(fixture: str, n: int, span: str, request) -> None:
    path = request.getfixturevalue(fixture)
    model, stack = lora_model(path)
    pairs = tokenized_pairs(path, n, seed=5 + n)  # ragged prompts and responses
    two = make_batch(pairs, span)
    shared = split_prefix_batch(pairs, span, attention="mask")
    assert shared is not None and shared.fed < two.tokens
    spec = spec_of("orpo", span, orpo_lambda=0.3)
    ref = run(model, stack, two, two, spec)
    for k, chunk in ((0, 0), (0, 16), (1, 0), (1, 16), (2, 0), (2, 16)):
        assert_same(run(model, stack, shared, shared.pairs, spec, k, chunk), ref)


def test_rope_positions_and_mask_really_matter(tiny_model: Path) -> None:
    """Guard against a vacuous pass: a wrong layout must change the loss."""
    model, stack = lora_model(tiny_model)
    pairs = tokenized_pairs(tiny_model, 2, seed=9)
    two = make_batch(pairs, "full")
    shared = split_prefix_batch(pairs, "full", attention="mask")
    spec = LossSpec()
    ref_result = run(model, stack, two, two, spec)
    ref = float(ref_result[0])
    leaky = shared.mask.copy()
    leaky[:, 0] = np.tril(np.ones(leaky.shape[-2:], bool))  # rejected may see chosen
    broken = type(shared)(shared.pairs, shared.inputs, leaky, shared.rejected, shared.shift,
                          shared.gather, shared.fed)
    assert float(run(model, stack, broken, broken.pairs, spec)[0]) != pytest.approx(ref,
                                                                                    rel=1e-5)
    unshifted = type(shared)(shared.pairs, shared.inputs, shared.mask, shared.rejected,
                             np.zeros_like(shared.shift), shared.gather, shared.fed)
    # A random tiny model attends almost uniformly, so positions barely move the loss;
    # the parity tolerance (tests/test_segmented.py) still catches the difference.
    with pytest.raises(AssertionError):
        assert_same(run(model, stack, unshifted, unshifted.pairs, spec), ref_result)


@pytest.mark.unit
def test_mismatched_prompts_fall_back() -> None:
    pairs = [Pair("a", [1, 2], [3], [4]), Pair("b", [1, 5], [6], [7])]
    assert split_prefix_batch(pairs, prompts=[([1, 2], [1, 2]), ([1, 5], [1, 5])]) is not None
    assert split_prefix_batch(pairs, prompts=[([1, 2], [1, 2]), ([1, 5], [1, 9])]) is None


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_qwen2"])
@pytest.mark.parametrize("pad", [1, 16])
def test_split_attention_equals_two_forwards(fixture: str, pad: int, request) -> None:
    """Two fused causal calls per layer (one row) give the two-forward loss and grads."""
    path = request.getfixturevalue(fixture)
    model, stack = lora_model(path)
    pairs = tokenized_pairs(path, 1, seed=11)
    two = make_batch(pairs, "full")
    spec = LossSpec()
    ref = run(model, stack, two, two, spec)
    shared = split_prefix_batch(pairs, "full", pad_multiple=pad, attention="split")
    tail = len(pairs[0].prompt) - shared.split.shared
    assert tail == 0 if pad == 1 else 0 < tail < pad  # 16: a tail runs in both branches
    for k, chunk in ((0, 0), (1, 16), (2, 0)):
        assert_same(run(model, stack, shared, shared.pairs, spec, k, chunk), ref)
    assert shared.mask is None  # split attention never builds the [L, L] array
    masked = split_prefix_batch(pairs, "full", pad_multiple=pad, attention="mask")
    assert masked.mask is not None
    assert_same(run(model, stack, masked, masked.pairs, spec), ref)


@pytest.mark.parametrize("pad", [1, 16])
def test_batched_split_rows_share_one_geometry_and_equal_two_forwards(tiny_model: Path,
                                                                      pad: int) -> None:
    """Ragged rows in one split layout: the shortest prompt sets the shared part, the
    other prompts' tails run in both branches; loss and grads as two forwards."""
    model, stack = lora_model(tiny_model)
    pairs = tokenized_pairs(tiny_model, 3, seed=13)
    longer = pairs[1]  # a prompt 20 tokens longer: its tail outgrows the padding
    pairs[1] = Pair(longer.id, [*longer.prompt, *longer.prompt[1:21]], longer.chosen,
                    longer.rejected)
    two = make_batch(pairs, "full")
    ref = run(model, stack, two, two, LossSpec())
    shared = split_prefix_batch(pairs, "full", pad_multiple=pad, attention="split")
    assert shared.inputs.shape[0] == 3 and shared.mask is None
    assert shared.split.shared == min(len(p.prompt) for p in pairs) // pad * pad
    assert max(len(p.prompt) for p in pairs) - shared.split.shared > max(pad, 16)
    for k, chunk in ((0, 0), (1, 16), (2, 0)):
        assert_same(run(model, stack, shared, shared.pairs, LossSpec(), k, chunk), ref)


def test_cuda_takes_split_attention_only_when_aligned(monkeypatch) -> None:
    """Unaligned split shapes crashed MLX's CUDA attention backward: mask there, or refuse."""
    from engine.forward import layout_policy as policy

    assert policy.resolve_prefix_attention("split", 1) == "split"  # CPU: as asked
    monkeypatch.setattr(policy, "is_cuda", lambda: True)
    assert policy.resolve_prefix_attention("auto", 128) == "auto"
    assert policy.resolve_prefix_attention("split", 256) == "split"
    assert policy.resolve_prefix_attention("auto", 64) == "mask"
    assert policy.resolve_prefix_attention("mask", 1) == "mask"
    with pytest.raises(ValueError, match="needs pad_multiple a multiple of 128 on CUDA"):
        policy.resolve_prefix_attention("split", 1)


@pytest.mark.unit
@pytest.mark.parametrize("pad", [1, 8, 128])
@pytest.mark.parametrize("p", [1, 7, 8, 9, 130, 300])
def test_split_layout_is_aligned_and_gathers_both_sequences(pad: int, p: int) -> None:
    """Every split attention length is a multiple of ``pad``; the gather rebuilds both
    two-forward input rows token for token; the prompt tail (< pad) runs in both branches."""
    rng = np.random.default_rng(p)
    pair = Pair("x", rng.integers(3, 99, p).tolist(), rng.integers(3, 99, 11).tolist(),
                rng.integers(3, 99, 5).tolist())
    two = make_batch([pair], "full", pad)
    b = split_prefix_batch([pair], "full", pad, attention="split", two=two)
    s, a, width = b.split.shared, b.split.first, b.inputs.shape[1]
    assert b.mask is None
    assert s % pad == a % pad == width % pad == 0 and p - s < max(pad, 1) and s <= p
    assert b.fed == s + 2 * (p - s) + 11 + 5 - 2  # each branch's last token is never fed
    flat = b.inputs.reshape(-1)
    for row in range(2):
        n = int((two.resp_mask[row] > 0).nonzero()[0].max()) + 1  # inputs that predict
        assert (flat[b.gather[row, :n]] == two.inputs[row, :n]).all()
    # rope positions: the rejected branch continues the shared prefix
    assert b.shift[0] == s - a


@pytest.mark.parametrize("rejected", [1, 2])
def test_split_attention_with_an_aligned_prompt_and_a_tiny_response(tiny_model: Path,
                                                                    rejected: int) -> None:
    """No prompt tail and a 1-token rejected response: nothing of that branch is fed."""
    model, stack = lora_model(tiny_model)
    src = tokenized_pairs(tiny_model, 1, seed=3)[0]
    prompt = (list(src.prompt) * 8)[:32]
    pairs = [Pair("edge", prompt, list(src.chosen), list(src.rejected)[:rejected])]
    two = make_batch(pairs, "full")
    shared = split_prefix_batch(pairs, "full", pad_multiple=16, attention="split")
    assert shared.split.shared == 32
    assert (shared.split.first == shared.inputs.shape[1]) == (rejected == 1)
    ref = run(model, stack, two, two, LossSpec())
    for k, chunk in ((0, 0), (1, 16)):
        assert_same(run(model, stack, shared, shared.pairs, LossSpec(), k, chunk), ref)


@pytest.mark.unit
def test_cuda_auto_takes_aligned_split_from_2k_tokens(monkeypatch) -> None:
    """auto on CUDA: split where measured faster (≥ 2048 tokens a micro-batch), two
    forwards below, never the array mask; CPU: split, else the mask, where it saves enough
    of the padded tokens."""
    from engine.forward import layout_policy as policy
    from engine.settings.config import TrainConfig

    def pair(prompt: int) -> Pair:
        return Pair("x", list(range(3, 3 + prompt)), [5] * (prompt // 4), [6] * (prompt // 4))

    cfg = TrainConfig(prefix_share="auto")
    long, short = [pair(4 * 1640)], [pair(4 * 205)]  # ~8k and ~1k tokens per sequence
    assert policy.choose_layout(short * 2, cfg, 1, 0).split is not None  # CPU: split first
    ragged = [Pair("a", [3] * 4, [5, 5], [6, 6]), Pair("b", [4] * 100, [5, 5], [6, 6])]
    assert policy.choose_layout(ragged, cfg, 1, 0).mask is not None  # tails cost too much
    long_answers = [Pair("c", [3] * 4, [5] * 40, [6] * 40)]
    assert not isinstance(policy.choose_layout(long_answers, cfg, 1, 0), PrefixBatch)
    monkeypatch.setattr(policy, "is_cuda", lambda: True)
    assert isinstance(policy.choose_layout(long, cfg, 128, 0), PrefixBatch)
    assert policy.choose_layout(long, cfg, 128, 0).split is not None
    assert not isinstance(policy.choose_layout(short, cfg, 128, 0), PrefixBatch)
    assert policy.choose_layout(long * 2, cfg, 128, 0).split is not None  # rows: split too
    assert policy.choose_layout(short * 2, cfg, 128, 0).split is not None  # 2 × 1k tokens
    on = TrainConfig(prefix_share="on")
    assert isinstance(policy.choose_layout(short, on, 128, 0), PrefixBatch)


@pytest.mark.unit
@pytest.mark.parametrize("p", [5, 16, 37])
def test_split_layout_slices_match_the_gather_and_its_scatter(p: int) -> None:
    """to_pair_layout / from_pair_layout by slices == by the gather index (and scatter-add),
    for ragged rows (prompts p and p + 11, responses of different lengths)."""
    from engine.forward.prefix import from_pair_layout, to_pair_layout

    pairs = [Pair("x", list(range(3, 3 + p)), [7] * 9, [8] * 4),
             Pair("y", list(range(4, 15 + p)), [7] * 2, [8] * 13)]
    b = split_prefix_batch(pairs, "full", 8, attention="split")
    rows, length = b.inputs.shape
    t = b.gather.shape[1]
    h = mx.random.normal((rows, length, 6), key=mx.random.key(p))
    by_index = h.reshape(rows * length, 6)[mx.array(b.gather)]
    live = np.zeros((2 * rows, t, 1), np.float32)  # positions the loss reads; pads get none
    for i, pr in enumerate(pairs):
        live[i, : len(pr.prompt) + len(pr.chosen) - 1] = 1
        live[rows + i, : len(pr.prompt) + len(pr.rejected) - 1] = 1
    got = to_pair_layout(h, b)
    assert mx.array_equal(got * mx.array(live), by_index * mx.array(live))
    cot = mx.random.normal((2 * rows, t, 6), key=mx.random.key(p + 1)) * mx.array(live)
    ref = mx.zeros((rows * length, 6)).at[mx.array(b.gather.reshape(-1))].add(
        cot.reshape(-1, 6))
    assert mx.allclose(from_pair_layout(cot, b), ref.reshape(rows, length, 6), atol=1e-6)


@pytest.mark.parametrize("head_chunk", [0, 16])
def test_scoring_shares_the_prefix_and_keeps_row_order(tiny_model: Path, head_chunk: int) -> None:
    """Forward-only scoring (validation, `pomona score`): the shared layouts give the two
    forwards' per-pair scores, in the data's order although batches go by length.
    Tolerance: 1e-5 absolute on mean log-probs of order 1 (float32)."""
    from engine.forward.scoring import evaluate, score_pairs

    model, stack = lora_model(tiny_model)
    pairs = tokenized_pairs(tiny_model, 7, seed=21)
    ref = score_pairs(model, stack, pairs, spec_of("orpo", orpo_lambda=0.3), 3, head_chunk)  # two
    assert [r["id"] for r in ref] == [p.id for p in pairs]
    layouts = {"mask": lambda g: split_prefix_batch(g, "full", attention="mask"),
               "split": lambda g: split_prefix_batch(g, "full", pad_multiple=8,
                                                     attention="split")}
    for name, layout in layouts.items():
        got = score_pairs(model, stack, pairs, spec_of("orpo", orpo_lambda=0.3), 3, head_chunk,
                          layout)
        assert [r["id"] for r in got] == [p.id for p in pairs]
        for a, b in zip(got, ref, strict=True):
            for key in ("chosen_logp_mean", "rejected_logp_mean", "nll", "loss"):
                assert a[key] == pytest.approx(b[key], abs=1e-5), (name, key, a["id"])
    spec = spec_of("orpo", "response", orpo_lambda=0.3)
    plain = evaluate(model, stack, pairs, spec, 3, head_chunk=head_chunk)
    shared = evaluate(model, stack, pairs, spec, 3, head_chunk=head_chunk,
                      layout=lambda g: split_prefix_batch(g, "response", attention="mask"))
    assert shared == pytest.approx(plain, abs=1e-5) and plain["rows"] == 7
    from engine.forward.layout_policy import scoring_layout

    with pytest.raises(ValueError, match="prefix_share='maybe'"):
        scoring_layout("maybe", 0)


# Every registered loss at its defaults (the response span), and variants of SimPO and DPO.
LEVER_SPECS = [*(spec_of(kind, "response") for kind in sorted(PAIR_LOSSES) if kind != "orpo"),
               spec_of("simpo", simpo_nll_weight=0.5),
               spec_of("dpo", "response", dpo_beta=0.5, dpo_label_smoothing=0.1,
                       rpo_alpha=0.3),
               spec_of("dpo", dpo_beta=0.5, dpo_loss_type="ipo")]


@pytest.mark.parametrize("spec", LEVER_SPECS, ids=lambda s: f"{s.kind}-{s.nll_span}")
def test_every_loss_runs_every_lever_unchanged(tiny_model: Path, spec: LossSpec) -> None:
    """Each loss (ORPO: the tests above; DPO with label smoothing and rpo_alpha, and IPO)
    through the segmented backward, the bounded head and both shared layouts equals
    autograd over two forwards: that code sees only the scalar loss of the token log-probs,
    so a new loss needs no change there. DPO's reference log-probs ride in the shared
    layout's pairs (``PrefixBatch.pairs.ref``) in the two forwards' row order."""
    model, stack = lora_model(tiny_model)
    pairs = with_reference(model, stack, tokenized_pairs(tiny_model, 3, seed=17))
    two = make_batch(pairs, spec.nll_span)
    ref = run(model, stack, two, two, spec)
    assert_same(run(model, stack, two, two, spec, 1, 16), ref)
    for attention, pad in (("split", 8), ("mask", 0)):
        shared = split_prefix_batch(pairs, spec.nll_span, pad, attention=attention)
        assert np.array_equal(shared.pairs.ref, two.ref)
        for k, chunk in ((0, 0), (1, 16), (2, 0)):
            assert_same(run(model, stack, shared, shared.pairs, spec, k, chunk), ref)


READ_ATOL = 1e-5  # float32 log-probs of the same rows: only the matmul's blocking differs


@pytest.mark.parametrize("layout", ["two", "shared"])
@pytest.mark.parametrize("head_chunk", [0, 7])
def test_scoring_reads_only_the_positions_asked_for(tiny_model: Path, layout: str,
                                                    head_chunk: int) -> None:
    """engine/forward/scoring.forward_logps with ``active`` (the head on read positions alone, as
    evaluation calls it) equals the whole head there, to READ_ATOL, and is 0 elsewhere;
    and the metrics evaluation reports from it equal the whole head's."""
    from engine.forward.scoring import evaluate, forward_logps, read_positions

    model, stack = lora_model(tiny_model)
    pairs = tokenized_pairs(tiny_model, 3, seed=11)
    two = make_batch(pairs, "response")
    batch = two if layout == "two" else split_prefix_batch(pairs, "response",
                                                           attention="mask")
    active = read_positions(two.resp_mask, two.nll_mask)
    assert 0 < active.sum() < active.size / 2  # prompts and pads are most positions
    whole = np.array(forward_logps(model, stack, batch, head_chunk))
    read = np.array(forward_logps(model, stack, batch, head_chunk, active))
    np.testing.assert_allclose(read[active], whole[active], rtol=0, atol=READ_ATOL)
    assert not read[~active].any()
    spec = spec_of("orpo", "response", orpo_lambda=0.3)
    got = evaluate(model, stack, pairs, spec, 3, head_chunk=head_chunk,
                   layout=lambda g: batch)
    # the naive path: the whole head's log-probs through the same loss
    lp = mx.array(whole)
    _, metrics = pair_loss(lp, mx.array(two.resp_mask), mx.array(two.nll_mask), spec,
                           batch_norms([two]), two.ref_array())
    for k in ("logps/chosen", "logps/rejected", "log_odds_ratio"):
        assert got[k] == pytest.approx(float(metrics[k]) / len(pairs), abs=1e-5), k
