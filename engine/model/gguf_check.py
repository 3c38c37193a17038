"""A GGUF's tensors checked against the config its metadata states, before any is converted.

A file whose ``block_count`` says 3 but holds 2 layers, that lacks a tensor, holds one of
the wrong shape, or states no layers at all would import and fail only at load, naming no
file. mlx-lm's own model class, built lazily from the config (no weights are made), says
which parameters of which shapes the model needs; every difference is refused here in one
line naming the file and the tensor or field.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """mlx-lm's parameter name -> shape for the model ``config`` describes (lazy: MLX never
    evaluates the random initial weights, so a 7B costs no memory)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes  # mlx-lm's own model_type mapping

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    del model
    mx.clear_cache()
    if config.get("text_config", config).get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)  # gemma3_text ties when the head is absent
    return shapes


def check_tensors(path: Path, config: dict[str, Any], found: dict[str, tuple[int, ...]],
                  gguf_name: Callable[[str], str]) -> None:
    """ValueError, one line naming ``path``, unless ``found`` (mlx-lm name -> shape as
    imported) is exactly the tensors ``config`` needs. ``gguf_name``: an mlx-lm name's
    GGUF tensor name, for the message."""
    layers = config["num_hidden_layers"]
    if layers < 1:
        raise ValueError(f"{path}: block_count is {layers}; a model needs at least one layer. "
                         "The file is damaged or not a decoder: re-export it")
    expected = expected_shapes(config)
    for name, shape in found.items():
        want = expected.get(name)
        if want is None:
            raise ValueError(f"{path}: tensor {gguf_name(name)!r} does not belong to a "
                             f"{layers}-layer {config['model_type']} (block_count {layers}); "
                             "the file is damaged: re-export it")
        if tuple(shape) != want:
            raise ValueError(f"{path}: tensor {gguf_name(name)!r} has shape {list(shape)}, "
                             f"but the metadata's config needs {list(want)}; the file is "
                             "damaged: re-export it")
    missing = sorted(set(expected) - set(found), key=_layer_order)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{path}: tensor {gguf_name(missing[0])!r}{more} is missing: the "
                         f"metadata says block_count {layers}; the file is damaged or cut: "
                         "re-export it")


def _layer_order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return (int(parts[2]) if parts[1:2] == ["layers"] else -1, name)

