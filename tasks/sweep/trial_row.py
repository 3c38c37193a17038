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
    """A finished trial's row (with its cache ``key``) into its folder under ``out``."""
    tid = summary.get("trial_id")
    if key and isinstance(tid, str) and summary.get("status") in FINISHED \
            and summary.get("adapter"):
        atomic_write_text(out / tid / TRIAL_ROW,
                          json.dumps({**summary, "cache_key": key}, default=str) + "\n")


def recovered(out: Path, tid: str, key: str) -> dict[str, Any] | None:
    """The row ``keep_row`` left in trial ``tid``'s folder, where it holds ``key``, says the
    trial finished, and was written after the adapter it describes (an adapter pulled later,
    by a run of another key whose row was lost, is not this row's); None otherwise."""
    folder = out / tid
    try:
        row = json.loads((folder / TRIAL_ROW).read_text())
        fresh = (folder / TRIAL_ROW).stat().st_mtime_ns >= (folder / ADAPTER).stat().st_mtime_ns
    except (OSError, ValueError):
        return None
    if not (isinstance(row, dict) and fresh and row.get("cache_key") == key
            and row.get("status") in FINISHED):
        return None
    return {**row, "adapter": str(folder)}
