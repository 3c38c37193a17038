"""An adapter folder read whole or refused in one line, wherever one is loaded (export,
score, the leaderboard's evaluation, warm starts, a DPO reference, a resume).

``adapters.safetensors`` must be a readable safetensors file of finite tensors and
``adapter_config.json`` a JSON object with a finite ``scale``. After mlx-lm's
``load_adapters`` has built the layers the config implies (LoRA, or DoRA's magnitudes too)
every parameter it made must have come from the file: it loads with ``strict=False``,
which refuses extra and misshapen tensors but leaves a missing one at its random init, so
two exports of one adapter would differ.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

ADAPTER_FILE, CONFIG_FILE = "adapters.safetensors", "adapter_config.json"


def read_adapter_config(folder: str | Path) -> dict[str, Any]:
    """``folder``'s adapter_config.json as a mapping; ValueError (one line) naming the file
    where it is not JSON, not an object, or its LoRA scale is not a finite number."""
    path = Path(folder) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file; an adapter folder holds {ADAPTER_FILE} and "
                         f"{CONFIG_FILE}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not the JSON object mlx-lm writes")
    params = config.get("lora_parameters", {})
    scale = params.get("scale", 1.0) if isinstance(params, dict) else None
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"{path}: lora_parameters.scale is {scale!r}, not a finite number")
    return config


def read_adapter_weights(folder: str | Path) -> dict[str, mx.array]:
    """``folder``'s adapters.safetensors, every tensor finite; ValueError (one line) naming
    the file where it is missing, cut short or not safetensors, or the first tensor that
    holds a NaN or an infinity."""
    path = Path(folder) / ADAPTER_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no such file; an adapter folder holds {ADAPTER_FILE} and "
                         f"{CONFIG_FILE}")
    try:
        weights = mx.load(str(path))
    except (RuntimeError, ValueError, OSError) as err:  # cut short, garbage, unreadable
        raise ValueError(f"{path}: not a readable safetensors file ({err}); train or copy "
                         "the adapter again") from None
    if not isinstance(weights, dict):
        raise ValueError(f"{path}: not a safetensors file of named tensors")
    for name, w in weights.items():
        if mx.issubdtype(w.dtype, mx.inexact) and not bool(mx.all(mx.isfinite(w))):
            raise ValueError(f"{path}: tensor {name} holds NaN or infinite values; this "
                             "adapter diverged and cannot be used")
    return weights


def check_adapter_folder(folder: str | Path) -> dict[str, mx.array]:
    """Both files of ``folder`` read and checked (above); return the weights."""
    read_adapter_config(folder)
    return read_adapter_weights(folder)


ADAPTER_LEAVES = ("lora_a", "lora_b", "m")  # what mlx-lm's load_adapters reads from the file


def check_whole(model: nn.Module, weights: dict[str, Any], folder: str | Path) -> None:
    """ValueError (one line) naming the first adapter parameter ``model`` has (the LoRA or
    DoRA layers its config built: mlx-lm's ``ADAPTER_LEAVES``) that ``weights`` lacks."""
    wanted = [k for k, _ in tree_flatten(model.parameters())
              if k.rsplit(".", 1)[-1] in ADAPTER_LEAVES]
    missing = [k for k in wanted if k not in weights]
    if missing:
        raise ValueError(f"{Path(folder) / ADAPTER_FILE}: lacks {len(missing)} of the "
                         f"{len(wanted)} parameters its {CONFIG_FILE} implies (first: "
                         f"{missing[0]}); it is not a whole adapter for this config. Train "
                         "or copy it again")


def one_line(err: ValueError) -> ValueError:
    """mlx-lm's multi-line refusal of extra or misshapen tensors, as its first two lines."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    more = f" (and {len(lines) - 2} more)" if len(lines) > 2 else ""
    return ValueError(" ".join(lines[:2]) + more)
