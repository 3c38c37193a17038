"""GGUF files (llama.cpp, Ollama, LM Studio) → a Hugging Face-layout directory mlx-lm loads.

The ``gguf`` package alone reads the file (no torch): its metadata is the config, and each
tensor is dequantized to float32 (``gguf.quants.dequantize``, every llama.cpp quant type),
renamed to mlx-lm's names, un-done where llama.cpp's converter changed it (each
architecture's rules: engine/model/gguf_archs.py), then cast to the chosen dtype. The
tokenizer is rebuilt from ``tokenizer.ggml.*`` by transformers' GGUF builders, which need
``tokenizers`` only; the chat template is kept when the file has one.

    pomona model import model.gguf --out models/m [--dtype bfloat16|float32] [--quantize 4]
    (no --dtype: bfloat16 where MLX runs on a GPU, float32 on a CPU)
    python -m engine train --model model.gguf ...   # imported once into the cache, by content

An architecture or quant type it does not know is a one-line error naming it; so is a
header or metadata value no model can have (engine/model/gguf_meta.py: head_count 0, a NaN
rope base, block_count beyond the tensors), and a tensor holding NaN or inf, found as it is
converted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.host.digests import sha256_file
from engine.host.scratch import work_folder
from engine.model.gguf_archs import ARCHS, Arch, gguf_name, hf_name, unpermute_qk
from engine.model.gguf_check import check_tensors
from engine.model.gguf_meta import HeaderError, check_header
from engine.model.gguf_tokenizer import build_tokenizer, fix_tokenizer_class
from engine.model.gguf_vocab import SAVED, source_fields

MARK = "pomona_model.json"  # what Pomona writes beside every model directory it makes
IMPORTER_VERSION = 2  # part of the cache key: a fix here re-imports cached files
DTYPES = ("bfloat16", "float16", "float32")
SHARD_BYTES = 4 << 30
ProgressFn = Callable[[int, int], None]  # (tensors done, tensors in all)


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every scalar and string field, and the tokenizer's arrays (others skipped: large)."""
    import gguf

    keep = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
            "tokenizer.ggml.token_type")
    out = {}
    for key, field in reader.fields.items():
        is_array = field.types and field.types[0] == gguf.GGUFValueType.ARRAY
        if is_array and key not in keep and not key.startswith("general."):
            continue
        out[key] = field.contents()
    return out


def gguf_layer_count(path: str | Path) -> int | None:
    """``{arch}.block_count`` from a GGUF's header (the tensors are not read), or None
    where the file is not a readable GGUF or does not state it."""
    import gguf

    try:
        fields = gguf.GGUFReader(str(path)).fields
        arch = fields["general.architecture"].contents()
        return int(fields[f"{arch}.block_count"].contents())
    except Exception:  # any unreadable header (a truncated file: IndexError); loading names it
        return None


def _arch_of(meta: dict[str, Any], path: Path) -> Arch:
    name = meta.get("general.architecture")
    if name not in ARCHS:
        raise ValueError(f"{path}: GGUF architecture {name!r} is not supported; supported: "
                         f"{', '.join(sorted(ARCHS))}")
    return ARCHS[name]


def tensor_values(arch: Arch, config: dict[str, Any], tensor: Any) -> np.ndarray:
    """Tensor ``tensor`` of a GGUFReader as float32 in mlx-lm's layout and convention."""
    from gguf.quants import dequantize

    w = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32)
    w = w.reshape([int(n) for n in reversed(tensor.shape)])  # GGUF lists dims innermost first
    if arch.permute_qk and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
        kv = tensor.name.endswith("attn_k.weight")
        w = unpermute_qk(w, config["num_key_value_heads" if kv else "num_attention_heads"])
    if arch.norm_offset and tensor.name.endswith("norm.weight"):
        w = w - arch.norm_offset
    return w


def check_quant_types(tensors: list, path: Path) -> None:
    """ValueError naming the first tensor whose quant type the gguf package cannot
    dequantize (each type tried once on one zero block), before any work."""
    import gguf
    from gguf.quants import dequantize

    seen: set[int] = set()
    for t in tensors:
        if t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        block = np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8)
        try:
            dequantize(block, qtype)
        except NotImplementedError as err:
            raise ValueError(f"{path}: tensor {t.name!r} is {qtype.name}, a quant type the "
                             "gguf package cannot dequantize; re-export the model in another "
                             "type (Q8_0, Q4_K_M, F16, ...)") from err


def _shards(items: Iterator[tuple[str, Any]], limit: int) -> Iterator[dict[str, Any]]:
    shard, size = {}, 0
    for name, array in items:
        if shard and size + array.nbytes > limit:
            yield shard
            shard, size = {}, 0
        shard[name] = array
        size += array.nbytes
    if shard:
        yield shard


def _write_weights(stage: Path, arrays: Iterator[tuple[str, Any]]) -> None:
    import mlx.core as mx

    names: dict[str, str] = {}
    files = []
    for shard in _shards(arrays, SHARD_BYTES):
        file = stage / f"model-{len(files) + 1:05d}.safetensors"
        mx.save_safetensors(str(file), shard, metadata={"format": "mlx"})
        files.append(file)
        names.update(dict.fromkeys(shard, file.name))
    if len(files) == 1:
        files[0].rename(stage / "model.safetensors")
        return
    total = sum(f.stat().st_size for f in files)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(names.items()))}
    (stage / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def check_new_folder(out: Path) -> Path:
    """The folder an import of ``out`` writes: ``out``, or the folder a symlink ``out``
    points to. FileExistsError unless it is absent or an empty folder: an import never
    replaces files."""
    if out.is_symlink() and not out.is_dir():
        raise FileExistsError(f"{out} is a symlink to {os.readlink(out)}, not to a folder: "
                              "choose a new --out")
    folder = out.resolve() if out.is_symlink() else out
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder: choose a new --out "
                              "(an import never replaces files)")
    return folder


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF file read and understood: everything the import writes comes from here."""

    path: Path
    meta: dict[str, Any]
    arch: Arch
    config: dict[str, Any]
    tensors: list  # the gguf reader's tensors to write
    names: dict[str, str]  # GGUF tensor name -> mlx-lm name
    tokenizer: Any


def platform_dtype() -> str:
    """The dtype an import writes where the user names none: bfloat16 where MLX runs on a
    GPU, float32 on a CPU, which has no fast bf16 path (SmolLM2 trains at 13 tok/s in bf16
    there, ~200 in float32)."""
    import mlx.core as mx

    return "bfloat16" if mx.default_device() == mx.gpu else "float32"


def check_options(dtype: str, quantize: int | None) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if quantize not in (None, 4, 8):
        raise ValueError(f"quantize {quantize}: expected 4 or 8")


def read_gguf(path: Path) -> GGUFModel:
    """``path`` read, its architecture, quant types, tensor names, config and tokenizer
    checked: every refusal but a tensor's non-finite values (``_arrays``) comes before any
    tensor is converted, as one line naming the file (and the key, tensor or type)."""
    import gguf

    try:
        check_header(path)  # counts the file cannot hold: the reader would walk off its end
        reader = gguf.GGUFReader(str(path))
        meta = read_metadata(reader)
    except OSError as err:
        raise ValueError(f"{path}: cannot read it ({err.strerror or err})") from err
    except HeaderError as err:
        raise ValueError(f"{path}: {err}") from err
    except Exception as err:  # a file cut short fails as IndexError, struct or numpy errors
        raise ValueError(f"{path}: not a readable GGUF file, or cut short "
                         f"({type(err).__name__}: {err}); fetch or export it again") from err
    arch = _arch_of(meta, path)
    check_quant_types(list(reader.tensors), path)
    tensors = [t for t in reader.tensors if t.name not in arch.extra]
    try:
        config = arch.config(meta, {t.name: t for t in reader.tensors})
        names = {t.name: hf_name(arch, t.name) for t in tensors}
    except KeyError as err:
        raise ValueError(f"{path}: GGUF metadata has no {err.args[0]}") from err
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err
    check_tensors(path, config, {names[t.name]: tuple(int(n) for n in reversed(t.shape))
                                 for t in tensors}, lambda hf: gguf_name(arch, hf))
    try:
        tokenizer = build_tokenizer(meta)
    except Exception as err:  # transformers' builders fail in many ways: name the file
        raise ValueError(f"{path}: cannot build its tokenizer from tokenizer.ggml.* "
                         f"({type(err).__name__}: {err})") from err
    return GGUFModel(path, meta, arch, config, tensors, names, tokenizer)


def import_gguf(path: str | Path, out: str | Path, dtype: str | None = None,
                quantize: int | None = None, progress: ProgressFn | None = None) -> Path:
    """Write ``path`` (a .gguf) to the new directory ``out`` as an mlx-lm model; return it.

    ``dtype``: the weights' dtype (None: ``platform_dtype``); ``quantize`` 4 or 8: then quantized by
    ``mlx_lm.convert`` (the path any other checkpoint takes). Written in a hidden work
    folder beside ``out`` and renamed, so ``out`` never holds half a model; a killed
    import's work folder is removed by the next import there (engine/host/scratch.py).
    """
    from mlx_lm.utils import save_config

    path, out = Path(path), Path(out)
    dtype = dtype or platform_dtype()
    check_options(dtype, quantize)
    folder = check_new_folder(out)  # a symlink's target: the link itself stays
    model = read_gguf(path)
    with work_folder(folder.parent, folder.name) as tmp:  # stale ones of killed imports go
        stage = Path(tmp) / "float"
        stage.mkdir()
        _write_weights(stage, _arrays(model, dtype, progress))
        save_config(model.config, config_path=stage / "config.json")
        model.tokenizer.save_pretrained(str(stage))
        fix_tokenizer_class(stage)
        # The source's own tokenizer fields: an export copies them back (gguf_vocab.py).
        (stage / SAVED).write_text(json.dumps(source_fields(model.meta)) + "\n")
        mark = {"source": "gguf", "file": path.name, "sha256": sha256_file(path),
                "architecture": model.meta["general.architecture"],
                "name": model.meta.get("general.name"), "dtype": dtype, "quantize": quantize,
                "importer": IMPORTER_VERSION}
        if quantize:
            stage = _quantized(stage, Path(tmp) / "quantized", quantize)
        (stage / MARK).write_text(json.dumps(mark, indent=2) + "\n")
        try:
            os.replace(stage, folder)  # atomic; an empty folder is replaced, others refused
        except OSError as err:
            raise FileExistsError(f"{out} is not empty: choose a new --out") from err
    return out


def _arrays(model: GGUFModel, dtype: str, progress: ProgressFn | None
            ) -> Iterator[tuple[str, Any]]:
    """(mlx-lm name, weights in ``dtype``) per tensor, one at a time (never the whole model
    in float32); ValueError naming the file and the first tensor holding NaN or inf."""
    import mlx.core as mx

    for done, t in enumerate(model.tensors, 1):
        values = tensor_values(model.arch, model.config, t)
        finite = np.isfinite(values)  # a NaN weight trains as NaN, far from its cause
        if not finite.all():  # ~0.05 s per 135M values
            bad = int(finite.size - finite.sum())
            raise ValueError(f"{model.path}: tensor {t.name!r} holds {bad} NaN or infinite "
                             "values; the file is damaged: re-export it")
        yield model.names[t.name], mx.array(values).astype(getattr(mx, dtype))
        if progress:
            progress(done, len(model.tensors))


def _quantized(stage: Path, target: Path, bits: int) -> Path:
    import contextlib
    import io

    from mlx_lm.convert import convert

    with contextlib.redirect_stdout(io.StringIO()):  # convert prints [INFO] lines
        convert(str(stage), str(target), quantize=True, q_bits=bits)
    return target
