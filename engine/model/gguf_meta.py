"""A GGUF's numbers checked before anything is built from them: the header's tensor and
key counts against the file's size, and each metadata value the config reads (a count at
least 1, a float finite and in range, a dimension no larger than the tensors hold).

A hostile or damaged header otherwise fails far from its cause: 2^62 tensors as the
reader's IndexError, head_count 0 as a ZeroDivisionError, a hidden size of 2^30 only once
mlx-lm's model is built to compare shapes, a NaN rope base or a negative rope factor as a
model that imports and trains on wrong positions. Each refusal is a ValueError naming the
key; the importer prefixes the file (engine/model/gguf_import.py). block_count is
compared with the blocks the tensors hold in engine/model/gguf_check.py.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

INT_MAX = 2**31 - 1  # MLX shapes are int32
# The fewest bytes a header entry can take: a tensor's name length (8), dimension count
# (4), one dimension (8), type (4) and offset (8); a key's length (8), type (4), value (1).
TENSOR_INFO_BYTES, KV_BYTES = 32, 13


class HeaderError(ValueError):
    """A header whose counts the file cannot hold (the reader's own errors are others)."""


def check_header(path: Path) -> None:
    """HeaderError unless the tensor and key counts of GGUF ``path``'s header fit its size
    (the reader would walk 2^62 entries off the file's end). Files too short to hold a
    header are left to the reader, which names them cut short."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        return
    order = ">" if struct.unpack("<I", head[4:8])[0] & 0xFFFF == 0 else "<"  # the reader's rule
    tensors, keys = struct.unpack(f"{order}QQ", head[8:24])
    size = path.stat().st_size
    if tensors * TENSOR_INFO_BYTES + keys * KV_BYTES > size - 24:
        raise HeaderError(f"its header states {tensors} tensors and {keys} metadata keys, "
                          f"more than a file of {size} bytes can hold: it is cut short or "
                          "damaged; fetch or export it again")


class Keys:
    """``meta``'s values under ``arch.``, each read once and checked; ValueError naming the
    key (``GGUF metadata has no K`` for a missing one, as before)."""

    def __init__(self, meta: dict[str, Any], arch: str):
        self.meta, self.arch = meta, arch

    def _value(self, name: str, default: Any) -> tuple[str, Any]:
        key = f"{self.arch}.{name}"
        value = self.meta.get(key, default)
        if value is None:
            raise ValueError(f"GGUF metadata has no {key}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key} is {value!r}, not a number; the file is damaged: "
                             "re-export it")
        return key, value

    def count(self, name: str, default: int | None = None, low: int = 1,
              high: int = INT_MAX) -> int:
        """A whole number in [``low``, ``high``]."""
        key, value = self._value(name, default)
        if not math.isfinite(value) or value != int(value) or not low <= value <= high:
            raise ValueError(f"{key} is {value}; it must be a whole number from {low} to "
                             f"{high}. The file is damaged: re-export it")
        return int(value)

    def real(self, name: str, default: float | None = None) -> float:
        """A finite number above 0 (an eps, a rope base or factor: 0 itself is no value of
        them; MLX's RMSNorm refuses eps 0)."""
        key, value = self._value(name, default)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{key} is {value}; it must be a finite number above 0. The "
                             "file is damaged: re-export it")
        return float(value)


def largest_dimension(tensors: dict[str, Any]) -> tuple[int, str]:
    """(the largest dimension of any tensor, that tensor's name); (0, '') for none."""
    return max(((int(n), name) for name, t in tensors.items() for n in t.shape),
               default=(0, ""))


def check_dimensions(arch: str, config: dict[str, Any], tensors: dict[str, Any]) -> None:
    """ValueError naming the key whose dimension exceeds every tensor's (a model of that
    size cannot be what the file holds; building it to compare would cost its size)."""
    largest, where = largest_dimension(tensors)
    if not largest:
        raise ValueError("the file holds no tensors; it is damaged or cut: re-export it")
    head = config["head_dim"]
    # the hidden size first: an unstated head size is derived from it
    sizes = {f"{arch}.embedding_length": config["hidden_size"],
             f"{arch}.feed_forward_length": config["intermediate_size"],
             f"{arch}.attention.key_length": head,
             f"{arch}.attention.head_count × head size {head}":
                 config["num_attention_heads"] * head,
             f"{arch}.attention.head_count_kv × head size {head}":
                 config["num_key_value_heads"] * head,
             "the token count of tokenizer.ggml.tokens": config["vocab_size"]}
    for label, size in sizes.items():
        if size > largest:
            raise ValueError(f"{label} is {size}, more than any tensor's dimension (the "
                             f"largest: {largest}, of {where!r}); the file is damaged: "
                             "re-export it")
