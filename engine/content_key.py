"""Content keys for caches: a model (or a warm-start adapter) is its bytes, never its path.

Re-initialising or re-downloading a model in place keeps its path and changes its bytes;
a cache keyed on the path would reuse adapters trained on the old weights. Hashing a
multi-GB model on every sweep would cost minutes, so each file's SHA-256 is kept in
``$XDG_CACHE_HOME/pomona/file-hashes.json`` (default ``~/.cache``) under its resolved path
with its size, mtime and inode, and computed again only when one of them changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from engine.gguf_import import IMPORTER_VERSION
from engine.model_source import GGUF_DTYPE, model_dir, source_kind

MODEL_FILES = ("config.json", "*.safetensors", "tokenizer.json", "tokenizer_config.json")
ADAPTER_FILES = ("adapters.safetensors", "adapter_config.json")  # mlx-lm's adapter folder
_lock = threading.Lock()
_memory: dict[str, dict[str, Any]] = {}  # resolved path -> {"stat": [...], "sha256": ...}


def hash_cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "pomona" / "file-hashes.json"


def file_digest(path: str | Path) -> str:
    """SHA-256 of ``path``'s bytes, from the cache while its size, mtime and inode hold."""
    real = Path(path).resolve()  # a Hugging Face snapshot links to content-named blobs
    st = real.stat()
    stat = [st.st_size, st.st_mtime_ns, st.st_ino]
    key = str(real)
    with _lock:
        if not _memory:
            _memory.update(_read_cache())
        entry = _memory.get(key)
        if entry and entry.get("stat") == stat:
            return entry["sha256"]
    digest = hashlib.sha256()
    with real.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    with _lock:
        _memory[key] = {"stat": stat, "sha256": digest.hexdigest()}
        _write_cache(_memory)
    return digest.hexdigest()


def model_fingerprint(model: str) -> str:
    """What a model's results depend on: the hashes of its config, weights and tokenizer
    (a local directory, or a Hugging Face id already in the local cache); a hub id not
    downloaded yet is keyed on its name (its first download changes the key once)."""
    try:
        kind = source_kind(model)
        if kind == "gguf":  # imported by content (model_source)
            digest = file_digest(Path(model).expanduser())
            return f"gguf-{digest[:24]}-{GGUF_DTYPE}-v{IMPORTER_VERSION}"
        local = model_dir(model)
    except FileNotFoundError:  # not here, or not downloaded: no local bytes to hash
        return f"repo:{model}"
    files = sorted({p for pattern in MODEL_FILES for p in local.glob(pattern) if p.is_file()})
    if not files:
        return f"dir:{local.resolve()}"  # not a model directory: loading it will say so
    body = json.dumps({p.name: file_digest(p) for p in files}, sort_keys=True)
    return "model-" + hashlib.sha256(body.encode()).hexdigest()[:24]


def adapter_fingerprint(path: str | Path) -> str:
    """What a warm start trains from: its adapter files' bytes, never its path (an adapter
    re-trained in place keeps its path); a folder without them is keyed on its path
    (training from it will fail and say so)."""
    folder = Path(path).expanduser()
    digests = {name: file_digest(folder / name) for name in ADAPTER_FILES
               if (folder / name).is_file()}
    if not digests:
        return f"missing:{folder.resolve()}"
    body = json.dumps(digests, sort_keys=True)
    return "adapter-" + hashlib.sha256(body.encode()).hexdigest()[:24]


def _read_cache() -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(hash_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(entries: dict[str, dict[str, Any]]) -> None:
    """Best effort: a read-only home only costs hashing again next time."""
    path = hash_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, path)
    except OSError:
        pass
