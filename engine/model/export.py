"""The export verb's request: which adapter, on which base, to which files (the adapter
fused into its base, engine/model/gguf_export.py; the adapter alone as llama.cpp's LoRA
GGUF, engine/model/gguf_adapter.py), in which type, every refusal made before any weight is
read.

The adapter is the folder given (``adapters.safetensors`` in it: a training run or an
adapter) or a sweep's or pipeline's ``best-adapter/`` in it. The base is ``--model``, else
the model the adapter's config names; an adapter Pomona trained records its base's content
key, and a base with other bytes is refused (the fused model would be neither).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.host.flags import check_choices, flag_field
from engine.host.outputs import RefusedOutput, check_file
from engine.model.adapters import ADAPTER_FILE, CONFIG_FILE
from engine.model.gguf_adapter import adapter_gguf_tensors, write_adapter_gguf
from engine.model.gguf_export import (
    TYPES,
    check_expressible,
    exported_here,
    fuse,
    gguf_arch,
    write_gguf,
)
from engine.model.source import model_dir, read_config, source_kind

BEST = "best-adapter"  # where a sweep or a pipeline puts the adapter it ranked first


@dataclass(frozen=True)
class ExportSettings:
    """What a spec's ``export:`` asks of a pipeline: the best adapter fused into its base as
    a GGUF of type ``gguf`` ("": none), and with ``gguf_adapter`` alone as llama.cpp's LoRA
    GGUF (float32), each beside ``best-adapter/``."""

    gguf: str = ""
    gguf_adapter: bool = False

    def __post_init__(self) -> None:
        if self.gguf and self.gguf not in TYPES:
            raise ValueError(f"export.gguf={self.gguf!r}: expected one of {', '.join(TYPES)}")
        if not isinstance(self.gguf_adapter, bool):
            raise ValueError(f"export.gguf_adapter={self.gguf_adapter!r}: expected true or "
                             "false")

    @property
    def any(self) -> bool:
        """Whether the pipeline writes a GGUF at all."""
        return bool(self.gguf or self.gguf_adapter)

    @classmethod
    def parse(cls, value: Any) -> ExportSettings:
        """A spec's ``export:`` value: absent, or a mapping with ``gguf``, ``gguf_adapter``
        or both."""
        if value is None:
            return cls()
        keys = {"gguf", "gguf_adapter"}
        if not isinstance(value, dict) or not value or set(value) - keys or not any(
                value.values()):
            raise ValueError(f"export={value!r}: expected a mapping such as {{gguf: q8_0}} "
                             f"(types: {', '.join(TYPES)}) or {{gguf_adapter: true}}")
        return cls(**value)


@dataclass(frozen=True, kw_only=True)
class ExportRequest:
    """What ``export`` is asked (``python -m engine export``, ``pomona export``); its fields
    are the verb's flags (engine/host/flags.py)."""

    target: str = flag_field("A training run, an adapter, or a sweep's folder (its "
                             "best-adapter/).", positional=True)
    gguf: str | None = flag_field("The GGUF file to write: the adapter fused into its base "
                                  "(never over a file).", None)
    gguf_adapter: str | None = flag_field(
        "The GGUF file to write the adapter alone to, as llama.cpp's LoRA adapter "
        "(llama-cli --lora, Ollama's ADAPTER), for the base's own GGUF (never over a file).",
        None)
    model: str | None = flag_field("The base model (default: the one the adapter names); a "
                                   "folder or a .gguf file.", None)
    type: str = flag_field("Tensor type.", "f32", choices=TYPES)

    def __post_init__(self) -> None:
        check_choices(self)
        if not self.gguf and not self.gguf_adapter:
            raise ValueError("export: give --gguf OUT.gguf (fused), --gguf-adapter "
                             "OUT.gguf (the adapter alone), or both")
        if self.gguf and self.gguf_adapter and Path(self.gguf) == Path(self.gguf_adapter):
            raise ValueError(f"--gguf and --gguf-adapter both name {self.gguf}: give two "
                             "files")


def adapter_of(target: Path) -> Path:
    """The adapter folder ``target`` names: itself, or its ``best-adapter/``."""
    for folder in (target, target / BEST):
        if (folder / ADAPTER_FILE).is_file() and (folder / CONFIG_FILE).is_file():
            return folder
    if not target.exists():
        raise ValueError(f"{target}: no such file or folder")
    if (target / "results.parquet").is_file():  # a sweep's folder, not ranked yet
        raise ValueError(f"{target}: a sweep with no {BEST}/ yet; run `pomona leaderboard "
                         f"{target} ...` first, which ranks its trials and writes it")
    raise ValueError(f"{target}: no adapter in it ({ADAPTER_FILE} and {CONFIG_FILE}, there "
                     f"or in {BEST}/): give a training run, an adapter or a sweep's folder")


def base_of(adapter: Path, model: str | None) -> str:
    """The base model to fuse ``adapter`` into: ``model``, else the one its config names;
    ValueError where the adapter records a base with other bytes."""
    from engine.model.content_key import model_fingerprint

    try:
        config = json.loads((adapter / CONFIG_FILE).read_text())
    except ValueError as err:
        raise ValueError(f"{adapter / CONFIG_FILE}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{adapter / CONFIG_FILE}: not the JSON object mlx-lm writes")
    if model:
        if not Path(model).exists():
            raise ValueError(f"--model {model}: no such file or folder")
    else:
        model = config.get("model")
        if not model:
            raise ValueError(f"{adapter / CONFIG_FILE}: names no base model; pass --model")
        if not isinstance(model, str):
            raise ValueError(f"{adapter / CONFIG_FILE}: \"model\" is {model!r}, not a path; "
                             "pass --model")
        if not Path(model).exists():
            raise ValueError(f"{model}: the base model {adapter / CONFIG_FILE} names is not "
                             "here; pass --model")
    recorded = (config.get("pomona") or {}).get("model_key")
    if recorded and model_fingerprint(model) != recorded:
        raise ValueError(f"{adapter} was trained on another model than {model} (its "
                         "bytes differ from the base it recorded); pass that base as --model")
    return model


def exportable(model: str) -> None:
    """ValueError naming what keeps ``model``'s family from a GGUF, read off its config
    alone: a pipeline asks before its sweep, not after it."""
    config = read_config(model_dir(model))
    check_expressible(config, gguf_arch(config))


def export(target: str | Path, out: str | Path, model: str | None = None,
           kind: str = "f32", ours: Callable[[Path], bool] = lambda _: False) -> Path:
    """``target``'s adapter fused into its base and written to the new file ``out`` as a
    GGUF of type ``kind``; return ``out``. ``ours``: which existing ``out`` the caller's
    own earlier export left (a pipeline's, in the folder it holds), replaced."""
    adapter, base = request_of(target, model, kind)
    replaceable = writable(Path(out), ours, [target, base], "--gguf")
    exportable(base)  # a family or setting it cannot write: refused before any load
    fused = fuse(base, adapter)
    return published(lambda: write_gguf(Path(out), fused, kind, tokenizer_source(base),
                                        replaceable), Path(out), "--gguf")


def export_adapter(target: str | Path, out: str | Path, model: str | None = None,
                   kind: str = "f32", ours: Callable[[Path], bool] = lambda _: False) -> Path:
    """``target``'s adapter alone written to the new file ``out`` as llama.cpp's LoRA GGUF
    for its base (the base's bytes checked as ``export``'s are, its weights never loaded);
    return ``out``. ``ours`` as ``export``'s."""
    adapter, base = request_of(target, model, kind)
    replaceable = writable(Path(out), ours, [target, base], "--gguf-adapter")
    exportable(base)
    config = read_config(model_dir(base))
    return published(lambda: write_adapter_gguf(Path(out), adapter, config, kind, replaceable),
                     Path(out), "--gguf-adapter")


def check_adapter_export(target: str | Path, model: str | None = None) -> None:
    """What ``export_adapter`` would refuse about ``target``'s adapter itself (DoRA, LoRA
    on the embedding, mixed ranks...), said before a fused export beside it is written."""
    adapter, base = request_of(target, model, "f32")
    adapter_gguf_tensors(adapter, read_config(model_dir(base)))


def request_of(target: str | Path, model: str | None, kind: str) -> tuple[Path, str]:
    """The adapter folder ``target`` names and the base it is exported on."""
    if kind not in TYPES:
        raise ValueError(f"--type {kind}: expected one of {', '.join(TYPES)}")
    adapter = adapter_of(Path(target))
    return adapter, base_of(adapter, model)


def writable(out: Path, ours: Callable[[Path], bool], inputs: list[Any],
             flag: str) -> Callable[[Path], bool]:
    """RefusedOutput where ``out`` holds a file that is neither ``ours`` nor empty; else
    which file found at ``out`` when it is published may be replaced: ours, or the empty
    one that was there already."""
    if out.is_file() and out.stat().st_size and not ours(out) and exported_here(out):
        raise RefusedOutput(f"{flag} {out}: exists (an earlier export wrote it); refusing to "
                            f"replace it. Remove it or choose another {flag}")
    check_file(out, ours, "a file", inputs=inputs, flag=flag)
    empty = out.stat().st_ino if out.is_file() else None  # check_file let only empty in

    def replaceable(path: Path) -> bool:
        st = path.stat()
        return ours(path) or (st.st_ino == empty and st.st_size == 0)

    return replaceable


def published(write: Callable[[], Path], out: Path, flag: str) -> Path:
    """``write()``, whose publish refuses a file that appeared at ``out`` meanwhile."""
    try:  # minutes on a real model: a file may have appeared at ``out`` meanwhile
        return write()
    except FileExistsError:
        raise RefusedOutput(f"{flag} {out}: a file appeared there while this export ran "
                            "(another export?); it is kept as it is and nothing was written. "
                            f"Choose another {flag}") from None


def tokenizer_source(base: str) -> Path:
    """Where the export's tokenizer comes from: the GGUF file the base is, or its folder
    (an import's ``gguf_tokenizer.json``, else ``tokenizer.json``)."""
    return Path(base) if source_kind(base) == "gguf" else model_dir(base)
