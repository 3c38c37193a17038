"""mlx-lm-lora's ORPO trainer (``train_orpo``) on the benchmark's model and pairs: the peer
on the MLX backend a Mac user would otherwise train with.

    python3 -m benchmarks.mlx_lm_lora_orpo --model DIR --data pairs.jsonl --pairs 1 \
        --warmup 3 --steps 8 [--grad-checkpoint]     # its row as one JSON line

Runs in a fresh process (``pomona bench train --peer mlx-lm-lora`` starts it), on the same
MLX build as Pomona. The model is loaded with mlx-lm, LoRA r16 (scale 2.0) on q/k/v/o
through mlx-lm's ``linear_to_lora_layers``, as Pomona's bench row has it; each pair is
handed over already tokenized (prompt + chosen, prompt + rejected, the prompt's length),
since its ``ORPODataset`` renders text through a chat template. Its ORPO is its own: the
NLL and the odds use the mean log-prob of the response alone (Pomona's bench row: NLL over
prompt and response), so the rows time each trainer's own loss, not one loss.

Step time = the median of ``1 / iterations_per_second`` over the reports after
``--warmup`` (one report a step: batching, forward, backward and the Adam update inside);
tokens/s counts both sequences' inputs, as Pomona's bench does (mlx-lm-lora's own figure
counts response tokens only). Peak = MLX's peak over the timed steps. On a CPU, where
``mx.device_info()`` has no ``max_recommended_working_set_size`` and ``train_orpo`` would
stop on it, the process reports 0 for it (a wired limit means nothing there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

KEYS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mlx_lm_lora_orpo",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="An mlx-lm model directory.")
    p.add_argument("--data", required=True, help="The bench's pairs.jsonl (token ids).")
    p.add_argument("--pairs", type=int, default=1, help="Pairs per step (its batch size).")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--grad-checkpoint", action="store_true",
                   help="Its gradient checkpointing (mlx-lm's, per layer).")
    return p


def rows_of(path: Path) -> list[dict[str, Any]]:
    """The pairs as ``iterate_orpo_batches`` reads them: whole sequences and the prompt's
    length, so the response alone is scored (its masks start there)."""
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            prompt = r["prompt_ids"]
            out.append({"chosen": prompt + r["chosen_ids"],
                        "rejected": prompt + r["rejected_ids"],
                        "chosen_prompt_length": len(prompt),
                        "rejected_prompt_length": len(prompt)})
    return out


def device_info_for_cpu() -> None:
    """``train_orpo`` reads ``max_recommended_working_set_size``, which a CPU device lacks."""
    import mlx.core as mx

    real = mx.device_info
    if "max_recommended_working_set_size" not in real():
        mx.device_info = lambda: {**real(), "max_recommended_working_set_size": 0}


def lora_model(path: str) -> tuple[Any, Any]:
    """The model at ``path`` as each mlx-lm-lora row trains it: mlx-lm's load, frozen, LoRA
    r16 (scale 2.0) on q/k/v/o of every layer (Pomona's bench rows' LoRA)."""
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, tokenizer = load(path)
    model.freeze()
    linear_to_lora_layers(model, len(model.layers),
                          {"rank": 16, "scale": 2.0, "dropout": 0.0, "keys": KEYS})
    return model, tokenizer


class StepTimes:
    """mlx-lm-lora's per-step reports after ``warmup``: each step's seconds and MLX's peak
    (reset when the warmup ends); ``more(info)``: what else a row reads from a report."""

    def __init__(self, warmup: int, more: Any = None) -> None:
        self.warmup, self.more = warmup, more
        self.steps: list[float] = []
        self.peaks: list[float] = []

    def on_train_loss_report(self, info: dict[str, Any]) -> None:
        import mlx.core as mx

        if info["iteration"] == self.warmup:
            mx.reset_peak_memory()  # the timed steps' peak from here
        elif info["iteration"] > self.warmup:
            self.steps.append(1.0 / info["iterations_per_second"])
            self.peaks.append(mx.get_peak_memory())
            if self.more is not None:
                self.more(info)

    def on_val_loss_report(self, info: dict[str, Any]) -> None:
        pass


def run(a: argparse.Namespace) -> dict[str, Any]:
    import mlx.optimizers as optim
    from mlx_lm_lora import __version__
    from mlx_lm_lora.trainer.orpo_trainer import ORPOTrainingArgs, train_orpo

    device_info_for_cpu()
    model, _ = lora_model(a.model)
    data = rows_of(Path(a.data))
    longest = max(len(r["chosen"]) for r in data)
    heard = StepTimes(a.warmup)

    with tempfile.TemporaryDirectory() as tmp:
        args = ORPOTrainingArgs(batch_size=a.pairs, iters=a.warmup + a.steps,
                                steps_per_report=1, steps_per_eval=10**9,
                                steps_per_save=10**9, max_seq_length=longest,
                                adapter_file=str(Path(tmp) / "adapters.safetensors"),
                                grad_checkpoint=a.grad_checkpoint)
        train_orpo(model, optim.Adam(learning_rate=1e-5), data, None, args=args,
                   training_callback=heard)
    steps, step_s = heard.steps, statistics.median(heard.steps)
    seq = longest - 1  # a sequence of seq + 1 tokens feeds seq inputs
    return {"name": "mlx-lm-lora" + ("_gc" if a.grad_checkpoint else ""),
            "version": __version__, "seq": seq, "pairs": a.pairs, "step_s": step_s,
            "tokens_per_s": 2 * seq * a.pairs / step_s, "steps_s": steps,
            "peak_mb": max(heard.peaks) / 2**20,
            "semantics": "ORPO as mlx-lm-lora computes it: NLL and odds over the response's "
                         "mean log-prob"}


def main(argv: list[str]) -> int:
    print(json.dumps(run(parser().parse_args(argv))))  # the row, as the last line
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
