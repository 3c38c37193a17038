"""``bench grpo-learn``: does a model learn from the verifier alone? The demo's tiny model
and parity task, a short SFT warm start, then GRPO per seed; the same held-out test
prompts scored greedy before and after, with the paired sign test.

    OPENBLAS_NUM_THREADS=1 pomona bench grpo-learn --seeds 0,1,2 [--work DIR] [--json]

Steps (each the trainer ``pomona train`` runs, in this process):
1. the demo's data and model (``pomona demo``'s: a random-init llama, 2200 parity rows,
   a tenth each held out for valid and test), tokenized;
2. the warm start: ``--sft-steps`` of ``loss: sft`` on the chosen answers, stopped while
   its greedy answers are still partly wrong (the start the verifier improves on);
3. per seed: ``loss: grpo`` from the warm start, rewarded by ``task:parity`` alone (the
   task's verifier: the answers are never read as targets), its KL at ``--grpo-beta``
   against the warm start (``reference: DIR``); G = 8, 8 prompts a step;
4. every test prompt completed greedily (6 tokens) by the warm start and by each GRPO
   adapter, scored by the verifier; wins and losses per prompt, the two-sided sign test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REWARD = "task:parity"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks grpo-learn", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2", help="GRPO's seeds (rollouts, order).")
    p.add_argument("--sft-steps", type=int, default=80, help="The warm start's steps.")
    p.add_argument("--steps", type=int, default=300, help="GRPO's steps.")
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--grpo-beta", type=float, default=0.2,
                   help="The KL's weight against the warm start.")
    p.add_argument("--rows", type=int, default=2200, help="Parity rows (the demo's).")
    p.add_argument("--work", help="Keep the model, data and adapters here (an empty or new "
                                  "folder).")
    p.add_argument("--json", action="store_true", help="Print one JSON object.")
    return p


def data_and_model(work: Path, rows: int) -> tuple[Path, Path]:
    """The demo's tiny model and its parity rows, tokenized (made once in ``work``)."""
    from tasks.data.synthetic import synth_rows, write_rows
    from tasks.data.tokenize import tokenize_dataset
    from tasks.data.tokenize_options import TokenizeOptions
    from tasks.models.model_factory import ModelSpec, init_model

    model, data = work / "model", work / "data"
    if not model.exists():
        init_model(ModelSpec(tie_embeddings=True), model)
    if not data.exists():
        raw = write_rows(list(synth_rows("parity", rows, seed=0, max_shots=0,
                                         distinct=True)), work / "raw" / "parity.jsonl")
        tokenize_dataset(raw, str(model), data,
                         TokenizeOptions(valid_fraction=0.1, test_fraction=0.1))
    return model, data


def warm_start(a: argparse.Namespace, model: Path, data: Path, work: Path) -> Path:
    """The SFT adapter GRPO starts from (trained once in ``work``)."""
    from tasks.sweep.warm_start import sft_warm_start

    return sft_warm_start(model, data, work / f"sft-{a.sft_steps}", a.sft_steps)


def grpo(a: argparse.Namespace, model: Path, data: Path, start: Path, seed: int,
         out: Path) -> float:
    """One GRPO run from ``start``; its seconds."""
    from engine.settings.config import TrainConfig
    from engine.train.grpo_trainer import train_groups

    started = time.perf_counter()
    train_groups(TrainConfig(model=str(model), data=str(data), out=str(out), steps=a.steps,
                             seed=seed, batch_size=8, lora_rank=16, val_every=0,
                             report_every=25, warmup_steps=10, warm_start=str(start),
                             reference=str(start), learning_rate=a.learning_rate).replace(
        loss="grpo", reward=REWARD, num_generations=8, max_completion_length=6,
        grpo_beta=a.grpo_beta))
    return time.perf_counter() - started


def test_scores(model: Path, data: Path, adapter: Path) -> dict[str, float]:
    """Each test prompt's verifier score of ``adapter``'s greedy completion."""
    from engine.data.prompts import prompts_for
    from engine.forward.generation import greedy_batch
    from engine.losses.grpo import Grpo
    from engine.train.prepared import prepare_scoring
    from engine.train.reward_source import load_reward

    prepared = prepare_scoring(str(model), str(adapter))  # as evaluation loads an adapter
    policy, tokenizer = prepared.model, prepared.tokenizer
    prompts = prompts_for(str(data), str(model), prepared.stack, tokenizer).test
    done = greedy_batch(policy, tokenizer, [p.prompt for p in prompts], 6, 64)
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in done.tokens]
    rewards, _ = load_reward(Grpo(reward=(REWARD,)))([p.prompt_text for p in prompts], texts,
                                                     [p.row() for p in prompts])
    return {p.id: float(r) for p, r in zip(prompts, rewards, strict=True)}


def started(a: argparse.Namespace, work: Path) -> tuple[Path, Path, Path, dict[str, float]]:
    """The model, its data, the warm start in ``work`` and the start's test scores."""
    model, data = data_and_model(work, a.rows)
    start = warm_start(a, model, data, work)
    return model, data, start, test_scores(model, data, start)


def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    from tasks.eval.intervals import paired

    model, data, start, before = started(a, work)
    rows = []
    for seed in seed_list(a.seeds):
        out = work / f"grpo-s{seed}"
        seconds = grpo(a, model, data, start, seed, out)
        after = test_scores(model, data, out)
        test = paired(after, before)
        rows.append({"seed": seed, "prompts": len(after), "start": mean(before),
                     "end": mean(after), "wins": test.wins, "losses": test.losses,
                     "p": test.p, "seconds": seconds})
    return {"threads": os.environ.get("OPENBLAS_NUM_THREADS", "(unset)"), "rows": rows,
            "config": {k: v for k, v in vars(a).items() if k != "json"}}


def mean(scores: dict[str, float]) -> float:
    return sum(scores.values()) / len(scores)


def seed_list(text: str) -> list[int]:
    """``--seeds 0,1,2`` as its integers; ValueError in one line for anything else."""
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--seeds {text!r}: expected integers separated by commas, as "
                         "0,1,2") from None
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"--seeds {text!r}: a seed twice (each seed is one run's folder)")
    return seeds


def check_args(a: argparse.Namespace) -> None:
    """The seeds, counts and ``--work`` refused in one line before any work: ``--work`` must
    be empty or new (this bench writes its model, data and runs there, and measures only
    what it made itself)."""
    seed_list(a.seeds)
    for name, least in (("sft_steps", 1), ("steps", 1), ("rows", 20)):
        if getattr(a, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(a, name)}: must be at "
                             f"least {least}")
    if a.work and Path(a.work).exists() and any(Path(a.work).iterdir()):
        raise ValueError(f"--work {a.work}: not empty; give an empty or new folder")


def in_work(a: argparse.Namespace, check: Callable[[], None],
            run_in: Callable[[argparse.Namespace, Path], dict[str, Any]]
            ) -> dict[str, Any] | None:
    """``run_in(a, work)`` in ``--work`` (or a folder of its own, removed after) once
    ``check`` passes; None, the error printed in one line, when either refuses."""
    try:
        check()
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(a.work or tmp)
            work.mkdir(parents=True, exist_ok=True)
            return run_in(a, work)
    except (ValueError, FileNotFoundError, RuntimeError) as err:  # too few prompts, say
        print(f"error: {err}", file=sys.stderr)
        return None


def seeded_main(a: argparse.Namespace,
                run_in: Callable[[argparse.Namespace, Path], dict[str, Any]],
                line: Callable[[dict[str, Any]], str]) -> int:
    """A bench of seeded runs scored on the test prompts: ``run_in`` once ``check_args``
    passes, then its JSON (``--json``) or a line per seed; 2 when refused."""
    result = in_work(a, lambda: check_args(a), run_in)
    if result is None:
        return 2
    if a.json:
        print(json.dumps(result))
        return 0
    print(f"BLAS threads {result['threads']}; test prompts scored greedy by {REWARD}")
    for r in result["rows"]:
        print(line(r))
    return 0


def main(argv: list[str]) -> int:
    return seeded_main(parser().parse_args(argv), run, lambda r: (
        f"seed {r['seed']}: {r['start']:.3f} -> {r['end']:.3f} of {r['prompts']} "
        f"(wins {r['wins']}, losses {r['losses']}, sign test p = {r['p']:.2g}; "
        f"GRPO {r['seconds']:.0f} s)"))
