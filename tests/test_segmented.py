"""Every memory lever against plain autograd: same loss, same LoRA gradients.

Tolerance (tests/parity.py): max |g − g_plain| ≤ 1e-5 · max |g_plain| per tensor, loss to
1e-6 relative (float32; the segmented path reorders no sums, the bounded head reorders
logsumexp only). DPO's pairs carry reference log-probs (``with_reference``): ``run`` hands
the batch's ``ref`` to the loss as the trainer does (the other losses ignore it).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.backward.segmented import segment_ranges, value_and_grad
from engine.data.batch import Pair, make_batch
from engine.losses import LossSpec, spec_of
from engine.model.load import lora_modules
from tests.pairs import tokenized_pairs
from tests.parity import assert_same, batch_loss, lora_model, ref_offset, with_reference

pytestmark = pytest.mark.integration


def run(model, stack, batch, spec, k=0, chunk=0, inflight=2):
    return value_and_grad(model, stack, batch, batch_loss(model, stack, batch, spec), k, chunk,
                          inflight)


@pytest.mark.unit  # a pure function: the fast tier runs it
def test_segment_ranges_are_contiguous_and_ragged() -> None:
    assert segment_ranges(4, 3) == [(0, 3), (3, 4)]
    assert segment_ranges(4, 4) == [(0, 4)]
    assert segment_ranges(5, 2) == [(0, 2), (2, 4), (4, 5)]


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_q4"])
@pytest.mark.parametrize("span", ["full", "response"])
def test_segmented_equals_plain(fixture: str, span: str, request) -> None:
    path = request.getfixturevalue(fixture)
    model, stack = lora_model(path)
    pairs = with_reference(model, stack, tokenized_pairs(path, 3, seed=1))
    batch = make_batch(pairs, span, pad_multiple=8)
    assert batch.ref is not None and batch.ref.shape == (6,)
    for spec in (spec_of("orpo", span, orpo_lambda=0.5), spec_of("sft", span),
                 spec_of("dpo", nll_span=span, dpo_beta=0.5, rpo_alpha=0.5)):
        ref = run(model, stack, batch, spec)
        for k in (1, 2, 3, len(stack.layers)):
            assert_same(run(model, stack, batch, spec, k=k), ref)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_lora_on_last_layers_only_and_any_inflight_depth(depth: int, tiny_model: Path,
                                                         monkeypatch) -> None:
    """The backward stops at the lowest LoRA segment; the evaluation depth (``inflight``,
    segments and head pieces evaluated at once) changes no number. (This test once set an
    environment variable nothing read, so all three depths were the same run.)"""
    from engine.host import inflight

    seen: list[int] = []
    real = inflight.InFlight.__init__

    def record(self, depth: int = 2) -> None:
        seen.append(depth)
        real(self, depth)

    model, stack = lora_model(tiny_model, num_layers=2)  # LoRA on layers 2 and 3 of 4
    batch = make_batch(tokenized_pairs(tiny_model, 2, seed=3), "full", pad_multiple=8)
    spec = spec_of("orpo", "full", orpo_lambda=0.5)
    ref = run(model, stack, batch, spec)
    assert all(".layers.2." in n or ".layers.3." in n for n in ref[2])
    monkeypatch.setattr(inflight.InFlight, "__init__", record)
    for k, chunk in ((1, 0), (1, 16), (3, 0), (2, 5)):
        assert_same(run(model, stack, batch, spec, k=k, chunk=chunk, inflight=depth), ref)
    assert seen and set(seen) == {depth}  # the depth reached the engine


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_q4", "tiny_qwen2"])
def test_bounded_head_equals_dense(fixture: str, request) -> None:
    path = request.getfixturevalue(fixture)
    model, stack = lora_model(path)
    batch = make_batch(tokenized_pairs(path, 3, seed=2), "full")
    spec = spec_of("orpo", "full", orpo_lambda=0.1)
    ref = run(model, stack, batch, spec)
    for k, chunk in ((0, 16), (1, 7), (2, 64), (4, 1000)):
        assert_same(run(model, stack, batch, spec, k=k, chunk=chunk), ref)


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 5])
def test_bounded_head_tiny_spans_on_quantized_head(tiny_model_q4: Path, chunk: int) -> None:
    """1–5 active tokens: chunks of 2 and 3 rows hit quantized_matmul's old bad sizes."""
    model, stack = lora_model(tiny_model_q4)
    assert isinstance(model.lm_head, nn.QuantizedLinear)
    pairs = [Pair("a", [1, 40], [50], [60, 61]), Pair("b", [1], [70, 71], [80])]
    batch = make_batch(pairs, "response")
    assert int(((batch.resp_mask > 0) | (batch.nll_mask > 0)).sum()) == 6
    spec = spec_of("orpo", "response", orpo_lambda=0.1)
    assert_same(run(model, stack, batch, spec, k=1, chunk=chunk), run(model, stack, batch, spec))


def test_dropout_masks_replay_exactly(tiny_model: Path) -> None:
    model, stack = lora_model(tiny_model, dropout=0.3)
    model.train()
    batch = make_batch(tokenized_pairs(tiny_model, 2, seed=3), "full")
    spec = LossSpec()
    ref = run(model, stack, batch, spec)
    assert_same(run(model, stack, batch, spec, k=1), ref)
    model.eval()
    no_dropout = run(model, stack, batch, spec)
    assert float(no_dropout[0]) != pytest.approx(float(ref[0]), rel=1e-6)  # dropout was live


def test_padding_never_changes_the_loss(tiny_model: Path) -> None:
    model, stack = lora_model(tiny_model)
    pairs = tokenized_pairs(tiny_model, 2, seed=4)
    spec = LossSpec()
    a = run(model, stack, make_batch(pairs, "full", pad_multiple=1), spec)
    b = run(model, stack, make_batch(pairs, "full", pad_multiple=128), spec, k=2, chunk=32)
    assert_same(b, a)


def test_lora_product_runs_in_the_input_dtype(tiny_model: Path) -> None:
    """Engine LoRA layers: mlx-lm's math in float32, bf16 products on a bf16 input.

    float32: identical to mlx-lm's LoRALinear call (same ops, same order). bfloat16: the
    output stays bf16 and within bf16 rounding (2^-7 relative) of the float32 result; the
    factors' gradients come back float32, the dtype AdamW keeps them in.
    """
    from mlx_lm.tuner.lora import LoRALinear

    model, _ = lora_model(tiny_model)
    name, m = lora_modules(model)[0]
    assert isinstance(m, LoRALinear) and type(m) is not LoRALinear, name
    x = mx.random.normal((2, 5, m.lora_a.shape[0]), key=mx.random.key(3))
    assert mx.array_equal(m(x), LoRALinear.__call__(m, x))
    ref = m(x)
    m.linear.set_dtype(mx.bfloat16)  # a bf16 base, float32 factors: the GPU setting
    got = m(x.astype(mx.bfloat16))
    assert got.dtype == mx.bfloat16
    err = float(mx.abs(got.astype(mx.float32) - ref).max())
    assert err <= 2**-7 * 4 * float(mx.abs(ref).max()), err

    def loss(params):
        m.update(params)
        return m(x.astype(mx.bfloat16)).astype(mx.float32).sum()

    grads = mx.grad(loss)(m.trainable_parameters())
    assert grads["lora_a"].dtype == grads["lora_b"].dtype == mx.float32


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_scoring_equals_dense(chunk: int, tiny_model: Path) -> None:
    """Validation and `pomona score` with a bounded head (``head_chunk``) give the dense
    head's per-pair numbers: catches a chunk boundary that drops or repeats a position.
    Tolerance 1e-5 absolute on mean log-probs of order 1 (float32)."""
    from engine.forward.scoring import score_pairs

    model, stack = lora_model(tiny_model)
    pairs = tokenized_pairs(tiny_model, 5, seed=13)
    dense = score_pairs(model, stack, pairs, spec_of("orpo", orpo_lambda=0.3), 2, 0)
    chunked = score_pairs(model, stack, pairs, spec_of("orpo", orpo_lambda=0.3), 2, chunk)
    assert [r["id"] for r in chunked] == [r["id"] for r in dense]
    for a, b in zip(chunked, dense, strict=True):
        for key in ("chosen_logp_mean", "rejected_logp_mean", "nll", "loss"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), (key, a["id"])


def test_dpo_step_accumulates_and_verifies_through_every_lever(tiny_model: Path) -> None:
    """DPO through the trainer's step (dispatch_grads hands each micro-batch's ``ref`` to
    the loss): four micro-batches of one pair, two of them prefix-shared, at segment_size
    2 and head_chunk 16 give the plain one-batch-of-four loss, metrics and gradients
    (sigmoid with label smoothing, IPO); ``--verify``'s check passes on DPO. The
    reference is each pair's own log-probs moved by known offsets (``with_reference``),
    so the step's sigmoid rewards are known: β·(S − R) = −β·offset, summed over the pairs
    (a reference in the wrong rows or pairs would move them)."""
    from engine.backward.step import step_grads
    from engine.check.load_check import verify_paths
    from engine.forward.prefix import split_prefix_batch
    from engine.settings.config import TrainConfig

    model, stack = lora_model(tiny_model)
    pairs = with_reference(model, stack, tokenized_pairs(tiny_model, 4, seed=19))
    plain = TrainConfig(model="m", data="d")
    levers = TrainConfig(model="m", data="d", segment_size=2, head_chunk=16)
    micro = [make_batch([p], "full") for p in pairs[:2]]
    micro += [split_prefix_batch([p], "full", attention="mask") for p in pairs[2:]]
    beta = 0.5

    def loss_metrics(sums: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in sums.items() if k.startswith(("rewards/", "logps/"))
                or k == "nll_sum"}

    for spec in (spec_of("dpo", dpo_beta=beta, dpo_label_smoothing=0.1),
                 spec_of("dpo", dpo_beta=beta, dpo_loss_type="ipo")):
        one = step_grads(model, stack, [make_batch(pairs, "full")], spec, plain, step=1)
        four = step_grads(model, stack, micro, spec, levers, step=1)
        assert one[1]["pairs"] == four[1]["pairs"] == 4 and four[1]["shared_batches"] == 2
        assert_same((mx.array(four[0]), loss_metrics(four[1]), four[2]),
                    (mx.array(one[0]), loss_metrics(one[1]), one[2]))
        if spec.loss.dpo_loss_type == "sigmoid":
            offsets = [ref_offset(i) for i in range(len(pairs))]
            assert one[1]["rewards/chosen"] == pytest.approx(
                -beta * sum(o[0] for o in offsets), abs=1e-4)
            assert one[1]["rewards/rejected"] == pytest.approx(
                -beta * sum(o[1] for o in offsets), abs=1e-4)
        verified = verify_paths(model, stack, split_prefix_batch(pairs, "full",
                                                                 attention="mask"),
                                spec, levers, rtol=1e-5)
        assert verified["pairs"] == 4 and verified["grad_rel_err"] <= 1e-5
