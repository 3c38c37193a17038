"""``python -m benchmarks KIND [...]``: the one front end of Pomona's benchmarks.

Each kind keeps its own parser, so ``python -m benchmarks KIND --help`` lists its options.
"""

from __future__ import annotations

import importlib
import sys

from engine.host.parsers import command_parser

# kind → (module, one line); each module's main(argv) runs it.
KINDS = {
    "memory": ("memory_bench", "Peak and step time per lever: plain, checkpointing, segments, "
                               "heads (a fresh process a row)."),
    "prefix": ("prefix_bench", "Two forwards against the shared forward, per prompt:response "
                               "ratio."),
    "group": ("group_bench", "GRPO's update: G separate rows against the group-shared forward."),
    "grpo": ("grpo_bench", "A whole GRPO step (rollouts, reward, update) beside mlx-lm-lora's."),
    "grpo-learn": ("grpo_learning", "GRPO from a verifier alone: held-out greedy scores before "
                                    "and after, paired."),
    "online-pairs": ("online_pairs_bench", "ORPO on pairs built from its own samples by the "
                                           "verifier, beside ORPO on fixed pairs."),
    "grpo-sweep": ("grpo_sweep_cost", "What a sweep costs a GRPO trial, beside the same trials "
                                      "through pomona train one by one."),
    "sweep": ("sweep_cost", "What the sweep itself costs a trial: T trials on S slots, "
                            "each trial's time by phase, the driver's CPU and memory."),
    "attention": ("attention_bench", "MLX's fused attention at query:key shapes."),
    "profile": ("profile_bench", "Where one segmented step's time goes, stage by stage."),
    "ops": ("ops_bench", "One layer's blocks op by op, forward and backward."),
    "tokenize": ("tokenize_bench", "Pomona's tokenizer against Hugging Face datasets.map."),
    "train": ("train_bench", "The real trainer end to end, beside its engine and TRL."),
    "trl": ("trl_orpo", "TRL's ORPOTrainer + PEFT alone (torch only, no MLX)."),
    "update": ("update_cost", "What one optimizer update costs beside the step."),
    "layer-memory": ("layer_memory", "One Gemma 4 layer's backward memory, piece by piece."),
    "allreduce": ("allreduce_cost", "LoRA gradient bytes and all-reduce time per link."),
    "timeline": ("kernel_timeline", "Kernel timeline of trainer and engine steps (CUDA, "
                                    "torch's profiler)."),
    "summary": ("summary", "Tables from a benchmarks/h200.sh results folder."),
    "check": ("check_bench", "The load check on a model: figures, time, refusals of a broken "
                             "stack."),
    "shape": ("shapes", "A published model shape (random weights) as a model directory."),
}
USAGE = """Pomona's benchmarks: each compares paths side by side in one run.

    python -m benchmarks memory --layers 16 --hidden 512 --seq 2048 [--json]
    python -m benchmarks train --seq 4096 [--pairs 1] [--trl] [--json]

GPU sections (results in docs/results/): bash benchmarks/h200.sh SECTION... OUT_DIR."""


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    kinds = {k: help_ for k, (_, help_) in KINDS.items()}
    try:
        args, rest = command_parser(prog, kinds, USAGE).parse_known_args(argv)
    except SystemExit as done:  # --help (0) or a missing/unknown kind (2): a return code
        return int(done.code or 0)
    if args.command != "trl":  # TRL's rows run where MLX stays off the path
        from engine.host.blas import ensure_fast_blas

        ensure_fast_blas()  # Linux CPU: re-run with OpenBLAS preloaded (engine/host/blas.py)
    module = importlib.import_module(f"benchmarks.{KINDS[args.command][0]}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
