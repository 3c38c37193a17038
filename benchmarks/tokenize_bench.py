"""Tokenization benchmark: Pomona vs Hugging Face ``datasets.map(batched=True)``, one run.

    pomona bench tokenize --rows 100000 [--json]

Both start from the same JSONL of synthetic explicit-layout pairs and the same tokenizer
(a self-made model's, chat template on) and end with an Arrow dataset on disk: Pomona via
``tokenize_dataset``; the baseline as TRL users write it — ``load_dataset("json")``, a
batched ``map`` that renders the chat template and tokenizes prompt, chosen and rejected,
then ``save_to_disk``. Needs the ``bench`` extra (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from tasks.data.synthetic import synth_rows, write_rows
from tasks.data.tokenize import TokenizeOptions, tokenize_dataset
from tasks.models.model_factory import ModelSpec, init_model


def hf_datasets_tokenize(data: Path, model_dir: Path, out: Path) -> tuple[int, int]:
    """The baseline; returns (rows, tokens)."""
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))

    def fn(batch: dict[str, list]) -> dict[str, list]:
        prompts, chosen, rejected = [], [], []
        for i, p in enumerate(batch["prompt"]):
            system = (batch.get("system") or [None] * len(batch["prompt"]))[i]
            msgs = ([{"role": "system", "content": system}] if system else [])
            msgs.append({"role": "user", "content": p})
            prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            prompts.append(prompt)
            for col, dest in (("chosen", chosen), ("rejected", rejected)):
                turn = [{"role": "assistant", "content": batch[col][i]}]
                dest.append(tok.apply_chat_template(msgs + turn, tokenize=False)[len(prompt):])
        return {"prompt_ids": tok(prompts, add_special_tokens=False)["input_ids"],
                "chosen_ids": tok(chosen, add_special_tokens=False)["input_ids"],
                "rejected_ids": tok(rejected, add_special_tokens=False)["input_ids"]}

    ds = datasets.load_dataset("json", data_files=str(data), split="train")
    ds = ds.map(fn, batched=True, remove_columns=ds.column_names)
    ds.save_to_disk(str(out))
    tokens = sum(len(p) * 2 + len(c) + len(r) for p, c, r in
                 zip(ds["prompt_ids"], ds["chosen_ids"], ds["rejected_ids"], strict=True))
    return len(ds), tokens


def pomona_tokenize(data: Path, model_dir: Path, out: Path) -> tuple[int, int]:
    report = tokenize_dataset(data, str(model_dir), out, TokenizeOptions())
    return report.rows, report.tokens


def measure(name: str, fn: Any, data: Path, model_dir: Path, work: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    rows, tokens = fn(data, model_dir, work / name)
    seconds = time.perf_counter() - t0
    return {"name": name, "rows": rows, "tokens": tokens, "seconds": seconds,
            "rows_per_s": rows / seconds, "tokens_per_s": tokens / seconds}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks tokenize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--json", action="store_true", help="Print one JSON object {rows: [...]}.")
    a = p.parse_args(argv)
    import datasets  # without the package this finds the repo's data folder instead

    if not hasattr(datasets, "load_dataset"):
        print("pomona bench tokenize compares against Hugging Face datasets, which is not "
              "installed: pip install -e '.[bench]'")
        return 2
    import mlx_lm.utils  # noqa: F401
    import transformers  # noqa: F401

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="pomona-bench-") as tmp:
        work = Path(tmp)
        os.environ.setdefault("HF_DATASETS_CACHE", str(work / "hf-cache"))  # no stale cache
        model_dir = init_model(ModelSpec(), work / "model")
        data = write_rows(list(synth_rows("sort", a.rows, seed=0, layout="explicit")),
                          work / "pairs.jsonl")
        rows = [measure("pomona", pomona_tokenize, data, model_dir, work),
                measure("hf_datasets", hf_datasets_tokenize, data, model_dir, work)]
    ratio = rows[0]["rows_per_s"] / rows[1]["rows_per_s"]
    if a.json:
        print(json.dumps({"rows": rows, "pomona_vs_hf_datasets": ratio}))
    else:
        for r in rows:
            print(f"{r['name']:>12}  {r['rows']:>8,} rows  {r['seconds']:7.2f} s  "
                  f"{r['rows_per_s']:>10,.0f} rows/s  {r['tokens_per_s']:>12,.0f} tokens/s")
        print(f"pomona / hf_datasets throughput: {ratio:.2f}x")
    return 0
