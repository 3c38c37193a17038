"""W&B's offline run files (``run-<id>.wandb``) read back as protobuf records, for the
tests: wandb 0.2x+ ships no Python reader (its core is Go). The format is LevelDB's log:
a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of records, each a 7-byte
header (CRC, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

BLOCK, HEADER = 32768, 7


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    pos, chunk, out = HEADER, b"", []
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header: padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0:
            break
        chunk += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def runs(folder: Path) -> dict[str, dict[str, Any]]:
    """Each offline run under ``folder/wandb`` by its name: group, history rows (by
    ``_step``), record kinds, exit code."""
    import json

    found: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(folder).glob("wandb/offline-run-*/run-*.wandb")):
        got: dict[str, Any] = {"history": [], "kinds": set(), "exit": None}
        for r in records(path):
            kind = r.WhichOneof("record_type")
            got["kinds"].add(kind)
            if kind == "run":
                got.update(name=r.run.display_name, group=r.run.run_group, id=r.run.run_id)
            elif kind == "history":
                got["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                       for i in r.history.item})
            elif kind == "exit":
                got["exit"] = r.exit.exit_code
        found[got["name"]] = got
    return found
