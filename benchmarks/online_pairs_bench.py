"""``bench online-pairs``: ORPO on pairs it builds from its own samples (``pairs: online``,
rewarded by the verifier) against ORPO on the data's fixed pairs, from the same warm
start, per seed; the same held-out test prompts scored greedy, with the paired sign test.

    OPENBLAS_NUM_THREADS=1 pomona bench online-pairs --seeds 0,1,2 [--work DIR] [--json]

Steps (each the trainer ``pomona train`` runs, in this process):
1. the demo's data and model, and the SFT warm start of ``bench grpo-learn`` (its greedy
   answers still partly wrong);
2. per seed, from that start, two ORPO runs of ``--steps`` steps, 8 prompts a step: on
   the data's fixed pairs (the right answer chosen, a near miss rejected), and on online
   pairs (G = 8 samples of each prompt, the best and the worst by ``task:parity``; ties
   skipped, so it trains on as many pairs or fewer: both counts are reported);
3. every test prompt completed greedily (6 tokens) by the start and by each adapter,
   scored by the verifier; online against fixed, wins and losses per prompt and the
   two-sided sign test.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.grpo_learning import REWARD, mean, seed_list, seeded_main, started, test_scores

ORPO = {"loss": "orpo", "orpo_lambda": 1.0, "nll_span": "response", "batch_size": 8,
        "lora_rank": 16, "val_every": 0, "report_every": 25, "warmup_steps": 10}
ONLINE = {"pairs": "online", "reward": REWARD, "num_generations": 8,
          "max_completion_length": 6}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks online-pairs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2", help="The seeds (order, samples).")
    p.add_argument("--sft-steps", type=int, default=80, help="The warm start's steps.")
    p.add_argument("--steps", type=int, default=100, help="Each ORPO run's steps.")
    p.add_argument("--learning-rate", type=float, default=2e-4,
                   help="Both runs' (at 5e-4 the online policy fell below its start).")
    p.add_argument("--rows", type=int, default=2200, help="Parity rows (the demo's).")
    p.add_argument("--work", help="Keep the model, data and adapters here (an empty or new "
                                  "folder).")
    p.add_argument("--json", action="store_true", help="Print one JSON object.")
    return p


def orpo(a: argparse.Namespace, model: Path, data: Path, start: Path, seed: int, out: Path,
         online: bool) -> tuple[int, float]:
    """One ORPO run from ``start``, on fixed or online pairs: (pairs trained, seconds)."""
    from engine.settings.config import TrainConfig
    from engine.train.dispatch import train_any

    started = time.perf_counter()
    cfg = TrainConfig(model=str(model), data=str(data), out=str(out), steps=a.steps,
                      seed=seed, warm_start=str(start), learning_rate=a.learning_rate
                      ).replace(**ORPO, **(ONLINE if online else {}))
    result = train_any(cfg)
    return sum(result.rank_pairs), time.perf_counter() - started


def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    from tasks.eval.intervals import paired

    model, data, start, before = started(a, work)
    rows = []
    for seed in seed_list(a.seeds):
        runs = {}
        for kind in ("fixed", "online"):
            out = work / f"orpo-{kind}-s{seed}"
            pairs, seconds = orpo(a, model, data, start, seed, out, kind == "online")
            runs[kind] = {"pairs": pairs, "seconds": seconds,
                          "scores": test_scores(model, data, out)}
        test = paired(runs["online"]["scores"], runs["fixed"]["scores"])
        rows.append({"seed": seed, "prompts": len(before), "start": mean(before),
                     **{f"{k}_{f}": (mean(r["scores"]) if f == "end" else r[f])
                        for k, r in runs.items() for f in ("end", "pairs", "seconds")},
                     "wins": test.wins, "losses": test.losses, "p": test.p})
    return {"threads": os.environ.get("OPENBLAS_NUM_THREADS", "(unset)"), "rows": rows,
            "config": {k: v for k, v in vars(a).items() if k != "json"}}


def main(argv: list[str]) -> int:
    return seeded_main(parser().parse_args(argv), run, lambda r: (
        f"seed {r['seed']}: start {r['start']:.3f}; fixed pairs {r['fixed_end']:.3f} "
        f"({r['fixed_pairs']} pairs, {r['fixed_seconds']:.0f} s); online pairs "
        f"{r['online_end']:.3f} ({r['online_pairs']} pairs, {r['online_seconds']:.0f} s); "
        f"online against fixed: wins {r['wins']}, losses {r['losses']}, sign test "
        f"p = {r['p']:.2g} of {r['prompts']}"))
