"""The tokenized dataset directory of DESIGN.md (schema version 1): shards + manifest.json.

Written atomically: everything goes into a hidden temporary directory, ``manifest.json``
last, and the directory is renamed into place only when complete — a crash leaves no
half dataset that looks complete (a dataset is valid only with its manifest).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
SCHEMA = pa.schema([
    ("id", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("chosen_ids", pa.list_(pa.int32())),
    ("rejected_ids", pa.list_(pa.int32())),
    ("prefix_shared", pa.bool_()),
    ("split", pa.string()),
])


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a complete dataset at ``path``, or None."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None
    return manifest if manifest.get("schema_version") == SCHEMA_VERSION else None


def read_table(path: Path) -> pa.Table:
    """All shards of a dataset directory, memory-mapped."""
    manifest = read_manifest(path)
    if manifest is None:
        raise FileNotFoundError(f"{path}: not a complete Pomona dataset (no valid {MANIFEST})")
    tables = [pq.read_table(Path(path) / s, memory_map=True) for s in manifest["shards"]]
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def write_dataset(out: Path, rows: dict[str, list], manifest: dict[str, Any],
                  shard_rows: int = 50_000) -> dict[str, Any]:
    """Write ``rows`` (column → values, SCHEMA's columns) and ``manifest`` to ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        table = pa.table({f.name: rows[f.name] for f in SCHEMA}, schema=SCHEMA)
        shards = []
        for i, start in enumerate(range(0, max(table.num_rows, 1), shard_rows)):
            name = f"shard-{i:05d}.parquet"
            pq.write_table(table.slice(start, shard_rows), tmp / name)
            shards.append(name)
        manifest = {"schema_version": SCHEMA_VERSION, **manifest, "shards": shards}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _swap_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _swap_into_place(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(out, old)  # between these two renames `out` is absent, never half-written
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
