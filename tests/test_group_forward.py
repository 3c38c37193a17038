"""Issue 68, step 3: the group-shared forward (engine/forward/group_layout.py), one row
``[prompt | c1 | … | cG]`` a group, against G separate rows under plain
``nn.value_and_grad`` over the model's own call, on every family's tiny model (sliding
windows past their width, Gemma 4's shared K/V, MoE and multimodal checkpoints).

Tolerances (float32: the paths reorder attention's sums only; measured 2026-12-07 on
OpenBLAS 0.3.21's Haswell kernels, every family):
- each completion token's log-prob within LOGP_RTOL of the largest |log-prob| (measured
  ≤ 6.1e-7; a completion seeing another's token moves one by ≥ 1e-3);
- the loss within 1e-6 absolute (it is −mean(A · ratio) + β·KL ≈ −0.025 here, signed terms
  that cancel; measured ≤ 1.7e-7), the metrics as tests/parity.py ``assert_same`` holds them;
- each LoRA gradient within GROUP_GRAD_RTOL of its largest entry: per-token terms of both
  signs sum, so each log-prob's rounding reaches 1.2e-5 on Gemma 4 (≤ 2.6e-6 elsewhere).
  That is float32's, not the layout's: the plain float32 path is itself 2.3e-5 from the
  same model run in float64, the shared one 1.8e-5; in float64 the two paths agree within
  5.6e-7 (F64_GRAD_RTOL below; the loss's own float32 terms are what is left).
μ > 1 ratios go past the clip both ways and β > 0, so every term carries gradient (the
sampling and reference log-probs near the policy's: see ``batches``).
"""

from __future__ import annotations

import dataclasses
import itertools

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from engine.backward.compiled import compile_segments, segment_cache
from engine.check.load_check import checked_stack
from engine.forward.group_layout import group_layout
from engine.forward.rollouts import Rollouts
from engine.losses.grpo import Grpo
from engine.train.group_backward import staged_group_objective
from engine.train.group_steps import (
    GroupBatch,
    completion_logps,
    detached_logps,
    group_objective,
    group_rows,
)
from tasks.models.model_factory import init_model
from tests.family_specs import BASE, MOE, SPECS, WINDOW
from tests.parity import assert_same, with_lora

G = 4
LOGP_RTOL, GROUP_GRAD_RTOL, LOSS_ABS = 2e-6, 3e-5, 1e-6
F64_GRAD_RTOL = 2e-6
LENGTHS = ((20, 1, 3 * WINDOW, 7), (5, 2 * WINDOW + 3, 9, 1))  # 1: feeds no token
LOSS = Grpo(grpo_beta=0.04, grpo_num_iterations=2, grpo_loss_type="grpo", temperature=0.7,
            num_generations=G)


@dataclasses.dataclass(frozen=True)
class _Row:
    prompt: tuple[int, ...]


def groups(seed: int) -> tuple[list[_Row], Rollouts]:
    """Two prompts (40 and 45 tokens) and G ragged completions of each, the last token
    of some a stop token, some cut at the limit."""
    rng = np.random.default_rng(seed)
    prompts = [_Row(tuple(rng.integers(5, BASE.vocab, 40 + 5 * i).tolist())) for i in range(2)]
    tokens, stops = [], []
    for row in LENGTHS:
        for n, length in enumerate(row):
            stop = 2 if n % 2 == 0 else None
            tokens.append(rng.integers(5, BASE.vocab, length - (stop is not None)).tolist())
            stops.append(stop)
    return prompts, Rollouts(tokens, stops, 0, 0.0)


def batches(model, stack, prompts, rollouts, seed: int) -> tuple[GroupBatch, GroupBatch]:
    """The plain rows and the shared layout of the same rollouts, with advantages and the
    sampling and reference log-probs drawn near the policy's (σ 0.5: ratios past the clip
    both ways and a KL of order one; drawn far from it, k3's exp(ref − logp) magnifies
    float32 rounding in the log-probs past any tolerance, as it did on Gemma 4's)."""
    ids, at, mask = group_rows(prompts, rollouts, G, pad_id=0)
    rng = np.random.default_rng(seed)
    n, t = mask.shape
    plain = GroupBatch(mx.array(ids), mx.array(at), mx.array(mask),
                       mx.array(rng.normal(0, 1, n).astype(np.float32)))
    policy = completion_logps(model, stack, plain, LOSS.temperature)
    near = {k: policy + mx.array(rng.normal(0, 0.5, (n, t)).astype(np.float32))
            for k in ("old", "ref")}
    plain = dataclasses.replace(plain, **near)
    stops = [t + ([s] if s is not None else []) for t, s in
             zip(rollouts.tokens, rollouts.stop_tokens, strict=True)]
    shared = dataclasses.replace(plain, layout=group_layout([p.prompt for p in prompts], stops))
    return plain, shared


def run(model, stack, batch: GroupBatch, segment_size: int = 0, head_chunk: int = 0):
    """(loss, metrics, grads) of one update on ``batch``: plain autograd, or the staged
    backward (engine/train/group_backward.py) at ``segment_size`` and ``head_chunk``."""
    objective = (staged_group_objective(model, stack, LOSS, segment_size, head_chunk)
                 if segment_size or head_chunk else group_objective(model, stack, LOSS))
    (loss, metrics), grads = objective(batch, 0.0, 1.0)
    mx.eval(loss, metrics, grads)
    return loss, metrics, dict(tree_flatten(grads))


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("group-families")

    def get(name: str):  # a fresh load each call: a test may change its weights
        path = root / name
        if not path.exists():
            init_model({**SPECS, **MOE}[name], path)
        model, _ = mlx_lm.load(str(path))
        return with_lora(model), checked_stack(model)[0]

    return get


def logp_gap(model, stack, got: GroupBatch, want: GroupBatch, head_chunk: int | None = None
             ) -> float:
    """The largest gap between two paths' completion log-probs, in units of the largest
    |log-prob| (LOGP_RTOL is the bound); with ``head_chunk``, ``got``'s taken with no
    gradient (``detached_logps``, the sampling and reference passes')."""
    a = (completion_logps(model, stack, got, LOSS.temperature) if head_chunk is None
         else detached_logps(model, stack, got, LOSS.temperature, head_chunk))
    b = completion_logps(model, stack, want, LOSS.temperature)
    return float((mx.abs(a - b) * want.mask).max() / (mx.abs(b) * want.mask).max())


@pytest.mark.integration
@pytest.mark.parametrize("arch", sorted({**SPECS, **MOE}))
def test_the_group_shared_forward_equals_g_separate_rows(arch: str, family) -> None:
    """Catches a completion seeing another's tokens, a rope or sliding window counted in
    concatenation positions, a gathered position off by one, a donor's K/V or a LoRA
    gradient lost: each moves a log-prob, the loss or a gradient past the tolerance; and
    the staged backward (segments of 1 with a bounded head of 16 rows, segments of 2 with
    the dense head) on either layout gives the plain update's loss and gradients, and so
    do its segments compiled (engine/backward/compiled.py), each traced once."""
    model, stack = family(arch)
    prompts, rollouts = groups(0)
    plain, shared = batches(model, stack, prompts, rollouts, 1)
    assert shared.layout.fed < int(np.prod(plain.ids.shape))  # the prompt once a group
    assert logp_gap(model, stack, shared, plain) <= LOGP_RTOL
    for batch, chunk in ((plain, 7), (shared, 0)):  # the sampling and reference passes'
        assert logp_gap(model, stack, batch, plain, chunk) <= LOGP_RTOL
    ref = run(model, stack, plain)
    assert_same(run(model, stack, shared), ref, GROUP_GRAD_RTOL, LOSS_ABS)
    for batch, (k, chunk) in itertools.product((plain, shared), ((1, 16), (2, 0))):
        assert_same(run(model, stack, batch, k, chunk), ref, GROUP_GRAD_RTOL, LOSS_ABS)
    compile_segments(stack)  # the group layout's ropes and masks as a compiled trace's inputs
    for _ in range(3):  # seen once (uncompiled), traced, replayed
        assert_same(run(model, stack, shared, 1, 16), ref, GROUP_GRAD_RTOL, LOSS_ABS)
    assert segment_cache(stack).traces == 2 * len(stack.layers)


@pytest.mark.integration
def test_in_float64_gemma_4s_shared_layout_is_exact(family) -> None:
    """Gemma 4 (shared K/V, sliding windows), the family whose float32 gradients differ
    most: its weights in float64, the shared layout's LoRA gradients within F64_GRAD_RTOL
    of the plain rows' (measured 5.6e-7, against 1.2e-5 in float32), so what float32 shows
    is rounding; a layout error moves them by ≥ 1e-3 (``fails_parity`` below)."""
    model, stack = family("gemma4_text")
    model.update(tree_map(lambda a: a.astype(mx.float64), model.parameters()))
    plain, shared = batches(model, stack, *groups(0), 1)
    loss, _, want = run(model, stack, plain)
    got_loss, _, got = run(model, stack, shared)
    for name, g in want.items():
        err = float(mx.abs(got[name] - g).max())
        assert g.dtype == mx.float64 and err <= F64_GRAD_RTOL * float(mx.abs(g).max()), name
    assert abs(float(got_loss - loss)) <= LOSS_ABS


@pytest.mark.unit
def test_a_completion_that_sees_another_fails_parity(tiny_model) -> None:
    """The test above can fail: a mask letting each completion see the one before it, or
    positions counted along the concatenation, moves a log-prob 100× past LOGP_RTOL
    (measured: 330× and more)."""
    model, _ = mlx_lm.load(str(tiny_model))
    model, stack = with_lora(model), checked_stack(model)[0]
    prompts, rollouts = groups(2)
    plain, shared = batches(model, stack, prompts, rollouts, 3)
    assert logp_gap(model, stack, shared, plain) <= LOGP_RTOL
    leaky = shared.layout.mask.copy()
    leaky[:, 0] |= np.tril(np.ones(leaky.shape[-2:], bool))  # all causal: c2 sees c1
    unshifted = np.zeros_like(shared.layout.shifts)
    for broken in (dataclasses.replace(shared.layout, mask=leaky),
                   dataclasses.replace(shared.layout, shifts=unshifted)):
        gap = logp_gap(model, stack, dataclasses.replace(shared, layout=broken), plain)
        assert gap > 100 * LOGP_RTOL, gap


@pytest.mark.unit
def test_the_rows_point_at_each_completion_token_and_its_predictor() -> None:
    """``group_rows``' positions: completion token j is predicted at prompt length − 1 + j
    and is the target there, whatever the stop token (both paths read them, so the
    parity above could not see them off by one)."""
    prompts, rollouts = groups(4)
    ids, at, mask = group_rows(prompts, rollouts, G, pad_id=0)
    for n, (tokens, stop) in enumerate(zip(rollouts.tokens, rollouts.stop_tokens,
                                           strict=True)):
        completion = tokens + ([stop] if stop is not None else [])
        p, c = len(prompts[n // G].prompt), len(completion)
        assert mask[n].sum() == c and list(at[n, :c]) == list(range(p - 1, p - 1 + c))
        assert [int(ids[n, a + 1]) for a in at[n, :c]] == completion


@pytest.mark.unit
def test_mlp_chunks_keep_the_staged_update_exact(tiny_model) -> None:
    """``mlp_chunk`` (each MLP on 8-row chunks, recomputed in the backward) under the
    staged backward on the group layout: the plain update's loss and gradients."""
    from engine.model.recompute import mlp_chunks

    model, _ = mlx_lm.load(str(tiny_model))
    model, stack = with_lora(model), checked_stack(model)[0]
    plain, shared = batches(model, stack, *groups(5), 6)
    ref = run(model, stack, plain)
    with mlp_chunks(stack.layers, 8):
        assert_same(run(model, stack, shared, 1, 16), ref, GROUP_GRAD_RTOL, LOSS_ABS)


def peak_above(fn) -> float:
    """The peak bytes ``fn()``'s evaluation holds above what was held before it."""
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(fn())
    return mx.get_peak_memory() - base


@pytest.mark.unit
def test_the_detached_passes_never_hold_every_positions_logits(tmp_path) -> None:
    """The sampling and reference log-probs (``detached_logps``), on a vocabulary of 8192
    (where the logits, not attention, set a forward's peak): the model's own call
    (``completion_logps``) holds the rows' [N, L − 1, V] float32 logits; the head on the
    completion tokens alone peaks below it, and at 16 tokens a chunk below a quarter of
    those logits (measured: 38 MB, 28 MB, 4.6 MB beside logits of 23 MB). Each equals the
    model's log-probs."""
    model, _ = mlx_lm.load(str(init_model(dataclasses.replace(BASE, vocab=8192), tmp_path)))
    model, stack = with_lora(model), checked_stack(model)[0]
    plain, _ = batches(model, stack, *groups(7), 8)
    n, width = plain.ids.shape
    logits_bytes = n * (width - 1) * model.args.vocab_size * 4
    mx.eval(model.parameters())
    whole = peak_above(lambda: completion_logps(model, stack, plain, LOSS.temperature))
    got = {c: peak_above(lambda c=c: detached_logps(model, stack, plain, LOSS.temperature, c))
           for c in (0, 16)}
    assert whole > logits_bytes and got[0] < whole and got[16] < logits_bytes / 4, got
    for chunk in got:
        assert logp_gap(model, stack, plain, plain, chunk) <= LOGP_RTOL
