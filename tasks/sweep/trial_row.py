"""A finished trial's row kept in its own folder, ``<sweep>/<trial id>/trial.json``, beside
the adapter it describes, with its cache key.

results.parquet is the sweep's record, but a full disk can lose it while the trials'
adapters and summaries are whole: a re-run then recognises each finished trial from its
own row (``recovered``), rather than train it again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.host.atomic import atomic_write_text
from tasks.board.results_table import FINISHED

TRIAL_ROW = "trial.json"
ADAPTER = "adapters.safetensors"


def keep_row(out: Path, summary: dict[str, Any], key: str | None) -> None:
    """A finished trial's row (with its cache ``key``) into its folder under ``out``; a
    ``trial.json`` there that is not such a row (a user's) is left as it is."""
    tid = summary.get("trial_id")
    if not (key and isinstance(tid, str) and summary.get("status") in FINISHED
            and summary.get("adapter")):
        return
    path = out / tid / TRIAL_ROW
    if path.exists() and _row_of(path, tid) is None:
        return
    atomic_write_text(path, json.dumps({**summary, "cache_key": key}, default=str) + "\n")


def _row_of(path: Path, tid: str) -> dict[str, Any] | None:
    """The row ``keep_row`` wrote at ``path`` for trial ``tid``, or None."""
    try:
        row = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ours = isinstance(row, dict) and row.get("trial_id") == tid and "cache_key" in row
    return row if ours else None


def recovered(out: Path, tid: str, key: str) -> dict[str, Any] | None:
    """The row ``keep_row`` left in trial ``tid``'s folder, where it holds ``key``, says the
    trial finished, and was written after the adapter it describes (an adapter pulled later,
    by a run of another key whose row was lost, is not this row's); None otherwise."""
    folder = out / tid
    row = _row_of(folder / TRIAL_ROW, tid)
    try:
        fresh = (folder / TRIAL_ROW).stat().st_mtime_ns >= (folder / ADAPTER).stat().st_mtime_ns
    except OSError:
        return None
    if not (row and fresh and row.get("cache_key") == key and row.get("status") in FINISHED):
        return None
    return {**row, "adapter": str(folder)}
