"""``pomona demo``: everything Pomona can do so far, on fixtures it makes itself.

Today that is: build a tiny model, write synthetic preference data, load both through
mlx-lm's own loader, render a row with the chat template and generate from the model.
Training, the sweep and the leaderboard join this command as they land.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from tasks.model_factory import ModelSpec, init_model
from tasks.synthetic import synth_rows, write_rows


def _token_stats(tokenizer, rows: list[dict]) -> str:
    prompt = [len(tokenizer.encode(r["prompt"])) for r in rows]
    chosen = [len(tokenizer.encode(r["chosen"], add_special_tokens=False)) for r in rows]
    p50, p95 = np.percentile(prompt, [50, 95])
    return (f"prompt tokens p50 {p50:.0f} / p95 {p95:.0f} / max {max(prompt)}; "
            f"chosen tokens mean {np.mean(chosen):.1f}")


def run_demo(out: Path, console: Console) -> dict:
    """Run the demo into ``out``; print a table of steps; return what it measured."""
    import mlx_lm

    out = Path(out)
    steps: list[tuple[str, str, float]] = []

    def step(name: str, started: float, detail: str) -> None:
        steps.append((name, detail, time.perf_counter() - started))
        console.print(f"[green]✓[/] {name}: {detail}")

    t = time.perf_counter()
    model_dir = init_model(ModelSpec(), out / "model", overwrite=True)
    step("model init", t, f"random-init llama + byte-level BPE tokenizer in {model_dir}")

    t = time.perf_counter()
    train = list(synth_rows("mixed", 600, seed=0))
    valid = list(synth_rows("mixed", 100, seed=1))
    write_rows(train, out / "data" / "train.jsonl")
    write_rows(valid, out / "data" / "valid.jsonl")
    step("data synth", t, f"{len(train)} train + {len(valid)} valid pairs in {out / 'data'}")

    t = time.perf_counter()
    model, tokenizer = mlx_lm.load(str(model_dir))
    stats = _token_stats(tokenizer, train)
    step("mlx_lm.load", t, f"model + tokenizer loaded; {stats}")

    t = time.perf_counter()
    messages = [{"role": "user", "content": train[0]["prompt"]}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=16)
    step("mlx_lm.generate", t, f"16 tokens from the untrained model: {text!r}")

    table = Table(title="pomona demo")
    for col in ("step", "seconds", "result"):
        table.add_column(col)
    for name, detail, secs in steps:
        table.add_row(name, f"{secs:.1f}", detail)
    console.print(table)
    console.print("Not built yet: training, sweep, evaluation and leaderboard "
                  "(engine, data, sweep and pipeline issues). See README.md.")
    return {"model": str(model_dir), "train_rows": len(train), "generated": text}
