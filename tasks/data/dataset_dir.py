"""The tokenized dataset directory of docs/design.md (schema version 1): shards + manifest.json.

Written atomically: everything goes into a hidden temporary directory, ``manifest.json``
last, and the directory is renamed into place only when complete — a crash leaves no
half dataset that looks complete (a dataset is valid only with its manifest). Only a
Pomona dataset is ever replaced: any other folder at ``out`` is refused, never deleted
(engine/host/outputs.py holds the rule every writer follows; a dataset's mark is its manifest).
Hidden temporaries a killed run left behind are removed by the next write.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from engine.data.shards import check_shards
from engine.host.digests import sha256_file
from engine.host.outputs import RefusedOutput, entries
from engine.host.scratch import process_alive

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
SCHEMA = pa.schema([
    ("id", pa.string()),
    ("group", pa.string()),  # the split key: the row's group field, else its prompt's hash
    ("prompt_ids", pa.list_(pa.int32())),
    ("chosen_ids", pa.list_(pa.int32())),
    ("rejected_ids", pa.list_(pa.int32())),
    ("prefix_shared", pa.bool_()),
    ("split", pa.string()),
])
# A temporary whose owner cannot be checked (another machine, or an older Pomona's name
# without one) is stale only after this long: a live write finishes in minutes.
STALE_AFTER_S = 24 * 3600
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a complete dataset at ``path``, or None."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(manifest, dict):
        return None
    return manifest if manifest.get("schema_version") == SCHEMA_VERSION else None


def read_table(path: Path, check: bool = True) -> pa.Table:
    """All shards of a dataset directory, memory-mapped; ``check``: the shards the manifest
    recorded, or ValueError (engine/data/shards.py)."""
    manifest = read_manifest(path)
    if manifest is None:
        raise FileNotFoundError(f"{path}: not a complete Pomona dataset (no valid {MANIFEST})")
    if check:
        check_shards(Path(path), manifest)  # edited since tokenize: never re-split as if not
    tables = [pq.read_table(Path(path) / s, memory_map=True) for s in manifest["shards"]]
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def check_replaceable(out: Path) -> None:
    """Raise RefusedOutput unless ``out`` is absent, an empty folder or a Pomona dataset
    holding nothing but its manifest and shards (what replacing it would delete)."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink():  # replacing it would replace the link, not the folder it names
        raise RefusedOutput(f"--out {out}: is a symbolic link (to {os.readlink(out)}); "
                            f"give the folder itself: --out {out.resolve()}")
    if not out.is_dir():
        raise RefusedOutput(f"--out {out}: exists and is not a folder; refusing to replace "
                            "it. Choose another --out")
    names = set(entries(out))
    if not names:
        return
    try:  # any schema version: an older Pomona's dataset is still ours to replace
        manifest = json.loads((out / MANIFEST).read_text())
        shards = set(manifest["shards"]) if "schema_version" in manifest else None
    except (OSError, ValueError, TypeError, KeyError):
        shards = None
    if shards is None:
        raise RefusedOutput(f"--out {out}: exists and is not a Pomona dataset (no {MANIFEST}"
                            "); refusing to replace it. Choose a new or empty folder")
    if other := sorted(names - shards - {MANIFEST}):
        raise RefusedOutput(f"--out {out}: a Pomona dataset that also holds "
                            f"{', '.join(other[:3])}{' …' if len(other) > 3 else ''}; refusing "
                            "to delete them. Move them out or choose another --out")


def write_dataset(out: Path, rows: dict[str, list], manifest: dict[str, Any],
                  shard_rows: int = 50_000, schema: pa.Schema = SCHEMA) -> dict[str, Any]:
    """Write ``rows`` (column → values, ``schema``'s columns: a pair dataset's, or a prompts
    dataset's) and ``manifest`` to ``out``."""
    out = Path(out)
    check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    tmp = out.with_name(f".{out.name}.tmp-{HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        table = pa.table({f.name: rows[f.name] for f in schema}, schema=schema)
        shards = []
        for i, start in enumerate(range(0, max(table.num_rows, 1), shard_rows)):
            name = f"shard-{i:05d}.parquet"
            pq.write_table(table.slice(start, shard_rows), tmp / name)
            shards.append(name)
        files = {name: {"bytes": (tmp / name).stat().st_size,
                        "sha256": sha256_file(tmp / name)} for name in shards}
        manifest = {"schema_version": SCHEMA_VERSION, **manifest, "shards": shards,
                    "shard_files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        check_replaceable(out)  # again: something may have appeared there meanwhile
        _swap_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _swap_into_place(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.replace(out, old)  # between these two renames `out` is absent, never half-written
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _is_stale(path: Path, host: str | None, pid: str | None) -> bool:
    if host == HOST and pid is not None:
        return int(pid) != os.getpid() and not process_alive(int(pid))
    try:
        return time.time() - path.stat().st_mtime > STALE_AFTER_S
    except OSError:
        return False


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Delete the hidden temporaries of ``out`` whose writer is gone (killed mid-write).

    An ``.old-`` copy is the previous dataset, moved aside for the swap: it is removed only
    once ``out`` exists again, never when it is the last copy.
    """
    out = Path(out)
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(tmp|old)-(?:([0-9a-f]{{6}})-(\d+)-)?"
                         r"[0-9a-f]{8}")
    removed = []
    for path in out.parent.iterdir():  # not glob: a name may hold [ or *
        m = pattern.fullmatch(path.name)
        if m is None or not path.is_dir() or not _is_stale(path, m.group(2), m.group(3)):
            continue
        if m.group(1) == "old" and not out.exists():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
