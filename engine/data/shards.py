"""A tokenized dataset's shards checked against its manifest, and its split rule: the bytes
tokenize wrote, split by prompt, or a one-line refusal. Every reader runs it
(engine/data/pairs.py, preprocess, a sweep's data key), so a shard edited in place (chosen
and rejected swapped by pandas, the manifest kept) is never trained on, cached or re-split
as if tokenize had written it.

The manifest records each shard's size and SHA-256 (``shard_files``); a reader checks them
through the stat-keyed hash cache (engine/host/digests.py: a file rewritten changes its
mtime, inode or ctime and is hashed again). A manifest from before ``shard_files`` is
checked by the rows each shard's footer counts, which an edit of values cannot show.

A dataset tokenized before splits were drawn by prompt (its manifest has no ``split_by``)
may hold one prompt's pairs in train and in test, a held-out figure partly trained on: it
is refused, naming the remedy, and tokenize writes it again with a note of the rows moved.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.host.digests import file_digest

MANIFEST = "manifest.json"
SPLIT_BY = "prompt"  # a manifest's split_by: splits drawn from each row's group (its prompt)


def shards_problem(path: Path, manifest: dict[str, Any],
                   digest: Callable[[Path], str] = file_digest) -> str | None:
    """What is wrong with the shards of the dataset at ``path`` against its ``manifest``
    (one missing, cut short or changed), or None; ``digest``: a shard's SHA-256."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    listed = manifest.get("shard_files")
    for name in manifest.get("shards", []):
        shard = Path(path) / name
        if not shard.is_file():
            return f"its shard {name} is missing"
        if isinstance(listed, dict) and name in listed:
            want, size = listed[name], shard.stat().st_size
            if size != want.get("bytes"):
                return f"its shard {name} holds {size} bytes, the manifest says {want['bytes']}"
            if digest(shard) != want.get("sha256"):
                return f"its shard {name} changed since it was written (SHA-256 differs)"
    if isinstance(listed, dict):
        return None
    try:
        rows = sum(pq.read_metadata(Path(path) / n).num_rows for n in manifest["shards"])
    except (OSError, KeyError, TypeError, pa.ArrowException) as err:
        return f"a shard cannot be read ({err})"
    total = (manifest.get("rows") or {}).get("total")
    return None if rows == total else f"its shards hold {rows} rows, the manifest says {total}"


def read_dataset_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of the dataset folder ``path`` as a mapping, or None (no dataset here:
    the reader's own error says so)."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def check_shards(path: Path, manifest: dict[str, Any] | None = None) -> None:
    """ValueError (one line, naming the dataset and the shard) unless the dataset folder
    ``path`` holds the shards its manifest (read when not given) recorded."""
    manifest = manifest if manifest is not None else read_dataset_manifest(path)
    if isinstance(manifest, dict) and (problem := shards_problem(Path(path), manifest)):
        raise ValueError(f"{path}: {problem}; it was edited since tokenize. Tokenize it "
                         "again (`pomona data tokenize`) rather than edit its shards")


def split_problem(manifest: dict[str, Any]) -> str | None:
    """Why the dataset of ``manifest`` cannot be trusted to keep a prompt in one split, or
    None."""
    if manifest.get("split_by") == SPLIT_BY:
        return None
    return ("it was tokenized before splits kept each prompt's pairs together (a prompt's "
            "pairs may sit in train and in test). Tokenize it again (`pomona data "
            "tokenize`), which re-splits it by prompt")


def check_dataset(path: Path, manifest: dict[str, Any] | None = None) -> None:
    """``check_shards`` and the split rule: ValueError (one line) unless the dataset folder
    ``path`` is as tokenize wrote it, split by prompt."""
    manifest = manifest if manifest is not None else read_dataset_manifest(path)
    if not isinstance(manifest, dict):
        return
    check_shards(path, manifest)
    if (problem := split_problem(manifest)) is not None:
        raise ValueError(f"{path}: {problem}")
