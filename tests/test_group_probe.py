"""Issue 68, item 7: the memory probe of loss grpo (engine/train/group_probe.py) measures
its worst cycle, the rollout's KV cache and the update apart, and generation never holds
the training graph."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.models.cache import KVCache

from engine.data.pairs import write_pairs_jsonl
from engine.settings.config import TrainConfig
from engine.train.probe import probe_steps
from tests.conftest import TINY
from tests.pairs import tokenized_pairs

B, G = 2, 4


def kv_bytes_per_token() -> int:
    """One row's keys and values of one position, every layer, float32."""
    return TINY.layers * 2 * TINY.kv_heads * (TINY.hidden // TINY.heads) * 4


@pytest.mark.unit
def test_the_grpo_probe_counts_the_rollouts_kv_cache_and_not_the_graph(tiny_model: Path,
                                                                        tmp_path: Path) -> None:
    """Completions KVCache.step (256) tokens longer cost the rollout one more step of
    every row's KV cache, B·G·256 positions (measured: 1.15–1.35× it; the cache's
    growth copies), and nothing more: the training graph, which grows with the
    completions (the update's peak), is never alive while the next cycle samples (the
    plain update's [N, L, V] logits held would be 4× it). Every completion
    runs to its limit (no stop token drawn) and ``peak_gb`` is the larger phase's."""
    data = write_pairs_jsonl(tokenized_pairs(tiny_model, 8, seed=0, task="parity"),
                             tmp_path / "parity.jsonl", "train")
    cfg = TrainConfig(model=str(tiny_model), data=str(data), out=str(tmp_path / "o"),
                      batch_size=B, segment_size=0).replace(
        loss="grpo", reward=["task:parity"], num_generations=G)
    short, long = (8, 8 + KVCache.step)
    rows = probe_steps(cfg, [{"max_completion_length": c} for c in (short, long)])
    assert all("error" not in r for r in rows), rows
    for r, c in zip(rows, (short, long), strict=True):
        assert r["tokens"] == B * G * c, r
        assert r["peak_gb"] == max(r["rollout_peak_gb"], r["update_peak_gb"]), r
    kv = B * G * KVCache.step * kv_bytes_per_token() / 2**30
    grown = rows[1]["rollout_peak_gb"] - rows[0]["rollout_peak_gb"]
    graph = rows[1]["update_peak_gb"] - rows[0]["update_peak_gb"]
    assert 0.5 * kv <= grown <= 2.5 * kv < graph, (grown, kv, rows)  # noise: ±0.25 kv
