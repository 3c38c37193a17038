"""A sweep's results table: one Parquet row per trial, written atomically, whatever mix of
values a user's swept parameters put in one column.

A trial's files are where its folder is, ``<sweep>/<trial id>/``: the table records the
adapter relative to the sweep folder, and ``read_results`` resolves it there, so a copied
or moved sweep reads its own adapters, never the original's. A finished trial whose folder
lacks its adapter, or holds one cut short, garbled or diverged (NaN), reads as ``missing``,
with the reason, and is never ranked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from engine.host.atomic import write_atomic
from engine.model.adapter_file import ADAPTER_FILE, CONFIG_FILE, check_adapter_folder

RESULTS = "results.parquet"
MISSING = "missing"  # a finished trial whose folder no longer holds a usable adapter
FINISHED = ("completed", "degenerate")  # trained to the end: cached on re-runs


def write_results(rows: list[dict[str, Any]], path: Path, sweep: bool = False) -> Path:
    """One row per trial, atomically; every column is written whatever its values mix
    (``column``), so no parameter a user swept can cost the table. ``sweep``: the table
    is a sweep's results.parquet, its adapters named relative to its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [relative(r) for r in rows] if sweep else rows
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


def relative(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` as the table records it: the adapter as the trial's folder name, relative to
    the sweep folder (an absolute path would follow a copy back to the original)."""
    return {**row, "adapter": row["trial_id"]} if row.get("adapter") else row


def read_results(sweep_dir: Path, usable: bool = True) -> list[dict[str, Any]]:
    """``sweep_dir``'s rows, each trial's adapter resolved in ``sweep_dir/<trial id>``
    (whatever path an older table recorded); a finished trial without it there is
    ``missing``, its adapter None and the reason said. ``usable``: each adapter also read
    whole and finite (the board's evaluations would refuse it); a sweep's start leaves
    that to the board, not reading every trial's weights before its first trial."""
    rows = pq.read_table(Path(sweep_dir) / RESULTS).to_pylist()
    return [located(Path(sweep_dir), r, usable) for r in rows]


def located(sweep_dir: Path, row: dict[str, Any], usable: bool = True) -> dict[str, Any]:
    if not row.get("adapter"):
        return row
    folder = sweep_dir / str(row["trial_id"])
    if (folder / ADAPTER_FILE).is_file() and (folder / CONFIG_FILE).is_file():
        if row.get("status") not in FINISHED or not usable:
            return {**row, "adapter": str(folder)}
        try:  # readable and finite: a broken one costs its trial, not the board
            check_adapter_folder(folder)
        except ValueError as err:
            return {**row, "adapter": None, "status": MISSING,
                    "reason": f"its adapter cannot be used: {err}; remove {folder} and "
                              "re-run the sweep to train it again"}
        return {**row, "adapter": str(folder)}
    if row.get("status") not in FINISHED:  # failed or cancelled: never ranked anyway
        return {**row, "adapter": None}
    return {**row, "adapter": None, "status": MISSING,
            "reason": f"its adapter is missing: {folder} holds no {ADAPTER_FILE} and "
                      f"{CONFIG_FILE} (it was {row.get('status')}); re-run the sweep to "
                      "train it again"}
