"""Each adapter against the base model on the same held-out rows: the board's paired test.

An evaluation keeps, per split and metric, every row's score by id (``paired/<split>/…``:
preference wins, ``gen/<label>`` scores). ``against_base`` turns a row's and the base's
into board columns ``vs_base/<split>/<metric>/{wins,ties,losses,p}`` (tasks/eval/intervals.py:
the exact sign test, McNemar's for 0/1 scores), and ``board_row`` drops the per-row
dicts, which are not columns.
"""

from __future__ import annotations

from typing import Any

from tasks.eval.intervals import Paired, paired

PREFIX = "paired/"


def against_base(row: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """``row``'s ``vs_base/*`` columns for every per-row metric it shares with ``base``."""
    out: dict[str, Any] = {}
    for key, scores in row.items():
        if not key.startswith(PREFIX) or not base or not isinstance(base.get(key), dict):
            continue
        result = paired(scores, base[key])
        if result is not None:
            name = "vs_base/" + key.removeprefix(PREFIX)
            out.update({f"{name}/wins": result.wins, f"{name}/ties": result.ties,
                        f"{name}/losses": result.losses, f"{name}/p": result.p})
    return out


def read_paired(row: dict[str, Any], split: str, metric: str) -> Paired | None:
    """The ``vs_base`` result of ``metric`` (``logps/accuracies``, ``gen/exact``) on
    ``split`` back from a board row; None when it has none."""
    name = f"vs_base/{split}/{metric}"
    if row.get(f"{name}/p") is None:
        return None
    return Paired(int(row[f"{name}/wins"]), int(row[f"{name}/ties"]),
                  int(row[f"{name}/losses"]), float(row[f"{name}/p"]))


def board_row(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` without its per-row score dicts."""
    return {k: v for k, v in row.items() if not k.startswith(PREFIX)}
