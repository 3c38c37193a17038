"""Content keys for caches: a model (or a warm-start adapter) is its bytes, never its path.

Re-initialising or re-downloading a model in place keeps its path and changes its bytes;
a cache keyed on the path would reuse adapters trained on the old weights. Each file's
SHA-256 comes from ``engine.host.digests.file_digest`` (cached by size, mtime and inode).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine.host.digests import file_digest
from engine.model.gguf_import import IMPORTER_VERSION
from engine.model.source import GGUF_DTYPE, model_dir, source_kind
from engine.settings.reference_kind import Reference, adapter_path

MODEL_FILES = ("config.json", "*.safetensors", "tokenizer.json", "tokenizer_config.json")
ADAPTER_FILES = ("adapters.safetensors", "adapter_config.json")  # mlx-lm's adapter folder


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


def reference_key(reference: Reference) -> str:
    """A DPO reference by content: ``base``, or its adapter's bytes (``adapter_fingerprint``,
    never its path). The one key every cache of a reference reads: the reference
    log-probs, a checkpoint's settings, an evaluation, a trial's cache key."""
    folder = adapter_path(reference)
    return "base" if folder is None else adapter_fingerprint(folder)
