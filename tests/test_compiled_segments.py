"""Issue 69, step 1: compiled segments (engine/backward/compiled.py). A segment's forward
and vjp are traced by ``mx.compile`` the second time their key and shapes come, and
replayed after.

Parity on every family, float32, in every layout a segment sees (two forwards: causal
windows; the prefix-shared mask layout: block masks and rope selects; the split layout:
split attention and its ropes), at the same parameters each step, while the parameters
move between steps: a replay that kept a past step's parameters, masks, ropes or side
inputs as constants would fail here. The bound is 1e-5 relative to each tensor's largest;
measured 2026-12-07: at most 1.4e-6 (Gemma 4). Traces are counted: one per segment and
direction, none after (``replays`` counts every compiled call, the traced one included).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from engine.backward.compiled import (
    SegmentCache,
    compile_segments,
    segment_cache,
    uncompiled,
)
from engine.backward.segmented import value_and_grad
from engine.data.batch import batch_norms, make_batch
from engine.forward.prefix import PrefixBatch, split_prefix_batch
from engine.losses import pair_loss, spec_of
from tasks.models.model_factory import init_model
from tests.family_specs import MOE, SPECS, family_pairs
from tests.parity import lora_model

FAMILIES = {**SPECS, **MOE}
RTOL = 1e-5
LAYOUTS = {"two": (3, False), "mask": (3, True), "split": (1, True)}


def _grads(model, stack, batch, two) -> tuple[float, dict[str, mx.array]]:
    spec, norms = spec_of("orpo"), batch_norms([two])
    resp, nll = mx.array(two.resp_mask), mx.array(two.nll_mask)
    loss, _, g = value_and_grad(model, stack, batch,
                                lambda lp: pair_loss(lp, resp, nll, spec, norms),
                                segment_size=1, head_chunk=16)
    mx.eval(loss, g)
    return float(loss), g


@pytest.mark.integration
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compiled_segments_give_the_uncompiled_loss_and_gradients(family: str,
                                                                  tmp_path: Path) -> None:
    path = init_model(FAMILIES[family], tmp_path / family)
    for layout, (n, shared) in LAYOUTS.items():
        model, stack = lora_model(path)
        compile_segments(stack)
        pairs = family_pairs(n, seed=1)
        two = make_batch(pairs, "full")
        batch = split_prefix_batch(pairs, two=two) if shared else two
        if layout == "split":
            assert isinstance(batch, PrefixBatch) and batch.split is not None
        for step in range(3):  # seen once (uncompiled), traced, replayed
            got, got_g = _grads(model, stack, batch, two)
            with uncompiled(stack):
                want, want_g = _grads(model, stack, batch, two)
            assert got == pytest.approx(want, rel=RTOL), (family, layout, step)
            for name, w in want_g.items():
                err = float(mx.abs(got_g[name] - w).max() / (mx.abs(w).max() + 1e-30))
                assert err < RTOL, (family, layout, step, name, err)
            model.update(tree_unflatten([(k, v - 0.05 * want_g[k]) for k, v in
                                         tree_flatten(model.trainable_parameters())]))
        cache = segment_cache(stack)
        layers = len(stack.layers)  # segments of one layer: a forward and a vjp each
        assert (cache.traces, cache.replays, cache.calls) == (
            2 * layers, 4 * layers, 6 * layers), (family, layout)


@pytest.mark.unit
def test_a_key_compiles_on_its_second_coming_and_the_cache_forgets_the_oldest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Shapes seen once run the plain call (ragged data: a trace would cost more than it
    saves); the second time they trace, and after that replay without Python."""
    import engine.backward.compiled as compiled

    monkeypatch.setattr(compiled, "KEPT", 2)
    cache, plain_calls = SegmentCache(), []

    def call(key: str, x: mx.array) -> mx.array:
        def plain() -> mx.array:
            plain_calls.append(key)
            return x * 2
        return cache.call(key, lambda: (lambda a: a * 2), [x], plain)

    x3, x4 = mx.ones((3,)), mx.ones((4,))
    for _ in range(3):
        assert mx.array_equal(call("a", x3), x3 * 2)
    assert plain_calls == ["a"] and (cache.traces, cache.replays, cache.calls) == (1, 2, 3)
    call("a", x4)  # new shapes: a key of their own, seen once
    assert plain_calls == ["a", "a"]
    for key in ("b", "b", "c", "c"):  # two more compiled: "a" on x3 is the oldest, gone
        call(key, x3)
    assert len(cache.functions) == 2 and ("a", (((3,), mx.float32),)) not in cache.functions


@pytest.mark.integration
def test_pomona_train_takes_the_same_steps_compiled_and_traces_once(
        tiny_model: Path, tmp_path: Path) -> None:
    """The real trainer on pairs of one shape (every step's segments alike): compiled and
    uncompiled runs log the same losses (float32: 1e-5), and the compiled run traced each
    segment's two functions once, replaying them on every later step."""
    from engine.data.batch import Pair
    from engine.data.pairs import write_pairs_jsonl
    from engine.settings.config import TrainConfig
    from engine.train.trainer import train
    from tests.pairs import tokenized_pairs

    rows = [p for p in tokenized_pairs(tiny_model, 64, seed=0, task="sort")
            if len(p.prompt) >= 8 and min(len(p.chosen), len(p.rejected)) >= 4
            and p.chosen[:4] != p.rejected[:4]]
    same = [Pair(f"r{i}", p.prompt[:8], p.chosen[:4], p.rejected[:4])
            for i, p in enumerate(rows[:8])]
    assert len(same) == 8
    data = write_pairs_jsonl(same, tmp_path / "pairs.jsonl", split="train")
    losses, results = {}, {}
    for on in (False, True):
        out = tmp_path / f"run-{on}"
        results[on] = train(TrainConfig(model=str(tiny_model), data=str(data), out=str(out),
                                        steps=5, batch_size=2, lora_rank=4, learning_rate=1e-3,
                                        report_every=1, val_every=0, segment_size=1,
                                        head_chunk=16, compile=on, prefix_share="off"))
        losses[on] = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text()
                      .splitlines() if '"split": "train"' in x]
    assert len(losses[True]) == 5
    assert losses[True] == pytest.approx(losses[False], rel=1e-5), losses
    assert results[False].compiled == {}
    counts = results[True].compiled
    layers = json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]
    assert counts["traces"] == 2 * layers, counts  # one step's segments, traced once
    assert counts["calls"] == 10 * layers, counts
    assert counts["replays"] == 8 * layers, counts  # every step after the first compiled
