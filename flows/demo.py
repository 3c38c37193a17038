"""``pomona demo``: the whole pipeline on fixtures it makes itself, no downloads.

Builds a tiny llama-family model (random init + a locally trained tokenizer), writes a
synthetic preference task (sort a list; rejected = a near miss), then runs the pipeline
flow (flows/pipeline.py): tokenize → preprocess → a two-trial Ray sweep
(flows/configs/demo.yaml, ranked on validation) → evaluation of every adapter and of the
base model on the validation and the test split → leaderboard and best adapter. Prints the
leaderboard, base → best on the test split (rows no choice read), and where to watch it in
the Prefect UI when a server is running (`pomona ui` starts one).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from tasks.model_factory import ModelSpec, init_model
from tasks.synthetic import synth_rows, write_rows

DEMO_SPEC = Path(__file__).parent / "configs" / "demo.yaml"
DEMO_ROWS = 2200


def run_demo(out: Path, console: Console, address: str | None = None) -> dict[str, Any]:
    """Run the demo into ``out``; print the leaderboard; return what it measured."""
    from flows.pipeline import pipeline

    out = Path(out)
    started = time.perf_counter()
    model_dir = init_model(ModelSpec(), out / "model", overwrite=True)
    console.print(f"[green]✓[/] model: random-init llama + byte-level BPE tokenizer in "
                  f"{model_dir}")
    raw = write_rows(list(synth_rows("sort", DEMO_ROWS, seed=0)), out / "raw" / "sort.jsonl")
    console.print(f"[green]✓[/] data: {DEMO_ROWS} sort pairs (chosen sorted, rejected a near "
                  f"miss) in {raw}")
    summary = pipeline(str(raw), str(model_dir), str(DEMO_SPEC), str(out), address=address,
                       generations=4)
    board = pq.read_table(out / "leaderboard.parquet").to_pylist()
    console.print(leaderboard_table(board))
    base = next(r for r in board if r["trial_id"] == "base")
    best = next(r for r in board if r.get("rank") == 1)
    console.print(before_after(base, best))
    console.print(f"best adapter ({best['trial_id']}) exported to {summary['best_adapter']}; "
                  f"{time.perf_counter() - started:.0f} s in all")
    console.print(f"leaderboard: {out / 'leaderboard.md'}")
    api = os.environ.get("PREFECT_API_URL")
    console.print(f"Prefect UI: {api.removesuffix('/api')}" if api else
                  "Prefect UI: start one with `pomona ui`, then run again with "
                  "PREFECT_API_URL set to watch the flow run live.")
    return {"model": str(model_dir), "accuracy_before": base[TEST_ACC],
            "accuracy_after": best[TEST_ACC], "best_adapter": summary["best_adapter"]}


# The board's accuracy columns (tasks/evaluate.py: TRL's names, under each split).
VALID_ACC, TEST_ACC = "eval/valid/rewards/accuracies", "eval/test/rewards/accuracies"


def before_after(base: dict[str, Any], best: dict[str, Any]) -> str:
    """Base → best preference accuracy on the test split; without one, says so and prints
    validation under its own name (the split the best was chosen on)."""
    val = (f"validation (ranked on): {_fmt(base.get(VALID_ACC), '.2f')} → "
           f"{_fmt(best.get(VALID_ACC), '.2f')}")
    if best.get(TEST_ACC) is None or base.get(TEST_ACC) is None:
        missing = best.get("eval/test/missing") or base.get("eval/test/missing")
        return f"[yellow]no test accuracy:[/] {missing}\n{val}"
    return (f"test preference accuracy: base model {base[TEST_ACC]:.2f} → best "
            f"adapter {best[TEST_ACC]:.2f} ({best['eval/test/rows']} test pairs); {val}")


def leaderboard_table(board: list[dict[str, Any]]) -> Table:
    """Compact enough for an 80-column terminal (rich's width when output is not a tty)."""
    table = Table(title="pomona demo: leaderboard (ranked on validation; test reported)")
    for col in ("#", "trial", "lr", "val acc", "test acc", "test margin", "tok/s"):
        table.add_column(col, no_wrap=True)
    for r in board:
        lr = r.get("param/learning_rate")
        place = str(r["rank"]) if r.get("rank") else ("" if r["status"] in ("soup", "baseline")
                                                      else r["status"])
        table.add_row(place, r["trial_id"], f"{lr:g}" if lr else "-",
                      _fmt(r.get(VALID_ACC), ".3f"), _fmt(r.get(TEST_ACC), ".3f"),
                      _fmt(r.get("eval/test/logps/margin"), "+.3f"),
                      _fmt(r.get("tokens_per_sec"), ",.0f"))
    return table


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
