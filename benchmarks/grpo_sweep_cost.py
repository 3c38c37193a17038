"""``bench grpo-sweep``: what a sweep costs a GRPO trial. The same trials, on the demo's
model and parity task, run as one ``pomona sweep`` (two at once, as the demo runs them)
and one by one through ``pomona train``; each path timed as its command runs, start to end.

    OPENBLAS_NUM_THREADS=1 pomona bench grpo-sweep [--steps 40] [--work DIR] [--json]

Steps:
1. the demo's data and model, and a short SFT warm start (``bench grpo-learn``'s), so
   that the trials' groups carry signal;
2. ``pomona sweep`` over a grid of 4 GRPO trials (learning rate × temperature, from the
   warm start, rewarded by ``task:parity``), ``max_concurrent: 2``, no Prefect: its wall
   time over 4 is its time per trial (Ray's start and the trials' fresh processes in it);
3. the same 4 trials' settings, each through ``pomona train --config``, one after another:
   the mean of their wall times;
4. the ratio (issue 73's goal: at most 1.1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.grpo_learning import REWARD, data_and_model, in_work, warm_start

GRID = {"learning_rate": [2.0e-4, 5.0e-4], "temperature": [0.7, 1.0]}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks grpo-sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="Each trial's GRPO steps.")
    p.add_argument("--sft-steps", type=int, default=80, help="The warm start's steps.")
    p.add_argument("--rows", type=int, default=2200, help="Parity rows (the demo's).")
    p.add_argument("--work", help="Keep the model, data and runs here (an empty or new "
                                  "folder).")
    p.add_argument("--json", action="store_true", help="Print one JSON object.")
    return p


def fixed(a: argparse.Namespace, start: Path) -> dict[str, Any]:
    """Every trial's settings but the grid's."""
    return {"loss": "grpo", "reward": REWARD, "steps": a.steps, "batch_size": 8,
            "num_generations": 8, "max_completion_length": 6, "lora_rank": 16,
            "warm_start": str(start), "val_every": 0, "report_every": 10, "seed": 0}


def pomona(*args: str) -> float:
    """``pomona ARGS`` in its own process, as a user runs it; its wall seconds."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                          text=True, env={**os.environ, "RAY_ADDRESS": "",
                                          "PREFECT_API_URL": ""})
    if done.returncode != 0:
        raise RuntimeError(f"pomona {args[0]} exited {done.returncode}: "
                           f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return time.perf_counter() - started


def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    model, data = data_and_model(work, a.rows)
    start = warm_start(argparse.Namespace(sft_steps=a.sft_steps), model, data, work)
    spec = {"name": "grpo-cost", "model": str(model), "data": str(data), "max_concurrent": 2,
            "fixed": fixed(a, start), "grid": GRID}
    (work / "sweep.yaml").write_text(yaml.safe_dump(spec))
    sweep_s = pomona("sweep", str(work / "sweep.yaml"), "--out", str(work / "sweep"),
                     "--no-prefect")
    alone = []
    for i, (lr, temp) in enumerate([(lr, t) for lr in GRID["learning_rate"]
                                    for t in GRID["temperature"]]):
        config = work / f"alone-{i}.yaml"
        config.write_text(yaml.safe_dump({**fixed(a, start), "learning_rate": lr,
                                          "temperature": temp}))
        alone.append(pomona("train", "--config", str(config), "--model", str(model),
                            "--data", str(data), "--out", str(work / f"alone-{i}")))
    per_trial, mean_alone = sweep_s / 4, sum(alone) / len(alone)
    return {"threads": os.environ.get("OPENBLAS_NUM_THREADS", "(unset)"),
            "sweep_s": sweep_s, "sweep_per_trial_s": per_trial, "alone_s": alone,
            "alone_mean_s": mean_alone, "ratio": per_trial / mean_alone,
            "config": {k: v for k, v in vars(a).items() if k != "json"}}


def check_work(a: argparse.Namespace) -> None:
    if a.work and Path(a.work).exists() and any(Path(a.work).iterdir()):
        raise ValueError(f"--work {a.work}: not empty; give an empty or new folder")


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    result = in_work(a, lambda: check_work(a), run)
    if result is None:
        return 2
    if a.json:
        print(json.dumps(result))
        return 0
    print(f"BLAS threads {result['threads']}; 4 GRPO trials of {a.steps} steps")
    print(f"pomona sweep (2 at once): {result['sweep_s']:.1f} s, "
          f"{result['sweep_per_trial_s']:.1f} s a trial")
    print(f"pomona train, one by one: {', '.join(f'{s:.1f}' for s in result['alone_s'])} s, "
          f"mean {result['alone_mean_s']:.1f} s")
    print(f"sweep / one by one, per trial: {result['ratio']:.2f}x")
    return 0
