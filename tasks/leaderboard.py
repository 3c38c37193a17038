"""The leaderboard: every trial ranked by the sweep's metric, the base model beside them, and
the best adapter exported in mlx-lm's format.

Ranked rows are the completed trials, best first by the sweep metric (its best value during
training on the validation split, ``best/<metric>``); degenerate (collapsed: zero
gradients, or accuracy far below chance on either split), pruned, failed and cancelled
trials follow, unranked, each with its reason under the table, so nothing is silently
dropped. Validation and test accuracy are separate columns: ranking chose on validation,
so test (rows no choice ever read) is the number to report; a dataset without test rows
shows "-" there and says why under the table. The ``base`` row is the untrained model
under the same evaluation, the number every adapter is read against. Written as
``leaderboard.parquet`` (all columns) and ``leaderboard.md`` (the readable few).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine.adapters import atomic_write_text
from tasks.sweep import metric_value
from tasks.trials import below_chance, write_results

ADAPTER_FILES = ("adapters.safetensors", "adapter_config.json")
EVAL_COLUMNS = ("eval/valid/rewards/accuracies", "eval/test/rewards/accuracies",
                "eval/test/logps/margin", "eval/test/loss", "eval/test/nll_loss")


def rank_trials(results: list[dict[str, Any]], evals: dict[str, dict[str, Any]], metric: str,
                mode: str, base: dict[str, Any] | None = None,
                soup: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Trials with their evaluations, ranked (1 = best); unranked ones after; then the
    soup (no training metric of its own: read its eval columns) and the base model."""
    rows = [_held_out_check({**r, **evals.get(r["trial_id"], {})}) for r in results]

    def score(r: dict[str, Any]) -> float:
        value = metric_value(r, metric)
        if value is None or not math.isfinite(value):
            return math.inf
        return value if mode == "min" else -value

    ranked = sorted((r for r in rows if r["status"] == "completed"), key=score)
    for i, r in enumerate(ranked, 1):
        r["rank"] = i
    rest = [{**r, "rank": None} for r in rows if r["status"] != "completed"]
    tail = [{"trial_id": "soup", "status": "soup", "rank": None, **soup}] if soup else []
    tail += [{"trial_id": "base", "status": "baseline", "rank": None, **base}] if base else []
    return ranked + rest + tail


def _held_out_check(row: dict[str, Any]) -> dict[str, Any]:
    """A completed trial whose valid or test accuracy is far below chance is degenerate."""
    reason = next(filter(None, (below_chance(row.get(f"eval/{s}/rewards/accuracies"),
                                             row.get(f"eval/{s}/rows"), f"{s} accuracy")
                                for s in ("test", "valid"))), "")
    if row["status"] == "completed" and reason:
        return {**row, "status": "degenerate", "reason": reason}
    return row


def swept_params(rows: list[dict[str, Any]]) -> list[str]:
    """The ``param/*`` columns whose value differs between trials."""
    names = sorted({k for r in rows for k in r if k.startswith("param/")})
    return [n for n in names if len({str(r.get(n)) for r in rows if n in r}) > 1]


def markdown(rows: list[dict[str, Any]], metric: str, title: str) -> str:
    params = swept_params([r for r in rows if r.get("status") not in ("baseline", "soup")])
    cols = ["rank", "trial", "status", metric, *EVAL_COLUMNS, "peak GB", "tokens/s", "s",
            *(p.removeprefix("param/") for p in params)]
    lines = [f"# {title}", "", f"Ranked on validation ({metric}, its best in training); "
             "eval/test/* is the test split, which no choice read: the number to report.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [str(r.get("rank") or ""), r["trial_id"], r["status"],
                 _num(metric_value(r, metric)), *(_num(r.get(c)) for c in EVAL_COLUMNS),
                 _num(r.get("peak_memory_gb"), 2), _num(r.get("tokens_per_sec"), 0),
                 _num(r.get("duration_s"), 0), *(str(r.get(p, "")) for p in params)]
        lines.append("| " + " | ".join(cells) + " |")
    missing = next((r["eval/test/missing"] for r in rows if r.get("eval/test/missing")), None)
    notes = [f"- test split: {missing}"] if missing else []
    notes += [f"- {r['trial_id']}: {r['reason']}" for r in rows if r.get("reason")]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def _num(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:,.{digits}f}" if digits else f"{value:,.0f}"


def write_leaderboard(rows: list[dict[str, Any]], out: Path, metric: str, title: str
                      ) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    md = out / "leaderboard.md"
    atomic_write_text(md, markdown(rows, metric, title))
    return write_results(rows, out / "leaderboard.parquet"), md


def export_best(rows: list[dict[str, Any]], out: Path) -> Path | None:
    """Copy the rank-1 adapter to ``out/best-adapter`` (mlx-lm's files), atomically."""
    best = next((r for r in rows if r.get("rank") == 1 and r.get("adapter")), None)
    if best is None:
        return None
    target = out / "best-adapter"
    tmp = Path(tempfile.mkdtemp(prefix=".best-adapter.", dir=out))
    for name in ADAPTER_FILES:
        shutil.copy2(Path(best["adapter"]) / name, tmp / name)
    (tmp / "SOURCE").write_text(f"{best['trial_id']}\n")
    if target.exists():
        old = target.with_name(f".best-adapter.old.{os.getpid()}")
        target.rename(old)
        shutil.rmtree(old)
    tmp.rename(target)
    return target
