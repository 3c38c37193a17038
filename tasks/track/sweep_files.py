"""What a run's own files say, as a tracker reads them: a sweep's (``SweepFolder``: every
trial's row in ``results.parquet``, its metric lines in ``<trial>/metrics.jsonl``, the
leaderboard's rows and the best adapter) or a lone training run's (``RunFolder``: one
trial, its metric lines in ``metrics.jsonl``, its adapter). Trackers read only these files,
so what a live run sent and what ``pomona track`` sends later are the same records.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

RESULTS = "results.parquet"
METRICS = "metrics.jsonl"
BOARD = "leaderboard.parquet"
BEST = "best-adapter"
EVAL_PREFIXES = ("eval/", "gen/", "vs_base/")  # a leaderboard's evaluation columns
# A trial's outcome as an MLflow run status (completed and degenerate trained to the end).
RUN_STATUS = {"completed": "FINISHED", "degenerate": "FINISHED", "failed": "FAILED",
              "pruned": "KILLED", "cancelled": "KILLED"}


def read_rows(path: Path) -> list[dict[str, Any]]:
    """A parquet table's rows ([] while it is not written yet or is being replaced)."""
    with contextlib.suppress(FileNotFoundError, pa.ArrowException, OSError):
        return pq.read_table(path).to_pylist()
    return []


def trial_rows(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    """Every trial's row of the sweep's results table, by trial id."""
    return {r["trial_id"]: r for r in read_rows(sweep_dir / RESULTS)}


def params_of(row: dict[str, Any]) -> dict[str, Any]:
    """A results row's settings (its ``param/`` columns), by name, as a live trial sends
    them: a setting that is None (``lora_keys``: every linear; ``resume``: none) is one; a
    loss's own setting that is None is another loss's column, not this trial's."""
    from engine.losses import OWNERS

    named = {k[len("param/"):]: v for k, v in row.items() if k.startswith("param/")}
    return {name: v for name, v in named.items() if v is not None or name not in OWNERS}


def number(value: Any) -> float | None:
    """``value`` as a finite float a tracker takes (bools as 0/1), else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def new_records(path: Path, sent: dict[str, int]) -> list[dict[str, Any]]:
    """The whole lines of a trial's metrics.jsonl past ``sent`` (split -> last step sent),
    as records with a step: a retried attempt starts its file afresh, and its steps up to
    what was sent are not sent twice."""
    if not path.is_file():
        return []
    out, last = [], dict(sent)
    with path.open() as f:
        for line in f:
            if not line.endswith("\n"):
                break  # being written: the next sync reads it whole
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                step, split = record.get("step"), str(record.get("split", "train"))
                if isinstance(step, int) and step > last.get(split, -1):
                    last[split] = step
                    out.append(record)
    return out


def cell(value: Any) -> Any:
    """A board cell as a tracker's table holds it: numbers and text (a list as text)."""
    return value if value is None or isinstance(value, int | float | str | bool) else str(value)


def record_metrics(record: dict[str, Any]) -> dict[str, float]:
    """A metric line's numbers by name (its step and split are not metrics)."""
    return {k: v for k, raw in record.items() if k not in ("step", "split")
            and (v := number(raw)) is not None}


def evaluation_of(row: dict[str, Any]) -> dict[str, float]:
    """A leaderboard row's evaluation: its eval/, gen/ and vs_base/ numbers (intervals
    as their /low and /high columns) and its rank."""
    return {k: v for k, raw in row.items() if (k.startswith(EVAL_PREFIXES) or k == "rank")
            and (v := number(raw)) is not None}


@dataclass
class SweepFolder:
    """A sweep's folder: its trials' rows once they end, each trial's metric lines."""

    path: Path

    def rows(self) -> dict[str, dict[str, Any]]:
        return trial_rows(self.path)

    def metrics(self, trial_id: str) -> Path:
        return self.path / trial_id / METRICS

    def adapter(self, trial_id: str) -> list[Path]:
        return []  # a sweep's: the board's best adapter (tasks/track/tracker.py)


@dataclass
class RunFolder:
    """A lone training run's folder (``pomona train --out``): one trial, named after the
    folder; its row, once it ended, set by the process that ran it (``row``)."""

    path: Path
    row: dict[str, Any] | None = None

    @property
    def trial_id(self) -> str:
        return self.path.resolve().name

    def rows(self) -> dict[str, dict[str, Any]]:
        return {self.trial_id: self.row} if self.row else {}

    def metrics(self, trial_id: str) -> Path:
        return self.path / METRICS

    def adapter(self, trial_id: str) -> list[Path]:
        """The trained adapter's files (mlx-lm's layout), once written."""
        from engine.model.adapters import ADAPTER_FILE, CONFIG_FILE

        return [f for f in (self.path / ADAPTER_FILE, self.path / CONFIG_FILE) if f.is_file()]
