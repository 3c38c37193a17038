"""mlx-lm-lora's GRPO trainer (``train_grpo``) on the benchmark's model and prompts: the
peer on the MLX backend a Mac user would otherwise run GRPO with.

    python3 -m benchmarks.mlx_lm_lora_grpo --model DIR --data prompts.jsonl --prompts 2 \
        --generations 8 --completion 128 --warmup 2 --steps 4    # its row as one JSON line

Runs in a fresh process, on the same MLX build as Pomona. The model is loaded with mlx-lm,
LoRA r16 (scale 2.0) on q/k/v/o through mlx-lm's ``linear_to_lora_layers``, as Pomona's
bench row has it. Each prompt is handed over already tokenized, as the
``(prompt_ids, answer_ids, prompt_text, answer_text)`` tuple ``iterate_grpo_batches``
reads: its ``GRPODataset`` would render text through a chat template, so it is skipped;
the answer's ids and the prompt's text are left empty (neither reaches the rollout or the
loss; the reward reads the answer text). The reward is one function in its signature,
``contains_answer``: 1.0 when the decoded completion contains the row's ``answer`` string,
else 0.0. Rollouts stop at EOS only (``end_answer_token=""``; its default also stops at
``</answer>``) and sample at ``--temperature`` with top-p and top-k off unless asked
(its defaults: 0.8, 0.95, 20). With ``--beta 0`` no reference model is loaded: its
``grpo_loss`` skips reference scoring when beta is 0; with beta > 0 a second, frozen copy
of the base model is the reference, as its own CLI loads it.

Step time = the median of ``1 / iterations_per_second`` over the reports after
``--warmup`` (one report a step: batching, rollouts, reward, scoring, backward and the Adam
update inside). Its reports carry no generation time, so ``gen_s`` is timed here around
its ``generate_grpo`` (module-level, looked up at call time), which returns only
materialized ids and text. Peak = MLX's peak over the timed steps. Its GRPO path reads the
device's working-set size with ``.get`` (mlx-lm's ``BatchGenerator``), so unlike the ORPO
runner no CPU ``device_info`` stand-in is installed: one would set a wired limit of 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.mlx_lm_lora_orpo import StepTimes, lora_model


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mlx_lm_lora_grpo",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="An mlx-lm model directory.")
    p.add_argument("--data", required=True,
                   help="prompts.jsonl: prompt_ids (token ids) and answer (a string).")
    p.add_argument("--prompts", type=int, default=1, help="Prompts per step (its batch size).")
    p.add_argument("--generations", type=int, default=8,
                   help="Completions per prompt (its group_size).")
    p.add_argument("--completion", type=int, default=128,
                   help="Most tokens per completion (its max_completion_length).")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0, help="1.0: off.")
    p.add_argument("--top-k", type=int, default=0, help="0: off.")
    p.add_argument("--beta", type=float, default=0.0,
                   help="KL coefficient; 0 loads no reference model.")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    return p


def rows_of(path: Path) -> list[tuple[list[int], list[int], str, str]]:
    """The prompts as ``iterate_grpo_batches`` reads them: ids ready for the rollout, the
    answer as text for the reward (its answer ids and prompt text feed nothing we time)."""
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out.append((list(r["prompt_ids"]), [], "", str(r["answer"])))
    return out


def contains_answer(prompts: list, completions: list, answer: list,
                    types: list | None = None) -> list[float]:
    """The bench's reward in mlx-lm-lora's signature: 1.0 if the answer is in the text."""
    return [1.0 if a and a in c else 0.0 for c, a in zip(completions, answer, strict=True)]


def time_rollouts(module: Any, sink: list[float]) -> None:
    """Wrap ``module.generate_grpo`` so each call's wall time lands in ``sink``;
    ``train_grpo`` looks the name up in its module at every step, so the wrap is seen."""
    real: Callable[..., Any] = module.generate_grpo

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = real(*args, **kwargs)  # ids come back as Python ints: nothing left lazy
        sink.append(time.perf_counter() - t0)
        return out

    module.generate_grpo = timed


def reference(a: argparse.Namespace) -> Any:
    """None at beta 0 (its loss skips the reference then); else the frozen base model, the
    policy's start, as its CLI loads it (a second copy: its memory counts in the peak)."""
    if a.beta == 0:
        return None
    from mlx_lm import load

    return load(a.model)[0].freeze()


def args_for(a: argparse.Namespace, longest: int, tmp: str) -> Any:
    from mlx_lm_lora.trainer.grpo_trainer import GRPOTrainingArgs

    return GRPOTrainingArgs(batch_size=a.prompts, iters=a.warmup + a.steps,
                            steps_per_report=1, steps_per_eval=10**9,
                            steps_per_save=10**9, max_seq_length=longest,
                            adapter_file=str(Path(tmp) / "adapters.safetensors"),
                            group_size=a.generations, max_completion_length=a.completion,
                            beta=a.beta, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, min_p=0.0)


def run(a: argparse.Namespace) -> dict[str, Any]:
    import mlx.optimizers as optim
    import mlx_lm_lora.trainer.grpo_trainer as grpo
    from mlx_lm_lora import __version__

    model, tokenizer = lora_model(a.model)
    data = rows_of(Path(a.data))
    longest = max(len(r[0]) for r in data)  # no prompt is cut
    gens: list[float] = []
    time_rollouts(grpo, gens)
    gen_s: list[float] = []
    tokens: list[float] = []

    def more(info: dict[str, Any]) -> None:
        gen_s.append(gens[-1])  # this step's rollouts (no eval runs between)
        tokens.append(info["train_average_generated_tokens"])

    heard = StepTimes(a.warmup, more)
    with tempfile.TemporaryDirectory() as tmp:
        grpo.train_grpo(model, reference(a), tokenizer, optim.Adam(learning_rate=1e-5),
                        data, None, reward_funcs=[contains_answer],
                        args=args_for(a, longest, tmp), training_callback=heard,
                        end_answer_token="")
    return {"name": "mlx-lm-lora-grpo", "version": __version__, "prompts": a.prompts,
            "generations": a.generations, "completion": a.completion,
            "step_s": statistics.median(heard.steps), "steps_s": heard.steps,
            "gen_s": statistics.median(gen_s), "gens_s": gen_s,
            "completion_tokens": statistics.mean(tokens),
            "peak_mb": max(heard.peaks) / 2**20,
            "semantics": "GRPO as mlx-lm-lora runs it: a step = KV-cached rollouts "
                         f"({a.prompts} decoded at once) + contains reward + one update; "
                         f"loss 'grpo', epsilon 1e-4 (ratio 1: one update a rollout), "
                         f"beta {a.beta}" + (" (no reference)" if a.beta == 0 else "")}


def main(argv: list[str]) -> int:
    print(json.dumps(run(parser().parse_args(argv))))  # the row, as the last line
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
