"""End-to-end training benchmark: the real trainer against TRL's ORPOTrainer, one run.

    pomona bench train --seq 4096 [--pairs 1] [--steps 8] [--warmup 3] [--trl] [--json]
    pomona bench train --seq 4096 --peer mlx-lm-lora      # a peer on the same MLX build
    pomona bench train --preset e4b --seq 2048 --row plain --row levers [--profile]
    pomona bench train --seq 1024 --pairs 8 --pack 1,2,4   # packed trials (pack_bench.py)

``--preset`` or ``--row``: the trainer under named rows on a published shape or the llama
below, side by side (benchmarks/trainer_rows.py); the rest of this docstring is the default.

Pomona side: ``pomona model init`` at the benchmark shape (a random-init llama, like
``benchmarks/trl_orpo.py``'s), a tokenized dataset of pairs whose two sequences are
exactly ``--seq`` tokens (prompt:response 4:1), then ``engine.train.trainer.train`` — the path
users run, data order, layouts, update and metrics included — reporting every step.
Step time = the median of the steps after ``--warmup`` (each step's wall time as the
trainer measures it: batches, forward, backward, update); tokens/s counts both sequences
of every pair; peak = MLX's peak over the timed steps.

Engine row: the engine's own step (forward + backward, no update) on the same model
and first batch, in the same process after training — the ceiling; the pomona row's
``phases_ms`` say where the rest of its step goes (batches, step_grads, update, wait).

TRL side (``--trl``, needs torch, transformers, peft and trl; CUDA): the same shape and
pairs per step through ``benchmarks/trl_orpo.py``, with and without gradient
checkpointing, in fresh processes; ``--liger`` adds TRL with ``use_liger_kernel``
(Liger's Triton kernels), the GPU peer to beat, every ratio printed against each. MFU: the
FLOPs of the pairs as two plain forwards and backwards (4 per frozen weight per token, the
head at the loss positions, causal attention ×3) over the step time and
``--peak-tflops`` — the same useful work for every row, so a row that saves work (prefix
sharing) shows it as a higher MFU; ``mfu_computed``
counts what each row computes instead (Pomona's shared prompt once, a peer's every token):
how well each uses the device on the tokens it runs.

Peers (``--peer mlx-lm-lora``): another trainer on the same model directory and pairs
file, with and without its checkpointing, in fresh processes (benchmarks/mlx_lm_lora_orpo.py:
mlx-lm-lora's ``train_orpo``, its own ORPO, said in each row's ``semantics``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.shapes import PRESETS
from benchmarks.trainer_timing import bench_config, engine_step_of, timed_train

ROOT = Path(__file__).resolve().parents[1]
# --peer NAME: (the module that runs it in a fresh process, the package it needs)
PEERS = {"mlx-lm-lora": ("benchmarks.mlx_lm_lora_orpo", "mlx_lm_lora")}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096, help="Tokens per sequence (pair = 2).")
    p.add_argument("--pairs", type=int, default=1, help="Pairs per optimizer step.")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16", help="float32 on CPU.")
    p.add_argument("--segment-size", type=int, default=1)
    p.add_argument("--head-chunk", type=int, default=512)
    p.add_argument("--prefix-share", default="auto")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--trl", action="store_true", help="Also run TRL (torch + trl installed).")
    p.add_argument("--liger", action="store_true",
                   help="With --trl: also TRL with use_liger_kernel (liger-kernel installed), "
                        "the GPU peer to beat (benchmarks/trl_orpo.py).")
    p.add_argument("--peer", action="append", default=[], choices=sorted(PEERS),
                   help="Also run a peer trainer on the same model and pairs, with and "
                        "without its checkpointing (fresh processes): mlx-lm-lora's "
                        "train_orpo (benchmarks/mlx_lm_lora_orpo.py).")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="The device's dense matmul peak for MFU (H200 bf16: 681); 0 = none.")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="A published shape (random weights, benchmarks/shapes.py) instead of "
                        "the llama above; rows as --row says (default plain, levers).")
    p.add_argument("--quantize", type=int, choices=[4, 8], help="--preset at these bits.")
    p.add_argument("--preset-layers", type=int, help="--preset with fewer layers (a quick look).")
    p.add_argument("--row", action="append", default=[],
                   help="A trainer row: plain|levers[,FIELD=VALUE...][,env.NAME=VALUE...] "
                        "(benchmarks/trainer_rows.py); repeat for more.")
    p.add_argument("--mlp-chunk", type=int, default=0, help="levers rows: mlp_chunk.")
    p.add_argument("--memory-limit-gb", type=float, default=0.0,
                   help="levers rows: memory_limit_gb.")
    p.add_argument("--profile", action="store_true",
                   help="--row: each row's stage split too (benchmarks/phase_profile.py).")
    p.add_argument("--one-row", action="store_true", help=argparse.SUPPRESS)  # a child row
    p.add_argument("--profile-repeats", type=int, default=3,
                   help="--profile: profiled steps a row (after one that compiles).")
    p.add_argument("--pack", help="Pack sizes, e.g. 1,2,4: the same k trials (k the "
                                  "largest) in packs of each size, one after another; "
                                  "auto: the pack probe's pick under --memory-limit-gb, "
                                  "trained (benchmarks/pack_bench.py).")
    p.add_argument("--work", help="Keep the model and data here (default: a temporary dir).")
    p.add_argument("--json", action="store_true", help="Print one JSON object.")
    return p


def _model_and_data(a: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    import numpy as np

    from engine.data.batch import Pair
    from engine.data.pairs import write_pairs_jsonl
    from tasks.models.model_factory import ModelSpec, init_model

    model = work / "model"
    if a.preset:
        from benchmarks.trainer_rows import model_dir

        model = model_dir(a, work)
    elif not model.exists():
        init_model(ModelSpec(layers=a.layers, hidden=a.hidden, heads=a.heads,
                             kv_heads=a.kv_heads, intermediate=a.intermediate, vocab=a.vocab,
                             dtype=a.dtype, max_position=max(4096, a.seq + 1)), model)
    rng = np.random.default_rng(0)
    prompt = a.seq * 4 // 5
    response = a.seq + 1 - prompt  # a sequence of seq + 1 tokens feeds seq inputs
    pairs = [Pair(f"b{i}", rng.integers(10, a.vocab, prompt).tolist(),
                  rng.integers(10, a.vocab, response).tolist(),
                  rng.integers(10, a.vocab, response).tolist())
             for i in range(a.pairs * (a.warmup + a.steps))]
    return model, write_pairs_jsonl(pairs, work / "pairs.jsonl", split="train")


def pomona_row(a: argparse.Namespace, work: Path, model: Path, data: Path) -> dict[str, Any]:
    """The trainer's steady-state step on the benchmark's pairs."""
    # The trainer's tokens/s counts every token of a sequence (seq + 1 here): its step time.
    t = timed_train(bench_config(a, model, data, work), a.warmup, 2 * (a.seq + 1) * a.pairs)
    return {"name": "pomona", "seq": a.seq, "pairs": a.pairs, "step_s": t["step_s"],
            "tokens_per_s": 2 * a.seq * a.pairs / t["step_s"], "steps_s": t["steps_s"],
            "peak_mb": t["peak_gb"] * 1e9 / 2**20, "prefix_share_rate": t["prefix_share_rate"],
            "phases_ms": t["phases_ms"]}


def engine_step(a: argparse.Namespace, work: Path, model_dir: Path, data: Path
                ) -> tuple[Callable[[], None], bool]:
    """One engine step (forward + backward, no update: what ``bench memory`` times) on the
    trainer's model and first batch, as a call that evaluates it; and whether the batch
    took the shared layout."""
    import mlx.core as mx

    step = engine_step_of(bench_config(a, model_dir, data, work))
    return (lambda: mx.eval(step.run())), step.shared


def engine_row(a: argparse.Namespace, work: Path, model_dir: Path, data: Path
               ) -> dict[str, Any]:
    """The engine's own step (``engine_step``) in this process: the ceiling the trainer's
    step is held to."""
    import mlx.core as mx

    step, shared = engine_step(a, work, model_dir, data)
    times = []
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            mx.reset_peak_memory()
        t0 = time.perf_counter()
        step()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return {"name": "engine", "seq": a.seq, "pairs": a.pairs, "step_s": step_s,
            "tokens_per_s": 2 * a.seq * a.pairs / step_s, "steps_s": times,
            "peak_mb": mx.get_peak_memory() / 2**20, "shared": shared}


def trl_commands(a: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(row name, command) of each TRL row: with and without checkpointing, and with
    ``--liger`` TRL with Liger's kernels too (each in a fresh process: its peak its own)."""
    from benchmarks.trl_orpo import row_name

    variants = [(False, False), (False, True), *([(True, False)] if a.liger else [])]
    return [(row_name(liger, gc),
             [sys.executable, str(ROOT / "benchmarks" / "trl_orpo.py"), "--seq", str(a.seq),
              "--batch", str(a.pairs), "--layers", str(a.layers), "--vocab", str(a.vocab),
              "--warmup", str(a.warmup), "--steps", str(a.steps), "--json",
              *(["--gradient-checkpointing"] if gc else []), *(["--liger"] if liger else [])])
            for liger, gc in variants]


def trl_rows(a: argparse.Namespace) -> list[dict[str, Any]]:
    """TRL's ORPOTrainer + PEFT rows (``trl_commands``), an error row for what is missing."""
    if not all(importlib.util.find_spec(m) for m in ("torch", "trl", "peft")):
        return [{"name": "trl", "error": "torch, trl and peft are not installed here"}]
    rows = []
    for name, cmd in trl_commands(a):
        if "--liger" in cmd and not importlib.util.find_spec("liger_kernel"):
            rows.append({"name": name, "error": "liger-kernel is not installed here"})
            continue
        rows.append(peer_row(name, subprocess.run(cmd, capture_output=True, text=True)))
    return rows


def peer_rows(a: argparse.Namespace, model: Path, data: Path) -> list[dict[str, Any]]:
    """Each ``--peer`` on the bench's own model and pairs, with and without its
    checkpointing, each in a fresh process (its peak its own); an error row where it is
    not installed or fails."""
    rows = []
    for peer in a.peer:
        module, package = PEERS[peer]
        if not importlib.util.find_spec(package):
            rows.append({"name": peer, "error": f"{package} is not installed here (pip "
                                                "install 'pomona[bench]')"})
            continue
        for gc in ([], ["--grad-checkpoint"]):
            cmd = [sys.executable, "-m", module, "--model", str(model), "--data", str(data),
                   "--pairs", str(a.pairs), "--warmup", str(a.warmup), "--steps",
                   str(a.steps), *gc]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            rows.append(peer_row(peer + ("_gc" if gc else ""), proc))
    return rows


def peer_row(name: str, proc: subprocess.CompletedProcess) -> dict[str, Any]:
    """A peer's process's row (TRL's too): its last line's JSON, or an error row saying
    why not."""
    lines = proc.stdout.strip().splitlines()
    if not proc.returncode and lines:
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            return {"name": name, "error": f"its last line is no JSON: {lines[-1][:200]}"}
    return {"name": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}


def useful_flops(a: argparse.Namespace, shared: float = 0.0, all_logits: bool = False
                 ) -> float:
    """FLOPs of one step's pairs as two plain forwards + backwards to the activations
    (LoRA's own are negligible): 4 per frozen layer weight per token, the head at the
    response and NLL positions, causal attention (QKᵀ and PV, ×3 with the backward).
    ``shared``: the share of pairs whose prompt runs once (the prefix-shared forward: the
    prompt's tokens once, each response attending to it), what such a step computes;
    ``all_logits``: the head at every position, as a trainer that computes all logits."""
    d_head = a.hidden // a.heads
    layer = (a.hidden * (a.heads + 2 * a.kv_heads) * d_head + a.heads * d_head * a.hidden
             + 3 * a.hidden * a.intermediate)
    prompt = a.seq * 4 // 5  # of each sequence's seq inputs
    response = a.seq - prompt
    tokens = {False: 2 * a.seq, True: prompt + 2 * response}  # per pair
    keys = {False: 2 * a.seq * a.seq / 2,  # keys each query attends to, summed
            True: prompt * prompt / 2 + 2 * (response * prompt + response * response / 2)}
    loss_tokens = (2 * a.seq if all_logits  # else: full NLL + the rejected response
                   else a.seq + (a.seq + 1 - a.seq * 4 // 5)) * a.pairs

    def of(one: bool) -> float:
        attention = 3 * 4 * keys[one] * a.heads * d_head * a.pairs * a.layers
        return (4 * layer * a.layers * tokens[one] * a.pairs
                + 4 * a.hidden * a.vocab * loss_tokens + attention)

    return (1 - shared) * of(False) + shared * of(True)


SHAPE = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "dtype", "preset",
         "quantize", "preset_layers")


def claim_work(work: Path, a: argparse.Namespace) -> None:
    """Use ``--work`` only if it is empty or this benchmark's own folder of the same model
    shape: it writes a model, pairs.jsonl and run/ there, and reuses the model."""
    marker, shape = work / "bench_train.json", {k: getattr(a, k) for k in SHAPE}
    if work.exists() and any(work.iterdir()):
        if not marker.exists():
            raise ValueError(f"--work {work}: not empty and not a `pomona bench train` folder; "
                             "give an empty or new one")
        if json.loads(marker.read_text()) != shape:
            raise ValueError(f"--work {work}: holds a model of another shape "
                             f"({marker.read_text().strip()}); give an empty or new folder")
    work.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(shape) + "\n")


def check_args(a: argparse.Namespace) -> None:
    for name, least in (("seq", 8), ("pairs", 1), ("steps", 1), ("warmup", 0),
                        ("layers", 1), ("hidden", 1), ("heads", 1), ("kv_heads", 1)):
        if getattr(a, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(a, name)}: must be at "
                             f"least {least}")
    if a.peak_tflops < 0:
        raise ValueError(f"--peak-tflops {a.peak_tflops}: must be >= 0")
    if a.profile_repeats < 1:
        raise ValueError(f"--profile-repeats {a.profile_repeats}: must be at least 1")
    if a.liger and not a.trl:
        raise ValueError("--liger: only with --trl (it is TRL's use_liger_kernel)")
    for flag, value in (("--quantize", a.quantize), ("--preset-layers", a.preset_layers)):
        if value is not None and not a.preset:
            raise ValueError(f"{flag} {value}: only with --preset (the llama here is "
                             "bfloat16 or float32 as --dtype says)")
    if a.preset_layers is not None:  # the shared-K/V layers need donors below them
        least = PRESETS[a.preset].get("num_kv_shared_layers", 0) + 1
        if a.preset_layers < least:
            raise ValueError(f"--preset-layers {a.preset_layers}: {a.preset} needs at least "
                             f"{least} (its last {least - 1} read shared K/V)")


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    if a.preset:
        a.vocab = PRESETS[a.preset]["vocab_size"]
    try:
        check_args(a)
        if a.pack:
            from benchmarks.pack_bench import pack_sizes

            pack_sizes(a.pack)  # refused before any model is made
            if a.pack == "auto" and a.memory_limit_gb <= 0:
                raise ValueError("--pack auto: give --memory-limit-gb (the budget it fits "
                                 "packs to)")
        if a.preset or a.row:
            from benchmarks.trainer_rows import row_env, row_fields

            for spec in a.row:
                row_fields(spec, a)
                row_env(spec)
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(a.work or tmp)
            claim_work(work, a)
            model, data = _model_and_data(a, work)
            if a.pack:  # the same trials in packs of each size, or the probe's pick
                from benchmarks import pack_bench

                run = pack_bench.run_auto if a.pack == "auto" else pack_bench.run
                return run(a, model, data, work)
            if a.preset or a.row:  # the trainer under named configurations
                from benchmarks import trainer_rows

                rows = trainer_rows.run_rows(a, argv, model, data, work)
                trainer_rows.report(a, rows)
                return 0
            rows = [pomona_row(a, work, model, data), engine_row(a, work, model, data)]
            rows += peer_rows(a, model, data)  # while the model and pairs are on disk
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if a.trl:
        rows += trl_rows(a)
    return report(a, rows)


def report(a: argparse.Namespace, rows: list[dict[str, Any]]) -> int:
    """The rows with their MFUs, side by side, and Pomona's ratios to each other row."""
    flops = useful_flops(a)
    for r in rows:
        if "step_s" in r and a.peak_tflops:
            r["mfu"] = flops / r["step_s"] / (a.peak_tflops * 1e12)
            # what the row computes: Pomona's shared prompts once and the head at its loss
            # positions; a peer's every token, logits at every position
            ours = r["name"] in ("pomona", "engine")
            shared = r.get("prefix_share_rate", 1.0 if r.get("shared") else 0.0)
            r["mfu_computed"] = (useful_flops(a, shared, all_logits=not ours) / r["step_s"]
                                 / (a.peak_tflops * 1e12))
    by = {r["name"]: r for r in rows if "error" not in r}
    ratios = {f"pomona_vs_{n}": by["pomona"]["tokens_per_s"] / r["tokens_per_s"]
              for n, r in by.items() if n not in ("pomona", "engine")}
    ratios["trainer_step_vs_engine_step"] = by["pomona"]["step_s"] / by["engine"]["step_s"]
    if a.json:
        print(json.dumps({"config": vars(a), "rows": rows, "ratios": ratios,
                          "useful_tflop_per_step": flops / 1e12}))
        return 0
    for r in rows:
        print(f"{r['name']:>10}  " + (r.get("error") or
              f"{r['step_s'] * 1e3:8.1f} ms/step  {r['tokens_per_s'] / 1e3:7.1f}k tok/s  "
              f"peak {r['peak_mb'] * 2**20 / 1e9:6.2f} GB"
              + (f"  MFU {r['mfu']:.0%} (of what it computes: {r['mfu_computed']:.0%})"
                 if "mfu" in r else "")))
        if "phases_ms" in r:
            print(" " * 12 + "  ".join(f"{k} {v:.1f} ms" for k, v in r["phases_ms"].items()))
    for k, v in ratios.items():
        print(f"{k:>24}  {v:.2f}x")
    return 0


if __name__ == "__main__":  # the GPU machine has no typer: python -m benchmarks train ...
    raise SystemExit(main(sys.argv[1:]))
