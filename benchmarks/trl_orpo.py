"""TRL's ORPOTrainer + PEFT on the model shape Pomona's GPU benchmarks use: the baseline.

    python3 benchmarks/trl_orpo.py --seq 4096 [--gradient-checkpointing] [--liger] --json

Runs in a torch environment (no MLX on the path: transformers imports mlx when it can).
A random-init llama (hidden 2048, 16 layers, GQA 32/8, intermediate 5632, vocab 32000,
bf16, SDPA attention), LoRA r=16 (alpha 32) on q/k/v/o, ``--batch`` pairs per step (1 by
default) whose two sequences are exactly ``--seq`` tokens (prompt:response 4:1, BOS and
EOS included).
A word-level tokenizer maps the text "w17 w4051 ..." to exactly those ids, so TRL's own
tokenization path runs and the lengths are the ones asked for.

Step time = the median interval between consecutive ``on_step_end`` callbacks after
``--warmup`` steps (data collation, forward, backward and the AdamW step all inside);
tokens/s counts both sequences of the pair, as Pomona's bench does. ``--liger``: the same
with ``use_liger_kernel`` (transformers patches the llama's RMSNorm, RoPE and SwiGLU with
Liger's Triton kernels; the liger-kernel wheel is pure Python): what a GPU user who cares
about speed runs. Peak memory is
torch's ``max_memory_allocated`` (and ``max_memory_reserved``) over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from importlib.metadata import version


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def _dataset(a: argparse.Namespace):
    """Pairs of exactly ``--seq`` tokens per sequence once TRL adds BOS and EOS."""
    import random

    from datasets import Dataset

    rng = random.Random(0)
    prompt_len = a.seq * 4 // 5 - 1  # + BOS
    resp_len = a.seq - prompt_len - 2  # + EOS

    def text(n: int) -> str:
        return " ".join(f"w{rng.randrange(3, a.vocab)}" for _ in range(n))

    rows = [{"prompt": text(prompt_len), "chosen": " " + text(resp_len),
             "rejected": " " + text(resp_len)}
            for _ in range((a.warmup + a.steps + 1) * a.batch)]
    return Dataset.from_list(rows)


def run(a: argparse.Namespace) -> dict:
    import torch
    from peft import LoraConfig
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=a.layers, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=5632, vocab_size=a.vocab,
                      max_position_embeddings=a.seq, tie_word_embeddings=False,
                      rms_norm_eps=1e-5, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa",
                                          dtype=torch.bfloat16).cuda()
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            marks.append(time.perf_counter())
            if len(marks) == a.warmup:  # peaks over the timed steps only
                torch.cuda.reset_peak_memory_stats()

    with tempfile.TemporaryDirectory() as out:
        args = ORPOConfig(output_dir=out, per_device_train_batch_size=a.batch,
                          gradient_accumulation_steps=1, max_steps=a.warmup + a.steps,
                          max_length=a.seq, learning_rate=1e-5, bf16=True,
                          gradient_checkpointing=a.gradient_checkpointing,
                          use_liger_kernel=a.liger,
                          logging_steps=10_000, save_strategy="no", report_to=[],
                          dataloader_num_workers=0, seed=0)
        peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        trainer = ORPOTrainer(model=model, args=args, train_dataset=_dataset(a),
                              processing_class=_tokenizer(a.vocab), peft_config=peft,
                              callbacks=[Clock()])
        trainer.train()
    steps = [b - c for b, c in zip(marks[a.warmup:], marks[a.warmup - 1:], strict=False)]
    step_s = statistics.median(steps)
    return {"name": row_name(a.liger, a.gradient_checkpointing), "seq": a.seq,
            "pairs": a.batch, "step_s": step_s, "tokens_per_s": 2 * a.seq * a.batch / step_s,
            "peak_mb": torch.cuda.max_memory_allocated() / 2**20,
            "reserved_mb": torch.cuda.max_memory_reserved() / 2**20,
            "steps_s": steps, "torch": torch.__version__,
            "trl": __import__("trl").__version__,
            "transformers": __import__("transformers").__version__,
            "peft": __import__("peft").__version__, "device": torch.cuda.get_device_name(),
            **({"liger_kernel": version("liger-kernel")} if a.liger else {})}


def row_name(liger: bool, checkpointing: bool) -> str:
    """trl, trl_gc, trl_liger or trl_liger_gc."""
    return "trl" + ("_liger" if liger else "") + ("_gc" if checkpointing else "")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks trl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096, help="Tokens per sequence (pair = 2).")
    p.add_argument("--batch", type=int, default=1, help="Pairs per step.")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--liger", action="store_true", help="use_liger_kernel (liger-kernel).")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", action="store_true", help="Print the result as one JSON line.")
    p.add_argument("--out", help="Also append the JSON line to this file (the trainer prints "
                                 "its own dicts to stdout).")
    a = p.parse_args(argv)
    r = run(a)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(r) + "\n")
    if a.json:
        print(json.dumps(r))
    else:
        print(f"{r['name']} seq {a.seq}: {r['step_s'] * 1e3:.1f} ms/step, "
              f"{r['tokens_per_s'] / 1e3:.1f}k tok/s, peak {r['peak_mb'] / 1024:.1f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
