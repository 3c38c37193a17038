"""The adapter soup against a hand computation, and as an adapter mlx-lm loads (its logits
against the base model with the mean update added by hand)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tasks.board.soup import delta_weights, make_soup

pytestmark = pytest.mark.unit
MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj")


def _adapter(path: Path, rng: np.random.Generator, rank: int, scale: float,
             b_shared: np.ndarray | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    path.mkdir(parents=True)
    weights, ab = {}, {}
    for m in MODULES:
        a = rng.normal(size=(12, rank)).astype(np.float32)
        b = (b_shared if b_shared is not None else rng.normal(size=(rank, 10))).astype(np.float32)
        weights[f"{m}.lora_a"], weights[f"{m}.lora_b"] = a, b
        ab[m] = (a, b)
    save_file(weights, str(path / "adapters.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": 2,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0}}))
    return ab


def test_soup_is_the_truncated_svd_of_the_mean_update(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    one = _adapter(tmp_path / "a", rng, rank=3, scale=2.0)
    two = _adapter(tmp_path / "b", rng, rank=3, scale=2.0)
    soup = make_soup([tmp_path / "a", tmp_path / "b"], tmp_path / "soup")
    got = load_file(str(soup / "adapters.safetensors"))
    for m in MODULES:
        # By hand: ΔW_i = s A_i B_i; mean; best rank-3 approximation of the mean / s.
        mean = (2.0 * one[m][0].astype(np.float64) @ one[m][1]
                + 2.0 * two[m][0].astype(np.float64) @ two[m][1]) / 2
        u, s, vt = np.linalg.svd(mean / 2.0)
        best = (u[:, :3] * s[:3]) @ vt[:3]
        assert got[f"{m}.lora_a"].shape == (12, 3) and got[f"{m}.lora_b"].shape == (3, 10)
        ours = got[f"{m}.lora_a"].astype(np.float64) @ got[f"{m}.lora_b"]
        np.testing.assert_allclose(ours, best, rtol=1e-5, atol=1e-5)
    assert json.loads((soup / "adapter_config.json").read_text())["lora_parameters"]["rank"] == 3


def test_soup_of_updates_sharing_b_is_exact(tmp_path: Path) -> None:
    """When the mean update has rank ≤ r the soup reproduces it exactly."""
    rng = np.random.default_rng(1)
    b = rng.normal(size=(2, 10))
    _adapter(tmp_path / "a", rng, rank=2, scale=1.5, b_shared=b)
    _adapter(tmp_path / "b", rng, rank=2, scale=1.5, b_shared=b)
    soup = make_soup([tmp_path / "a", tmp_path / "b"], tmp_path / "soup")
    mean = {m: (delta_weights(tmp_path / "a")[m] + delta_weights(tmp_path / "b")[m]) / 2
            for m in MODULES}
    for m, d in delta_weights(soup).items():
        np.testing.assert_allclose(d, mean[m], rtol=1e-4, atol=1e-5)


def test_soup_refuses_mismatched_adapters(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    _adapter(tmp_path / "a", rng, rank=2, scale=1.0)
    with pytest.raises(ValueError, match="at least two"):
        make_soup([tmp_path / "a"], tmp_path / "soup")
    other = tmp_path / "c"
    other.mkdir()
    save_file({"x.lora_a": np.zeros((12, 2), np.float32),
               "x.lora_b": np.zeros((2, 10), np.float32)}, str(other / "adapters.safetensors"))
    (other / "adapter_config.json").write_text((tmp_path / "a" / "adapter_config.json").read_text())
    with pytest.raises(ValueError, match="adapts other modules"):
        make_soup([tmp_path / "a", other], tmp_path / "soup")


def test_mlx_lm_loads_the_soup_as_the_mean_update(tiny_model: Path, tmp_path: Path) -> None:
    """mlx-lm loads a soup of two adapters of the real model (sharing B: the mean update has
    rank ≤ r, so the soup is exact) and its logits equal the base model's with the mean ΔW
    added to the weights by hand. Would catch: names, shapes or a config mlx-lm cannot load,
    or a scale it applies twice or not at all."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    lora = {"rank": 2, "scale": 1.5, "dropout": 0.0}
    model, tokenizer = load(str(tiny_model))
    linear_to_lora_layers(model, 2, lora)  # which modules mlx-lm adapts, and their shapes
    params = dict(tree_flatten(model.parameters()))
    modules = [k.removesuffix(".lora_a") for k in params if k.endswith(".lora_a")]
    rng = np.random.default_rng(3)
    shared = {m: rng.normal(0, 0.05, params[f"{m}.lora_b"].shape) for m in modules}
    for name in ("a", "b"):
        weights = {}
        for m in modules:
            a = rng.normal(0, 0.05, params[f"{m}.lora_a"].shape)
            weights[f"{m}.lora_a"] = a.astype(np.float32)
            weights[f"{m}.lora_b"] = shared[m].astype(np.float32)
        (tmp_path / name).mkdir()
        save_file(weights, str(tmp_path / name / "adapters.safetensors"))
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(
            {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora}))
    soup = make_soup([tmp_path / "a", tmp_path / "b"], tmp_path / "soup")

    souped, _ = load(str(tiny_model), adapter_path=str(soup))
    base, _ = load(str(tiny_model))
    weights = dict(tree_flatten(base.parameters()))
    mean = {m: (delta_weights(tmp_path / "a")[m] + delta_weights(tmp_path / "b")[m]) / 2
            for m in modules}
    base.load_weights([(f"{m}.weight", weights[f"{m}.weight"] + mx.array(d.T, mx.float32))
                       for m, d in mean.items()], strict=False)
    prompt = mx.array([tokenizer.encode("sort: 3 1 2")])
    got, want = souped(prompt), base(prompt)
    assert float(mx.abs(want - load(str(tiny_model))[0](prompt)).max()) > 1e-3  # it moves
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
