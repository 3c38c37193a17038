"""A GGUF's tensors checked against the config its metadata states, before any is converted.

A file whose ``block_count`` says 3 but holds 2 layers, that lacks a tensor or holds one of
the wrong shape would import and fail only at load, naming no file. The layers the tensor
names hold are compared with ``block_count`` first (``check_blocks``: the model is built at
the stated depth, so 200,000 layers must be refused before it); then mlx-lm's own model
class, built lazily from the config (no weights are made), says which parameters of which
shapes the model needs; every difference is refused here in one line naming the file and
the tensor or field.
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


def check_blocks(path: Path, layers: int, found: dict[str, tuple[int, ...]],
                 gguf_name: Callable[[str], str]) -> None:
    """ValueError, one line naming ``path``, unless ``found``'s layer tensors fill every
    block 0 … ``layers`` − 1: read from the names alone, before any model is built (one of
    block_count 200000 over 2 blocks took 23 GB). Blocks beyond are ``check_tensors``': the
    model it builds is then no deeper than the file's own tensors."""
    blocks: dict[int, list[str]] = {}
    for name in found:
        parts = name.split(".")
        if parts[1:2] == ["layers"]:
            blocks.setdefault(int(parts[2]), []).append(name)
    if not blocks:
        raise ValueError(f"{path}: the metadata says block_count {layers}, but the file "
                         "holds no blk.* tensors; the file is damaged or cut: re-export it")
    held = sum(i < layers for i in blocks)
    if held < layers:
        gap = next(i for i in range(layers) if i not in blocks)
        like = blocks[min(blocks)]  # a present block's tensors, renamed to the gap's
        first = min(f"model.layers.{gap}.{n.split('.', 3)[3]}" for n in like)
        _missing(path, first, len(like) * (layers - held), layers, gguf_name)


def check_tensors(path: Path, config: dict[str, Any], found: dict[str, tuple[int, ...]],
                  gguf_name: Callable[[str], str]) -> None:
    """ValueError, one line naming ``path``, unless ``found`` (mlx-lm name -> shape as
    imported) is exactly the tensors ``config`` needs. ``gguf_name``: an mlx-lm name's
    GGUF tensor name, for the message."""
    layers = config["num_hidden_layers"]
    check_blocks(path, layers, found, gguf_name)  # before building a model of that depth
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
        _missing(path, missing[0], len(missing), layers, gguf_name)


def _missing(path: Path, first: str, count: int, layers: int,
             gguf_name: Callable[[str], str]) -> None:
    more = f" (and {count - 1} more)" if count > 1 else ""
    raise ValueError(f"{path}: tensor {gguf_name(first)!r}{more} is missing: the metadata "
                     f"says block_count {layers}; the file is damaged or cut: re-export it")


def _layer_order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return (int(parts[2]) if parts[1:2] == ["layers"] else -1, name)
