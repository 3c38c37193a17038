"""Every family the GGUF import knows, checked against a reference: a random-init model of
the family (tasks/models/model_factory.py) written as llama.cpp's converter writes it
(tests/gguf_writer.py: its tensor names, permutations, hyperparameters and Llama 3's
``rope_freqs``), imported (``pomona model import``'s function), and run beside the source.

Tolerance: logits within 1e-4 of the source's largest (float32 both ways). Measured
2026-12-04: 0 (bit for bit) for llama, mistral, qwen2, qwen3 and phi3; 2.3e-7 and 3.5e-7 with
Llama 3's rope (its frequencies recomputed from the settings read back). With llama's q/k
permutation left in place the error is 9.5e-4 to 5.2e-3.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from engine.model.gguf_archs import llama3_factors, llama3_scaling
from engine.model.gguf_import import import_gguf
from tasks.models.model_factory import init_model
from tests.conftest import TINY
from tests.gguf_writer import rope_freqs, write_gguf_of

pytestmark = pytest.mark.integration
TOKENS = mx.array([[1, 17, 3, 250, 99, 4, 42, 7, 300, 12, 8, 511, 64, 5, 2, 77] * 4])
CASES = {
    "llama": replace(TINY, arch="llama"),
    "mistral": replace(TINY, arch="mistral"),
    "qwen2": replace(TINY, arch="qwen2"),
    "qwen3": replace(TINY, arch="qwen3"),
    "phi3": replace(TINY, arch="phi3"),
    # Llama 3.1's rope scaling: head size 32 puts two frequencies in the smooth band, 16 one
    "llama3-rope": replace(TINY, arch="llama", hidden=128, rope_scaling="llama3",
                           max_position=1024),
    "llama3-rope-one-in-band": replace(TINY, arch="llama", rope_scaling="llama3",
                                       max_position=1024),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_llama_cpp_gguf_of_each_family_imports_to_the_same_logits(case: str,
                                                                    tmp_path: Path) -> None:
    source = init_model(CASES[case], tmp_path / "source")
    gguf_file = write_gguf_of(source, tmp_path / "model.gguf")
    imported = import_gguf(gguf_file, tmp_path / "imported", dtype="float32")
    want_config = json.loads((source / "config.json").read_text())
    got_config = json.loads((imported / "config.json").read_text())
    assert got_config["model_type"] == {"mistral": "llama"}.get(
        want_config["model_type"], want_config["model_type"])
    if "rope" in case:  # the same rope, not just logits close on 64 positions
        assert got_config["rope_scaling"]["rope_type"] == "llama3"
    want_model, _ = load(str(source))
    got_model, _ = load(str(imported))
    want, got = want_model(TOKENS), got_model(TOKENS)
    err = float(mx.abs(want - got).max() / mx.abs(want).max())
    assert err <= 1e-4, (case, err)


@pytest.mark.unit
@pytest.mark.parametrize("head_dim, base, scaling", [
    (128, 500000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}),  # Llama 3.1 8B
    (64, 500000.0, {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}),  # Llama 3.2 1B
    (32, 10000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 128}),
    (16, 10000.0, {"factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                   "original_max_position_embeddings": 1024}),
])
def test_rope_freqs_are_read_back_into_llama3_scaling(head_dim, base, scaling) -> None:
    """The scaling read from llama.cpp's ``rope_freqs`` gives the same factor at every
    frequency (Llama 3.1 and 3.2's own settings among them); its low_freq_factor is 1, the
    band's bounds (old/low, old/high) being all the tensor fixes."""
    factors = rope_freqs(head_dim, base, scaling)
    got = llama3_scaling(factors, head_dim, base)
    assert got is not None and got["factor"] == pytest.approx(scaling["factor"])
    np.testing.assert_allclose(llama3_factors(head_dim, base, got), factors, rtol=1e-5)
    assert llama3_scaling(np.ones(head_dim // 2, np.float32), head_dim, base) is None


@pytest.mark.unit
@pytest.mark.parametrize("factors, needle", [
    (np.array([1.0, 3.0, 2.0, 8.0]), "does not follow Llama 3's rope scaling"),
    (np.array([8.0, 1.0, 1.0, 1.0]), "does not rise from 1"),
    (np.array([1.0, 1.0, 8.0]), "holds 3 values"),
])
def test_rope_freqs_of_another_form_are_refused_naming_why(factors, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        llama3_scaling(factors, 8, 10000.0)
