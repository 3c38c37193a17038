"""Adapter soup: the top-k adapters merged into one LoRA adapter of the same rank.

For every LoRA module, each adapter's update is ΔW_i = s_i · A_i B_i (mlx-lm's LoRALinear:
y = x W + s · (x A) B, A [in, r], B [r, out]). The soup averages the updates,
ΔW = mean_i ΔW_i, and re-factors ΔW / s to rank r with a truncated SVD
(U_r √S_r as A, √S_r V_r^T as B), the best rank-r approximation (Eckart–Young), keeping
the first adapter's rank r, scale s, keys and layers. Computed in float64 with numpy; the
result is an ordinary mlx-lm adapter directory, evaluated and listed like a trial.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from safetensors.numpy import load_file

from engine.host.outputs import RefusedOutput, entries
from engine.model.adapters import ADAPTER_FILE, CONFIG_FILE, run_save_arrays, run_write_text


def _lora(config: dict) -> tuple[int, float]:
    params = config["lora_parameters"]
    return int(params["rank"]), float(params["scale"])


def delta_weights(adapter: Path) -> dict[str, np.ndarray]:
    """Module path → its ΔW = scale · A B (float64), from an mlx-lm adapter directory."""
    config = json.loads((adapter / CONFIG_FILE).read_text())
    _, scale = _lora(config)
    weights = load_file(str(adapter / ADAPTER_FILE))
    modules = sorted({k.rsplit(".", 1)[0] for k in weights if k.endswith(".lora_a")})
    return {m: scale * weights[f"{m}.lora_a"].astype(np.float64)
            @ weights[f"{m}.lora_b"].astype(np.float64) for m in modules}


def is_soup(path: Path) -> bool:
    """Whether ``path`` holds a soup ``make_soup`` wrote (its mark: ``pomona.soup_of``)."""
    try:
        return "soup_of" in json.loads((path / CONFIG_FILE).read_text()).get("pomona", {})
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def make_soup(adapters: list[Path], out: Path) -> Path:
    """Average the adapters' ΔW per module, re-factor to the first one's rank; write ``out``."""
    if len(adapters) < 2:
        raise ValueError(f"a soup needs at least two adapters, got {len(adapters)}")
    config = json.loads((adapters[0] / CONFIG_FILE).read_text())
    rank, scale = _lora(config)
    deltas = [delta_weights(a) for a in adapters]
    for a, d in zip(adapters[1:], deltas[1:], strict=True):
        if d.keys() != deltas[0].keys():
            raise ValueError(f"{a}: adapts other modules than {adapters[0]}; cannot be mixed")
    weights: dict[str, np.ndarray] = {}
    for module in deltas[0]:
        mean = np.mean([d[module] for d in deltas], axis=0) / scale
        u, s, vt = np.linalg.svd(mean, full_matrices=False)
        root = np.sqrt(s[:rank])
        weights[f"{module}.lora_a"] = (u[:, :rank] * root).astype(np.float32)
        weights[f"{module}.lora_b"] = (root[:, None] * vt[:rank]).astype(np.float32)
    if out.exists() and entries(out) and not is_soup(out):
        raise RefusedOutput(f"{out}: holds files that are not a soup Pomona made; refusing to "
                            "replace them. Move them out of the way")
    out.mkdir(parents=True, exist_ok=True)
    run_save_arrays(out / ADAPTER_FILE, {k: mx.array(v) for k, v in weights.items()})
    config["pomona"] = {**config.get("pomona", {}), "soup_of": [str(a) for a in adapters]}
    run_write_text(out / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    return out
