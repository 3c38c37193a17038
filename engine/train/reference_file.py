"""The reference log-prob file: one Parquet file a reference (engine/train/reference.py),
columns ``id``, ``ref_chosen_logps``, ``ref_rejected_logps`` and its content key in the schema
metadata. Written whole, its space claimed before the pass that fills it, and read back only
when it carries the key asked for, every row is one id and two finite log-probs <= 0 (a
file edited by hand is refused naming the file, the column and the row), and its columns
still have the digest written beside the key (values edited with the key kept would train
against a reference nobody computed: engine/train/reference.py computes the cache's file
again, saying so; a file the user named is refused).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import math
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from engine.host.atomic import write_atomic

KEY_FIELD = b"pomona_reference_key"
DIGEST_FIELD = b"pomona_reference_sha256"  # of the columns' values, in row order
COLUMNS = ("id", "ref_chosen_logps", "ref_rejected_logps")


def write_reference(path: Path, key: str, refs: dict[str, tuple[float, float]]) -> None:
    """``refs`` as a Parquet file with ``key`` in its metadata, written atomically."""
    ids = sorted(refs)
    table = pa.table({"id": ids,
                      "ref_chosen_logps": pa.array([refs[i][0] for i in ids], pa.float32()),
                      "ref_rejected_logps": pa.array([refs[i][1] for i in ids], pa.float32())})
    table = table.replace_schema_metadata({KEY_FIELD: key.encode(),
                                            DIGEST_FIELD: values_digest(table).encode()})
    write_atomic(path, lambda tmp: pq.write_table(table, tmp))


def values_digest(table: pa.Table) -> str:
    """SHA-256 of the ids and of both log-prob columns as little-endian float32, row by
    row (what a read returns, whatever the file's float width)."""
    h = hashlib.sha256("\0".join(table.column("id").to_pylist()).encode())
    for name in COLUMNS[1:]:
        values = table.column(name).cast(pa.float32()).to_numpy(zero_copy_only=False)
        h.update(np.ascontiguousarray(values, dtype="<f4").tobytes())
    return h.hexdigest()


def check_digest(path: Path, table: pa.Table) -> None:
    """ValueError naming ``path`` unless its columns have the digest written with them."""
    stored = (table.schema.metadata or {}).get(DIGEST_FIELD, b"").decode()
    if not stored:
        raise ValueError(f"{path}: no digest of its log-probs (written by another tool or "
                         "an older Pomona), so nothing says they are the reference's; "
                         "recompute the file")
    if stored != values_digest(table):
        raise ValueError(f"{path}: its log-probs are not the ones written with its key "
                         f"(their digest is {values_digest(table)[:12]}…, the file says "
                         f"{stored[:12]}…): edited since; recompute the file")


def reserve(path: Path, size: int = 1 << 20) -> None:
    """Claim ``size`` bytes beside ``path`` before the pass and give them back: a full disk
    (or a read-only cache) is an OSError naming ``path`` now, not after every forward."""
    probe = path.with_name(f".{path.name}.{os.getpid()}.reserve")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # no fallocate (macOS): the create alone is the check
        with open(probe, "wb") as f, contextlib.suppress(AttributeError):
            try:
                os.posix_fallocate(f.fileno(), 0, size)
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
    except OSError as err:
        raise OSError(err.errno, f"cannot write {path}: {err.strerror or err} (the "
                                 "reference cache; free space, or set POMONA_CACHE)") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)


def read_reference(path: str | Path, key: str) -> dict[str, tuple[float, float]]:
    """The reference log-probs in ``path``, which must carry ``key``: ValueError naming
    both keys when it was made for another model, dataset or reference adapter."""
    path = Path(path)
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such reference log-prob file") from None
    except (OSError, pa.ArrowException) as err:
        raise ValueError(f"{path}: not a reference log-prob file ({err})") from None
    found = (table.schema.metadata or {}).get(KEY_FIELD, b"").decode() or "(none)"
    if found != key:
        raise ValueError(f"{path}: reference log-probs for key {found}, this run needs "
                         f"{key} (made from another model, dataset or reference adapter)")
    if not set(COLUMNS) <= set(table.column_names):
        raise ValueError(f"{path}: expected columns {COLUMNS}, found {table.column_names}")
    cols = table.to_pydict()
    check_columns(path, table, cols)
    refs: dict[str, tuple[float, float]] = {}
    for i, c, r in zip(cols["id"], cols["ref_chosen_logps"], cols["ref_rejected_logps"],
                       strict=True):
        if refs.setdefault(i, (c, r)) != (c, r):  # the last would win in silence
            raise ValueError(f"{path}: pair id {i!r} appears twice with different values "
                             f"({refs[i]} and {(c, r)}); keep one row per id")
    bad = next((i for i, v in refs.items() if not all(map(math.isfinite, v))), None)
    if bad is not None:
        raise ValueError(f"{path}: reference log-probs of pair {bad!r} are not finite "
                         f"({refs[bad]}); the reference model overflowed on it")
    # a summed log-prob is at most 0: a positive one is a hand edit or a sign flip
    bad = next((i for i, v in refs.items() if max(v) > 1e-3), None)  # float32 slack
    if bad is not None:
        raise ValueError(f"{path}: reference log-probs of pair {bad!r} are positive "
                         f"({refs[bad]}); log-probs are <= 0: recompute the file")
    check_digest(path, table)
    return refs


def check_columns(path: Path, table: pa.Table, cols: dict[str, list]) -> None:
    """One line naming the file, column and row when a column holds other than one string
    id or one number a row (a hand edit: nulls, strings, lists)."""
    for name in COLUMNS:
        kind = table.schema.field(name).type
        ok = pa.types.is_string(kind) or pa.types.is_large_string(kind) if name == "id" \
            else pa.types.is_floating(kind) or pa.types.is_integer(kind)
        if not ok:
            raise ValueError(f"{path}: column {name} is {kind}, expected "
                             f"{'strings' if name == 'id' else 'numbers'} (one per row); "
                             "recompute the file, or fix that column")
        row = next((n for n, v in enumerate(cols[name]) if v is None), None)
        if row is not None:
            pair = cols["id"][row] if name != "id" else None
            raise ValueError(f"{path}: column {name} is empty (null) in row {row}"
                             + (f" (pair id {pair!r})" if pair is not None else "")
                             + "; recompute the file, or fill that value")
