"""Test helper: the tiny model of each supported family (``pomona model init --arch``),
with its hard features switched on, and pairs long enough to pass its sliding window."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from engine.data.batch import Pair
from tasks.models.model_factory import ModelSpec

WINDOW = 16
SEQ = 3 * WINDOW + 8  # every two-forward row is at least this long
BASE = ModelSpec(layers=4, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512)
SPECS = {  # pomona model init --arch A, with each family's hard features switched on
    "llama": replace(BASE, rope_scaling="llama3", window=WINDOW),
    "mistral": replace(BASE, arch="mistral", window=WINDOW),
    "qwen2": replace(BASE, arch="qwen2"),
    "qwen3": replace(BASE, arch="qwen3"),
    "phi3": replace(BASE, arch="phi3"),
    "minicpm": replace(BASE, arch="minicpm"),
    # max_position 1024: Llama-4 query scaling starts at position 16, inside the test rows
    "ministral3": replace(BASE, arch="ministral3", window=WINDOW, max_position=1024),
    "gemma3_text": replace(BASE, arch="gemma3_text", layers=6, window=WINDOW),
    # 12 layers, 5:1 → full layers 5 and 11; the last 4 share K/V: donors 7 (sliding, read
    # by 8, 9, 10) and 5 (full, read by 11)
    "gemma4_text": replace(BASE, arch="gemma4_text", layers=12, window=WINDOW,
                           kv_shared_layers=4, ple=16),
}
MOE = {
    "qwen3_moe": replace(BASE, arch="qwen3_moe", experts=4),
    "gemma4_moe": replace(SPECS["gemma4_text"], experts=4),
    "gemma4": replace(SPECS["gemma4_text"], arch="gemma4"),  # multimodal checkpoint
}


def family_pairs(n: int, seed: int) -> list[Pair]:
    """Ragged pairs whose every sequence is at least SEQ tokens (prompt ≥ 40)."""
    rng = np.random.default_rng(seed)
    ids = lambda k: rng.integers(5, BASE.vocab, k).tolist()  # noqa: E731
    return [Pair(f"p{seed}-{i}", ids(40 + 5 * i), ids(SEQ - 40 + 3 * i), ids(SEQ - 38 + i))
            for i in range(n)]
