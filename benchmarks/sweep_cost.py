"""``bench sweep``: what the sweep itself costs a trial. T short ORPO trials of the demo's
tiny model on S slots, each run as a user runs it (``pomona sweep --no-prefect``, its own
process, a fresh Ray), and where each trial's time went, from its row's ``phase/`` columns.

    OPENBLAS_NUM_THREADS=1 pomona bench sweep [--trials 8 64] [--slots 2] [--steps 5]
        [--reuse-actors off|on|both] [--json]

With ``--reuse-actors both`` each T runs twice, fresh processes then ``reuse_actors:
true``, side by side. For each sweep it prints:
- the wall time against the trials' summed train time over S (what a sweep with no cost of
  its own would take), and the overhead a trial: (wall × S − summed train time) / T;
- each phase's mean a trial: the fresh actor's start, the engine's imports in it, the
  inputs fetched, the run's set-up (model load, load check), its first step, its steps, its
  finish, the result's pull, and the rest of the overhead no phase accounts for (Ray's
  start over T, the scheduler between trials, the actor's end);
- the driver's own CPU seconds a trial and its peak memory (its process alone, sampled).

Prefect is off (``--no-prefect``), so the Prefect API's calls are not counted here.
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

from benchmarks.grpo_learning import data_and_model, in_work

PHASES = ("actor_start", "imports", "inputs", "set_up", "load_check", "first_step", "steps",
          "finish", "pull")
OUTSIDE = ("actor_start", "imports", "inputs", "pull")  # a trial's slot time beyond train_s


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, nargs="+", default=[8, 64], help="Each T to run.")
    p.add_argument("--slots", type=int, default=2, help="Trials at once (max_concurrent).")
    p.add_argument("--steps", type=int, default=5, help="Each trial's steps.")
    p.add_argument("--reuse-actors", choices=("off", "on", "both"), default="off",
                   help="reuse_actors in each sweep; both: each T twice, side by side, fresh "
                        "processes then reuse_actors: true.")
    p.add_argument("--rows", type=int, default=400, help="Parity rows to tokenize.")
    p.add_argument("--work", help="Keep the model, data and sweeps here (an empty or new "
                                  "folder).")
    p.add_argument("--json", action="store_true", help="Print one JSON object.")
    return p


def spec_of(a: argparse.Namespace, model: Path, data: Path, trials: int,
            reuse: bool) -> dict[str, Any]:
    """T trials that differ by seed alone: the same work each, so their costs compare."""
    return {"name": f"cost-{trials}", "model": str(model), "data": str(data),
            "max_concurrent": a.slots, "reuse_actors": reuse,
            "fixed": {"steps": a.steps, "batch_size": 4, "lora_rank": 4, "val_every": 0,
                      "report_every": a.steps, "head_chunk": 16},
            "grid": {"seed": list(range(trials))}}


def watched(args: list[str], log: Path) -> dict[str, float]:
    """``pomona ARGS`` in its own process, its output into ``log``: its wall seconds, and
    its own CPU seconds and peak resident memory (its children, Ray's, apart; sampled
    every 0.2 s, so up to 0.2 s of CPU at its very end goes unseen)."""
    import psutil

    started = time.perf_counter()
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "cli.main", *args], stdout=sink,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, "RAY_ADDRESS": "", "PREFECT_API_URL": ""})
        me, cpu, peak = psutil.Process(proc.pid), 0.0, 0
        while proc.poll() is None:
            try:
                times = me.cpu_times()
                cpu, peak = times.user + times.system, max(peak, me.memory_info().rss)
            except psutil.Error:  # gone between poll and read
                break
            time.sleep(0.2)
    if proc.wait() != 0:
        raise RuntimeError(f"pomona {args[0]} exited {proc.returncode}: "
                           f"{log.read_text().strip().splitlines()[-1:]} (all of it: {log})")
    return {"wall_s": time.perf_counter() - started, "driver_cpu_s": cpu,
            "driver_peak_mb": peak / 2**20}


def one_sweep(a: argparse.Namespace, model: Path, data: Path, work: Path,
              trials: int, reuse: bool = False) -> dict[str, Any]:
    """One sweep of ``trials`` (``reuse``: with reuse_actors), timed, and its rows' phases."""
    import pyarrow.parquet as pq

    name = f"sweep-{trials}{'-reused' if reuse else ''}"
    spec = work / f"{name}.yaml"
    spec.write_text(yaml.safe_dump(spec_of(a, model, data, trials, reuse)))
    out = work / name
    cost = watched(["sweep", str(spec), "--out", str(out), "--no-prefect"], work / f"{name}.log")
    rows = pq.read_table(out / "results.parquet").to_pylist()
    done = [r for r in rows if r["status"] == "completed"]
    if len(done) != trials:
        raise RuntimeError(f"{trials - len(done)} of {trials} trials did not complete: "
                           f"{next((r['reason'] for r in rows if r.get('reason')), '')}")
    train = sum(r["train_s"] for r in done)
    ideal = train / a.slots
    phases = {k: sum(r.get(f"phase/{k}") or 0.0 for r in done) / trials for k in PHASES}
    overhead = (cost["wall_s"] - ideal) * a.slots / trials
    return {"trials": trials, "reuse_actors": reuse, **cost, "train_sum_s": train,
            "ideal_s": ideal, "reused": sum(bool(r.get("reused_actor")) for r in done),
            "overhead_per_trial_s": overhead,
            "unaccounted_per_trial_s": overhead - sum(phases[k] for k in OUTSIDE),
            "driver_cpu_per_trial_ms": 1000 * cost["driver_cpu_s"] / trials,
            "phases_s": phases}


def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    model, data = data_and_model(work, a.rows)
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[a.reuse_actors]
    return {"threads": os.environ.get("OPENBLAS_NUM_THREADS", "(unset)"), "slots": a.slots,
            "steps": a.steps, "sweeps": [one_sweep(a, model, data, work, t, reuse)
                                         for t in a.trials for reuse in modes]}


def check(a: argparse.Namespace) -> None:
    if a.work and Path(a.work).exists() and any(Path(a.work).iterdir()):
        raise ValueError(f"--work {a.work}: not empty; give an empty or new folder")
    if a.slots < 1 or a.steps < 1 or min(a.trials) < 1:
        raise ValueError("--trials, --slots and --steps: at least 1 each")


def table(result: dict[str, Any]) -> list[str]:
    """One line a sweep, then its phases a trial."""
    lines = [f"BLAS threads {result['threads']}; {result['slots']} slots; trials of "
             f"{result['steps']} steps"]
    for s in result["sweeps"]:
        how = f", reuse_actors ({s['reused']} reused)" if s["reuse_actors"] else ""
        lines.append(f"T={s['trials']}{how}: wall {s['wall_s']:.1f} s against {s['ideal_s']:.1f} s "
                     f"of training over the slots; overhead {s['overhead_per_trial_s']:.2f} s "
                     f"a trial; driver {s['driver_cpu_per_trial_ms']:.0f} ms CPU a trial, "
                     f"peak {s['driver_peak_mb']:.0f} MB")
        lines.append("    a trial: " + ", ".join(f"{k} {v:.2f} s"
                                                 for k, v in s["phases_s"].items())
                     + f"; the rest of its overhead {s['unaccounted_per_trial_s']:.2f} s "
                       "(Ray's start and the scheduler, the actor's end)")
    return lines


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    result = in_work(a, lambda: check(a), run)
    if result is None:
        return 2
    print(json.dumps(result) if a.json else "\n".join(table(result)))
    return 0
