"""Content digests the engine and the data tasks share: a file's SHA-256 and a tokenizer's
fingerprint.

``file_digest``: hashing a multi-GB model on every sweep or load would cost minutes, so
each file's SHA-256 is kept in ``file-hashes.json`` of the cache root (engine/host/cache.py)
under its resolved path with its size, mtime, inode and ctime, and computed
again only when one of them changes: ctime because a tool that writes in place and puts
the mtime back (``rsync --inplace -t``, ``touch -r``) cannot set it. ``sha256_file``
always reads the bytes (a download or a shard checked against its stored hash).

``pomona data tokenize`` writes ``tokenizer_hash(model_dir)`` into a dataset's manifest
(docs/design.md, the data contract); the trainer, scoring and evaluation compute it again for
the model they load and refuse data tokenized for another vocabulary (engine/data/data_fit.py).
Both sides must hash alike, so the one definition lives here, below both. Standard
library only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from pathlib import Path
from typing import Any

from engine.host.atomic import atomic_write_text
from engine.host.cache import cache_root

# What decides how text becomes ids: the tokenizer itself and the settings of its config
# that change an encoding. A copy written by another tool (mlx_lm.convert re-saves the
# tokenizer with its own class name and load flags) is the same tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model")
ENCODING_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space", "bos_token",
                 "eos_token", "unk_token", "pad_token", "added_tokens_decoder",
                 "chat_template", "legacy")


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of ``path``'s bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _canonical(path: Path) -> bytes:
    """A JSON file's content whatever its layout (a file that is not JSON: its bytes)."""
    try:
        return json.dumps(json.loads(path.read_text()), sort_keys=True).encode()
    except (ValueError, UnicodeDecodeError):
        return path.read_bytes()


def tokenizer_hash(model_dir: str | Path) -> str:
    """The fingerprint of ``model_dir``'s tokenizer: its TOKENIZER_FILES' names and content
    (JSON read, not its bytes) and the ENCODING_KEYS of ``tokenizer_config.json``."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (Path(model_dir) / name).exists():
            h.update(name.encode() + hashlib.sha256(_canonical(Path(model_dir) / name))
                     .hexdigest().encode())
    config_path = Path(model_dir) / "tokenizer_config.json"
    if config_path.exists():
        try:
            config = json.loads(config_path.read_text())
        except ValueError:
            config = {"unreadable": config_path.read_text(errors="replace")}
        kept = {k: config.get(k) for k in ENCODING_KEYS} if isinstance(config, dict) else config
        h.update(b"tokenizer_config.json" + json.dumps(kept, sort_keys=True).encode())
    return h.hexdigest()


_lock = threading.Lock()
_memory: dict[str, dict[str, Any]] = {}  # resolved path -> {"stat": [...], "sha256": ...}
_deferred, _dirty = [0], [False]  # inside file_digests: the cache file written at its end


def hash_cache_path() -> Path:
    return cache_root() / "file-hashes.json"


def file_digests(paths: list[Path]) -> list[str]:
    """``file_digest`` of each, the cache file written once at the end (a folder of many
    inputs would otherwise rewrite it once per file)."""
    _deferred[0] += 1
    try:
        return [file_digest(p) for p in paths]
    finally:
        _deferred[0] -= 1
        with _lock:
            if _dirty[0] and not _deferred[0]:
                _write_cache(_memory)
                _dirty[0] = False


def file_digest(path: str | Path) -> str:
    """SHA-256 of ``path``'s bytes, from the cache while its size, mtime, inode and ctime
    hold."""
    real = Path(path).resolve()  # a Hugging Face snapshot links to content-named blobs
    st = real.stat()
    stat = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
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
        _dirty[0] = bool(_deferred[0])
        if not _deferred[0]:
            _write_cache(_memory)
    return digest.hexdigest()


def _read_cache() -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(hash_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(entries: dict[str, dict[str, Any]]) -> None:
    """Best effort: a read-only home only costs hashing again next time."""
    with contextlib.suppress(OSError):  # a full disk: no temporary left behind
        atomic_write_text(hash_cache_path(), json.dumps(entries))
