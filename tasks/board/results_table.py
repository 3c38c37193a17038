"""A sweep's results table: one Parquet row per trial, written atomically, whatever mix of
values a user's swept parameters put in one column."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from engine.host.atomic import write_atomic


def write_results(rows: list[dict[str, Any]], path: Path) -> Path:
    """One row per trial, atomically; every column is written whatever its values mix
    (``column``), so no parameter a user swept can cost the table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    table = pa.table({k: column([r.get(k) for r in rows]) for k in keys})
    return write_atomic(path, lambda tmp: pq.write_table(table, tmp))


def column(values: list[Any]) -> pa.Array:
    """``values`` as one Arrow column: as they are when Arrow takes them; numbers of mixed
    kinds as float64 (NaN stays NaN); anything else mixed as text (JSON for non-strings),
    e.g. a grid of ``[3.0e-4, "1e-4"]``."""
    try:
        return pa.array(values)
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        pass
    present = [v for v in values if v is not None]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return pa.array([None if v is None else float(v) for v in values], pa.float64())
    return pa.array([v if v is None or isinstance(v, str) else json.dumps(v, default=str)
                     for v in values], pa.string())
