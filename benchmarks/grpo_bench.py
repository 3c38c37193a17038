"""``bench grpo``: a whole GRPO step as a user runs it (rollouts, reward, update) beside
mlx-lm-lora's ``train_grpo`` on the same model, prompts and reward, in one run.

    pomona bench grpo --prompt 128 --completion 64 --generations 8 --prompts 2 \
        [--peer mlx-lm-lora] [--probe] [--json]

Model: a random-init llama (``pomona model init``; ``--layers``, ``--hidden``, ...), LoRA r16
(scale 2.0) on q/k/v/o of every layer for every row. Prompts: ``--prompts`` a step of
``--prompt`` random tokens each, written once as prompts.jsonl (``id``, ``prompt_ids``,
``answer``, ``split``), which both trainers read. Reward: ``contains`` (1 where the
completion holds the row's answer). Every row samples ``--generations`` completions of at
most ``--completion`` tokens at temperature 1, top-p and top-k off, β = 0 (no reference
pass), one update a batch of rollouts; a random model seldom samples its stop token, so
the rows generate the same tokens (``completion_tokens`` says how many).

Rows, each in a fresh process (its peak its own):
- ``pomona``: ``python -m engine train --loss grpo`` as a user gives it, the group-shared
  forward where ``prefix_share: auto`` picks it (``--prefix-share on``: always),
  ``grpo_loss_type: grpo`` (the peer's) and
  dynamic sampling off (it would sample flat groups again: work the peer does not do);
- ``pomona_rows``: the same, ``prefix_share: off`` (a row a completion);
  both through the staged update where ``--segment-size`` or ``--head-chunk`` is given;
- ``probe`` (``--probe``): the memory probe (``probe_steps``) on the ``pomona`` row's
  settings, its predicted peak beside the peak that row trained at;
- ``mlx-lm-lora`` (``--peer``): benchmarks/mlx_lm_lora_grpo.py.
Step time = the median of the steps after ``--warmup`` (each step's wall time: rollouts,
reward and update; beside it ``gen_s``: Pomona's rollouts with their reward, the peer's
``generate_grpo`` alone).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.train_bench import ROOT, peer_row

if TYPE_CHECKING:
    from engine.settings.config import TrainConfig

ANSWER = "7"  # what ``contains`` looks for: a random model writes it now and then


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks grpo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default, what in (
            ("prompt", 128, "Tokens per prompt."), ("completion", 64, "Most tokens a completion."),
            ("generations", 8, "Completions per prompt (G)."),
            ("prompts", 2, "Prompts per step."), ("layers", 8, "Model layers."),
            ("hidden", 512, "Hidden size."), ("heads", 8, "Attention heads."),
            ("kv_heads", 4, "Key/value heads."), ("intermediate", 1408, "MLP width."),
            ("vocab", 32000, "Vocabulary."), ("warmup", 2, "Steps before the timed ones."),
            ("steps", 4, "Timed steps."),
            ("segment_size", 0, "Pomona's rows: the staged update's layers a segment (0: plain)."),
            ("head_chunk", 0, "Pomona's rows: the staged update's head rows a chunk (0: dense).")):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=what)
    p.add_argument("--dtype", default="float32", help="bfloat16 on a GPU.")
    p.add_argument("--quantize", type=int, default=0, choices=(0, 4, 8),
                   help="The base's bits (mlx_lm.convert; 0: --dtype's weights): QLoRA.")
    p.add_argument("--peer", action="append", default=[], choices=["mlx-lm-lora"],
                   help="Also run mlx-lm-lora's train_grpo (benchmarks/mlx_lm_lora_grpo.py).")
    p.add_argument("--prefix-share", choices=["auto", "on"], default="auto",
                   help="The pomona row's prefix_share (on: shared on CUDA too).")
    p.add_argument("--probe", action="store_true",
                   help="Also run the memory probe on the pomona row's settings: its peak.")
    p.add_argument("--row", choices=["pomona", "pomona_rows", "probe"], help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)  # a child row's model and prompts
    p.add_argument("--json", action="store_true", help="Print one JSON object.")
    return p


def model_and_prompts(a: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """The bench's model and prompts.jsonl in ``work`` (made once)."""
    import numpy as np

    from tasks.models.model_factory import ModelSpec, init_model

    model, data = work / "model", work / "prompts.jsonl"
    if not model.exists():
        init_model(ModelSpec(layers=a.layers, hidden=a.hidden, heads=a.heads,
                             kv_heads=a.kv_heads, intermediate=a.intermediate, vocab=a.vocab,
                             dtype=a.dtype, max_position=max(4096, a.prompt + a.completion),
                             quantize=a.quantize or None),
                   model)
    rng = np.random.default_rng(0)
    rows = [{"id": f"p{i}", "prompt_ids": rng.integers(10, a.vocab, a.prompt).tolist(),
             "answer": ANSWER, "split": "train"}
            for i in range(a.prompts * (a.warmup + a.steps))]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data


def row_config(a: argparse.Namespace, work: Path, row: str) -> TrainConfig:
    """The training settings of Pomona's ``row`` (the probe's are the ``pomona`` row's)."""
    from engine.settings.config import TrainConfig

    model, data = work / "model", work / "prompts.jsonl"
    return TrainConfig(model=str(model), data=str(data), out=str(work / f"run-{row}"),
                       steps=a.warmup + a.steps, batch_size=a.prompts, report_every=1,
                       val_every=0, learning_rate=1e-5, lora_rank=16, lora_scale=2.0,
                       lora_keys=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                  "self_attn.o_proj"), warmup_steps=0,
                       prefix_share=a.prefix_share if row != "pomona_rows" else "off",
                       segment_size=a.segment_size, head_chunk=a.head_chunk).replace(
        loss="grpo", reward=("contains",), num_generations=a.generations,
        max_completion_length=a.completion, grpo_loss_type="grpo",
        grpo_max_resample_rounds=0)


def probe_row(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``probe_steps`` on the ``pomona`` row's settings (this process): the peak it
    predicts, to set beside the peak that row trained at."""
    from engine.train.probe import probe_steps

    (got,) = probe_steps(row_config(a, work, "probe"), [{}])
    if "error" in got:
        return {"name": "probe", "error": got["error"]}
    return {"name": "probe", "prefix_share_rate": got["shared_rate"],
            **{f"{k}_mb": got[f"{k}_gb"] * 2**30 / 2**20
               for k in ("peak", "rollout_peak", "update_peak")}}


def pomona_row(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The GRPO trainer's steady steps on the bench's prompts (this process)."""
    from engine.train.grpo_trainer import train_groups

    cfg = row_config(a, work, a.row)
    records: list[dict[str, Any]] = []

    class Collect:
        def on_metrics(self, record: dict[str, Any]) -> None:
            if record["split"] == "train":
                records.append(record)

    train_groups(cfg, [Collect()])
    timed = records[a.warmup:]
    return {"name": a.row, "prompts": a.prompts, "generations": a.generations,
            "completion": a.completion,
            "step_s": statistics.median(r["step_seconds"] for r in timed),
            "steps_s": [r["step_seconds"] for r in timed],
            "gen_s": statistics.median(r["rollout_seconds"] for r in timed),
            "completion_tokens": statistics.mean(r["completions/mean_length"] for r in timed),
            "prefix_share_rate": statistics.mean(r["prefix_share_rate"] for r in timed),
            "peak_mb": max(r["peak_memory_gb"] for r in timed) * 1e9 / 2**20}


def rows_of(a: argparse.Namespace, argv: list[str], work: Path) -> list[dict[str, Any]]:
    """Each row in its own process, on the same model and prompts."""
    rows = []
    for name in ("pomona", "pomona_rows", *(["probe"] if a.probe else [])):
        proc = subprocess.run([sys.executable, "-m", "benchmarks", "grpo", *argv, "--row",
                               name, "--work", str(work)], capture_output=True, text=True,
                              cwd=ROOT)
        rows.append(peer_row(name, proc))
    for peer in a.peer:
        if not importlib.util.find_spec("mlx_lm_lora"):
            rows.append({"name": "mlx-lm-lora-grpo",
                         "error": "mlx_lm_lora is not installed here (pip install "
                                  "'pomona[bench]')"})
            continue
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.mlx_lm_lora_grpo", "--model",
             str(work / "model"), "--data", str(work / "prompts.jsonl"), "--prompts",
             str(a.prompts), "--generations", str(a.generations), "--completion",
             str(a.completion), "--warmup", str(a.warmup), "--steps", str(a.steps)],
            capture_output=True, text=True, cwd=ROOT)
        rows.append(peer_row(peer, proc))
    return rows


def report(a: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The rows side by side, and Pomona's step time over each other row's."""
    by = {r["name"]: r for r in rows if "error" not in r and "step_s" in r}
    ratios = {f"pomona_step_vs_{n}": by["pomona"]["step_s"] / r["step_s"]
              for n, r in by.items() if n != "pomona" and "pomona" in by}
    if a.json:
        print(json.dumps({"config": vars(a), "rows": rows, "ratios": ratios}))
        return
    for r in rows:
        if r["name"] == "probe" and "error" not in r:
            print(f"{'probe':>16}  predicts peak {r['peak_mb'] * 2**20 / 1e9:5.2f} GB (rollout "
                  f"{r['rollout_peak_mb'] * 2**20 / 1e9:5.2f}, update "
                  f"{r['update_peak_mb'] * 2**20 / 1e9:5.2f})")
            continue
        print(f"{r['name']:>16}  " + (r.get("error") or
              f"{r['step_s'] * 1e3:8.1f} ms/step (rollouts {r['gen_s'] * 1e3:7.1f} ms)  "
              f"{r['completion_tokens']:5.1f} tokens a completion  "
              f"peak {r['peak_mb'] * 2**20 / 1e9:5.2f} GB"))
    for k, v in ratios.items():
        print(f"{k:>30}  {v:.2f}x")


LEAST = {"prompt": 1, "completion": 1, "generations": 2, "prompts": 1, "layers": 1,
         "hidden": 1, "heads": 1, "kv_heads": 1, "intermediate": 1, "warmup": 0, "steps": 1,
         "segment_size": 0, "head_chunk": 0}


def check_args(a: argparse.Namespace) -> None:
    """Each count at least what a GRPO step needs (G ≥ 2: a group's advantage), in one line."""
    for name, least in LEAST.items():
        if getattr(a, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(a, name)}: must be at "
                             f"least {least}")


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    if a.row:  # a child: one row on the parent's model and prompts
        row = probe_row if a.row == "probe" else pomona_row
        print(json.dumps(row(a, Path(a.work))))
        return 0
    try:
        check_args(a)
        with tempfile.TemporaryDirectory() as tmp:
            model_and_prompts(a, Path(tmp))  # a shape the model cannot take: refused here
            rows = rows_of(a, argv, Path(tmp))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report(a, rows)
    return 0
